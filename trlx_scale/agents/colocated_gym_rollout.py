"""``GymRolloutMixin``: ``GRPOTrainer(rollout_func=GymRollout(...))`` runs gym-style episodes on the colocated engine.

TRL's ``_generate`` hands a ``rollout_func`` the batch's prompts and the trainer, and trains on what it returns
(``agents.gym_rollout``). This mixin is the trainer's side of that call for a ``GymRollout``: the episodes run on
trlx_scale's colocated engine inside one engine round (``serving_turns``: the trainer's current weights, the engine
asleep afterwards), each at its own pace (``ColocatedTurnSampler``: vLLM's continuous batching takes whatever turns
are ready), each with a seed from the run's seed, the rank, the step and its index (a resumed run samples what the
uninterrupted one sampled), under the trainer's budgets and prefix policy. The environments' ``reset`` gets the
dataset row of its prompt: TRL's contract hands ``rollout_func`` the prompts alone, so the rows ride on the prompt
list (``rollout.carried_values.RolloutPrompts``, built by ``_sample_rollout``).
"""

from __future__ import annotations

from typing import Any

from trl.chat_template_utils import parse_response

from ..compat import trl_trainer_state as trl_state
from ..options import option
from ..rollout.carried_values import RolloutPrompts, rows_of
from ..rollout.collector import RolloutSamples
from .colocated_tool_loop import _run_blocking
from .colocated_turn_sampler import ColocatedTurnSampler
from .gym_rollout import GymRollout
from .multi_turn_rollout import trajectory_metrics
from .trajectory_tokens import ObservationRenderer, TurnBudget


class GymRolloutMixin:
    """Part of ``GRPOTrainer`` (see the module docstring); needs ``ConcurrentToolLoopMixin``'s seeds."""

    # Whether this trainer's ``_gym_rollout`` resets environments from the rows (AsyncGRPOTrainer's producer does
    # that itself, so there the rows TRL would deep-copy go unread).
    _gym_rollout_reads_rows = True

    def _sample_rollout(self, prompts: list, rows: list[dict[str, Any]]) -> RolloutSamples:
        """The collector's sampling stage: TRL's generation driver ``_generate`` on the rollout's prompts, which carry
        their rows to a ``GymRollout`` (only there: TRL deep-copies the list it is given, rows included)."""
        if isinstance(self.rollout_func, GymRollout) and self._gym_rollout_reads_rows:
            prompts = RolloutPrompts(prompts, rows)
        return RolloutSamples(*self._generate(prompts))

    def _gym_rollout(self, gym: GymRollout, prompts: list) -> dict[str, list]:
        engine = self._rollout_engine()
        if engine is None:
            raise ValueError(
                "GymRollout runs its episodes on trlx_scale's colocated vLLM engine: set use_vllm=True and "
                "vllm_mode='colocate' (or use AsyncGRPOTrainer for the servers)."
            )
        rows = rows_of(prompts)
        if rows is None:
            raise RuntimeError(
                "GymRollout got prompts without their dataset rows: trlx_scale's rollout collector calls TRL's "
                "generation driver with them (rollout.carried_values.RolloutPrompts); a rollout built another way "
                "cannot reset the environments from their rows."
            )
        mode = "train" if self.model.training else "eval"
        with self.phase_timer.phase("generation"), engine.serving_turns() as llm:
            sampler = ColocatedTurnSampler(
                llm, lora_request=engine.llm.lora_request, sampling_params=engine.turn_sampling_params
            )
            trajectories = _run_blocking(
                gym.run_episodes(
                    prompts,
                    rows,
                    [self._trajectory_seed(index, mode) for index in range(len(prompts))],
                    sampler=sampler,
                    renderer=ObservationRenderer(self.processing_class, chat_template=self.chat_template),
                    parse=self._gym_turn_parser(),
                    budget=self._gym_budget(llm.llm_engine.model_config.max_model_len),
                    tokenizer=trl_state.tokenizer(self),
                    prefix_mismatch=option(self.args, "prefix_mismatch"),
                )
            )
        output = gym.trl_output(trajectories)
        self._count_generation(output["prompt_ids"], output["completion_ids"])
        metrics = trl_state.metrics(self, mode)
        for name, value in trajectory_metrics(trajectories).items():
            metrics[name].append(value)
        if sampler.max_in_flight:
            metrics["agents/later_turns_max_in_flight"].append(float(sampler.max_in_flight))
        for name, value in engine.pop_metrics().items():
            metrics[name].append(value)
        return output

    def _gym_budget(self, max_model_len: int) -> TurnBudget:
        return TurnBudget(
            max_completion_length=self.max_completion_length,
            max_model_len=max_model_len,
            max_turn_tokens=option(self.args, "max_turn_tokens"),
            max_tool_calling_iterations=self.max_tool_calling_iterations,
            max_tool_response_tokens=option(self.args, "max_tool_response_tokens"),
            tool_response_overflow=option(self.args, "tool_response_overflow"),
        )

    def _gym_turn_parser(self, tokenizer: Any = None):
        """An assistant turn's message: TRL's ``parse_response`` where the tokenizer has a response template (tool
        calls read as TRL reads them), else the decoded text, as TRL decodes completions without one. ``tokenizer``:
        the trainer's by default (the asynchronous producer passes its own copy)."""
        tokenizer = tokenizer if tokenizer is not None else trl_state.tokenizer(self)
        if getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema", None):
            return lambda ids: parse_response(tokenizer, ids)
        return lambda ids: {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
