"""agents/colocated_turn_sampler.py on the real vLLM CPU engine: multi-turn trajectories in this process are
token-in/token-out, and one whose environment is slow does not hold the others (the engine is stepped on)."""

from __future__ import annotations

import asyncio
import threading

import torch

from trlx_scale.agents import GymEnvironment
from trlx_scale.agents.colocated_turn_sampler import ColocatedTurnSampler
from trlx_scale.agents.multi_turn_rollout import run_trajectories
from trlx_scale.agents.trajectory_tokens import ObservationRenderer, TurnBudget


class _Again:
    """After each answer the user asks again, three turns in all; ``hold`` makes its first step wait for an event."""

    def __init__(self, hold: threading.Event | None = None):
        self.hold = hold

    def reset(self, prompt, **row):
        self.turns = 0

    def step(self, message):
        self.turns += 1
        if self.hold is not None and self.turns == 1 and not self.hold.wait(30):
            raise TimeoutError("the other trajectories never finished: the engine waited for this one")
        return "again", 0.0, self.turns == 3, {}


def test_turns_on_the_colocated_engine_are_token_in_token_out_and_not_lockstep(
    vllm_engine, default_model, default_tokenizer
):
    """One trajectory's environment holds its first answer until two others, on the same engine, have finished: a
    lockstep loop (every turn waits for the batch) would never get there."""
    others_done = threading.Event()
    sampler = ColocatedTurnSampler(vllm_engine)
    renderer = ObservationRenderer(default_tokenizer)
    common = dict(
        sampler=sampler,
        renderer=renderer,
        parse=lambda ids: {"role": "assistant", "content": default_tokenizer.decode(ids, skip_special_tokens=True)},
        budget=TurnBudget(max_completion_length=48, max_model_len=64, max_turn_tokens=8),
        tokenizer=default_tokenizer,
    )

    def trajectories(questions, environments, seeds):
        return run_trajectories(
            prompts=[[{"role": "user", "content": q}] for q in questions],
            rows=[{}] * len(questions),
            environments=environments,
            seeds=seeds,
            **common,
        )

    held_environment = GymEnvironment(_Again(hold=others_done))
    other_environments = [GymEnvironment(_Again()), GymEnvironment(_Again())]

    async def rollout():
        held = asyncio.ensure_future(trajectories(["12+30="], [held_environment], [1]))
        others = await trajectories(["7+8=", "41+5="], other_environments, [2, 3])
        others_done.set()
        return await held + others

    finished = asyncio.run(rollout())
    assert sampler.max_in_flight >= 2  # turns of different trajectories were batched together
    assert held_environment.environment.turns >= 1  # its environment was asked, and held, while the others ran
    for trajectory in finished:
        tokens = trajectory.tokens
        ids = torch.tensor([tokens.context_ids])
        with torch.no_grad():
            logps = torch.log_softmax(default_model(input_ids=ids).logits[0, :-1].float(), -1)
        start = len(tokens.prompt_ids)
        trainer = logps[start - 1 :].gather(-1, ids[0, start:, None])[:, 0]
        sampled = torch.tensor(tokens.loss_mask).bool()
        assert (trainer - torch.tensor(tokens.logprobs))[sampled].abs().max().item() < 1e-3
        assert len(tokens.context_ids) <= 64
    for environment in [held_environment, *other_environments]:
        environment.close()
