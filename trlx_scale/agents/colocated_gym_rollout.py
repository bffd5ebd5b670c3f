"""``ColocatedGymRollout``: ``GRPOTrainer(rollout_func=GymRollout(...))`` runs gym-style episodes on the colocated engine.

TRL's ``_generate`` hands a ``rollout_func`` the batch's prompts and the trainer, and trains on what it returns
(``agents.gym_rollout``). This component (``GRPOTrainer.gym_rollout``) is the trainer's side of that call for a ``GymRollout``: the episodes run on
trlx_scale's colocated engine inside one engine round (``serving_turns``: the trainer's current weights, the engine
asleep afterwards), each at its own pace (``ColocatedTurnSampler``: vLLM's continuous batching takes whatever turns
are ready), each with a seed from the run's seed, the rank, the step and its index (a resumed run samples what the
uninterrupted one sampled), under the trainer's budgets and prefix policy. The environments' ``reset`` gets the
dataset row of its prompt: TRL's contract hands ``rollout_func`` the prompts alone, so the rows come from the
generation call the sampling stage binds (``compat.trl_generation_call``).
"""

from __future__ import annotations

from typing import Any

from trl.chat_template_utils import parse_response

from ..compat import trl_trainer_state as trl_state
from ..compat.trl_generation_call import current_generation_call
from ..trainer_part import TrainerPart
from .colocated_tool_loop import _run_blocking
from .colocated_turn_sampler import ColocatedTurnSampler
from .gym_rollout import GymRollout
from .multi_turn_rollout import trajectory_metrics
from .trajectory_tokens import ObservationRenderer, TurnBudget


class ColocatedGymRollout(TrainerPart):
    """``GRPOTrainer``'s gym episodes (``gym_rollout``; see the module docstring): its ``_gym_rollout`` runs ``run``.
    Its seeds are the tool loop's (``tool_loop.trajectory_seed``)."""

    def run(self, gym: GymRollout, prompts: list) -> dict[str, list]:
        """The episodes of ``gym`` for these prompts (each carrying its row) on the colocated engine, as TRL's output."""
        engine = self.trainer._rollout_engine()
        if engine is None:
            raise ValueError(
                "GymRollout runs its episodes on trlx_scale's colocated vLLM engine: set use_vllm=True and "
                "vllm_mode='colocate' (or use AsyncGRPOTrainer for the servers)."
            )
        call = current_generation_call()
        if call is None:
            raise RuntimeError(
                "GymRollout got prompts without their dataset rows: trlx_scale's rollout collector calls TRL's "
                "generation driver inside a generation call that carries them (compat.trl_generation_call); a "
                "rollout built another way cannot reset the environments from their rows."
            )
        rows = call.rows
        mode = "train" if self.trainer.model.training else "eval"
        with self.trainer.phase_timer.phase("generation"), engine.serving_turns() as llm:
            sampler = ColocatedTurnSampler(
                llm, lora_request=engine.llm.lora_request, sampling_params=engine.turn_sampling_params
            )
            trajectories = _run_blocking(
                gym.run_episodes(
                    prompts,
                    rows,
                    [self.trainer.tool_loop.trajectory_seed(index, mode) for index in range(len(prompts))],
                    sampler=sampler,
                    renderer=ObservationRenderer(
                        self.trainer.processing_class, chat_template=self.trainer.chat_template
                    ),
                    parse=self.turn_parser(),
                    budget=self.budget(llm.llm_engine.model_config.max_model_len),
                    tokenizer=trl_state.tokenizer(self.trainer),
                    prefix_mismatch=self.trainer.args.prefix_mismatch,
                )
            )
        output = gym.trl_output(trajectories)
        self.trainer.profiler.count_generation(output["prompt_ids"], output["completion_ids"])
        metrics = trl_state.metrics(self.trainer, mode)
        for name, value in trajectory_metrics(trajectories).items():
            metrics[name].append(value)
        if sampler.max_in_flight:
            metrics["agents/later_turns_max_in_flight"].append(float(sampler.max_in_flight))
        for name, value in engine.pop_metrics().items():
            metrics[name].append(value)
        return output

    def budget(self, max_model_len: int) -> TurnBudget:
        return TurnBudget(
            max_completion_length=self.trainer.max_completion_length,
            max_model_len=max_model_len,
            max_turn_tokens=self.trainer.args.max_turn_tokens,
            max_tool_calling_iterations=self.trainer.max_tool_calling_iterations,
            max_tool_response_tokens=self.trainer.args.max_tool_response_tokens,
            tool_response_overflow=self.trainer.args.tool_response_overflow,
        )

    def turn_parser(self, tokenizer: Any = None):
        """An assistant turn's message: TRL's ``parse_response`` where the tokenizer has a response template (tool
        calls read as TRL reads them), else the decoded text, as TRL decodes completions without one. ``tokenizer``:
        the trainer's by default (the asynchronous producer passes its own copy)."""
        tokenizer = tokenizer if tokenizer is not None else trl_state.tokenizer(self.trainer)
        if getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema", None):
            return lambda ids: parse_response(tokenizer, ids)
        return lambda ids: {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
