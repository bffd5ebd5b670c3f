"""Gym-style environments through TRL's ``rollout_func`` contract: ``GRPOTrainer(rollout_func=GymRollout(MyEnv))``.

TRL 1.16's ``environment_factory`` makes an environment's public methods tools: the episode goes on while the model
calls them. Environments that are not tool sets (games, simulators, a user simulator, a judge that answers in text)
answer every assistant turn instead, as SkyRL's, gymnasium's and OpenRLHF's agents do. ``GymRollout`` runs them:

- ``environment_factory()`` makes one environment per trajectory (a group's ``n`` trajectories each get their own),
  an object with ``reset(prompt, **row)`` returning the opening messages (or None: the dataset's prompt) and
  ``step(message)`` returning ``(observation, reward, done, info)`` (or an ``EnvironmentStep``): the observation a
  string (one user message), a list of messages, or None; optionally ``get_reward()`` (the episode's own score, read
  after it ended, as TRL reads it) and ``close()``. Methods may be coroutines; synchronous ones run in a thread pool,
  every call under ``environment_timeout`` (``environments.GymEnvironment``).
- Each trajectory runs at its own pace (``multi_turn_rollout.run_trajectories``, token-in/token-out): its turns are
  sampled on the trainer's engine as soon as its environment answered, the observations rendered alone and masked
  out of the loss (``env_mask``), every turn bounded by the trainer's budgets (``max_completion_length``,
  ``max_turn_tokens``, the engine's context; ``max_tool_calling_iterations`` bounds the environment's answers).
- Rewards, as reward columns the trainer adds after the user's reward functions (weight 1 each unless
  ``reward_weights`` says otherwise): ``<Env>_turns``, the discounted sum of the per-step rewards,
  sum_t discount**t * r_t (t counts the environment's answers, a step without a reward counts 0; None where no step
  gave one), and, when the environment has ``get_reward``, ``<Env>``: its score, undiscounted (TRL's column).
  The user's reward functions get the whole conversation after the prompt as ``trajectory`` (TRL's ``completions``
  is one message parsed from the completion's ids), each step's reward as ``turn_rewards`` and why the episode
  ended as ``stop_reason``.

Where TRL's contract sits: ``rollout_func(prompts, trainer)`` returns ``prompt_ids``, ``completion_ids``,
``logprobs`` and ``env_mask`` (what TRL trains on) and extra fields (what reward functions receive); TRL keeps the
scoring, the advantages and the loss. The trainer runs the episodes (``run_episodes``): ``GRPOTrainer`` on its
colocated engine, ``AsyncGRPOTrainer`` in its producer on the servers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .environments import GymEnvironment
from .multi_turn_rollout import Trajectory, run_trajectories

# Extra fields of the rollout (reward-function keyword arguments) and the names of the reward columns.
TRAJECTORY = "trajectory"
TURN_REWARDS = "turn_rewards"
STOP_REASON = "stop_reason"
DISCOUNTED_RETURN = "environment_turn_return"
FINAL_REWARD = "environment_final_reward"


def discounted_return(turn_rewards: Sequence[float | None], discount: float) -> float | None:
    """sum_t discount**t * r_t over an episode's per-step rewards (a step without one counts 0); None when no step
    gave a reward."""
    if all(reward is None for reward in turn_rewards):
        return None
    return float(sum(discount**t * (reward or 0.0) for t, reward in enumerate(turn_rewards)))


@dataclasses.dataclass
class GymRollout:
    """TRL's ``rollout_func`` for gym-style environments (see the module docstring)."""

    environment_factory: Callable[[], Any]
    turn_reward_discount: float = dataclasses.field(
        default=1.0,
        metadata={
            "help": "The discount of per-step rewards in the <Env>_turns reward column: sum_t discount**t * r_t. "
            "1.0 (default) sums them; below 1 an episode earns less for a reward that comes later."
        },
    )
    environment_timeout: float = dataclasses.field(
        default=60.0,
        metadata={
            "help": "Seconds one reset, step or get_reward call may take; past it the rollout fails with "
            "EnvironmentTimeout naming the call (an environment that hangs is a bug to see, not a turn to skip)."
        },
    )
    max_concurrent: int | None = dataclasses.field(
        default=None,
        metadata={"help": "The most episodes in flight at once (the environments' capacity); None: all of them."},
    )

    def __post_init__(self) -> None:
        if not callable(self.environment_factory):
            raise TypeError(
                f"GymRollout's environment_factory must be a callable that makes an environment (a class), "
                f"got {self.environment_factory!r}."
            )
        if not 0.0 <= self.turn_reward_discount <= 1.0:
            raise ValueError(f"turn_reward_discount must be in [0, 1], got {self.turn_reward_discount}.")
        if not self.environment_timeout > 0:
            raise ValueError(f"environment_timeout must be positive seconds, got {self.environment_timeout}.")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, or None for no bound; got {self.max_concurrent}.")
        probe = self.environment_factory()
        for name in ("reset", "step"):
            if not callable(getattr(probe, name, None)):
                raise TypeError(
                    f"GymRollout's environment ({type(probe).__name__}) needs a callable `{name}`: reset(prompt, **row) "
                    "and step(message) -> (observation, reward, done, info). For tool sets use environment_factory."
                )
        self.name = type(probe).__name__
        self.has_final_reward = callable(getattr(probe, "get_reward", None))
        close = getattr(probe, "close", None)
        if callable(close):
            close()

    # ------------------------------------------------------------------ TRL's contract

    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        """TRL's ``rollout_func(prompts, trainer)``: the trainer runs the episodes on its engine."""
        run = getattr(trainer, "_gym_rollout", None)
        if run is None:
            raise TypeError(
                "GymRollout runs on trlx_scale's trainers (trlx_scale.GRPOTrainer with use_vllm=True and "
                f"vllm_mode='colocate', or trlx_scale.AsyncGRPOTrainer); {type(trainer).__name__} has no engine "
                "for it."
            )
        return run(self, prompts)

    def reward_functions(self) -> list[Callable[..., list[float | None]]]:
        """The reward columns this rollout adds (the module docstring): functions of TRL's reward signature that
        read the extra fields ``trl_output`` returns."""

        def turns(prompts, completions, **kwargs):
            return kwargs[DISCOUNTED_RETURN]

        turns.__name__ = f"{self.name}_turns"
        functions = [turns]
        if self.has_final_reward:

            def final(prompts, completions, **kwargs):
                return kwargs[FINAL_REWARD]

            final.__name__ = self.name
            functions.append(final)
        return functions

    def after_reward_funcs(self, reward_funcs: Any, args: Any) -> list:
        """The user's reward functions followed by this rollout's reward columns, checked against ``reward_weights``
        (a trainer's ``args``; one weight per column, in that order)."""
        if reward_funcs is None:
            user = []
        else:
            user = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        columns = self.reward_functions()
        weights = getattr(args, "reward_weights", None)
        if weights is not None and len(weights) != len(user) + len(columns):
            names = ", ".join(function.__name__ for function in columns)
            raise ValueError(
                f"reward_weights has {len(weights)} entries; with rollout_func=GymRollout(...) the reward columns are "
                f"the {len(user)} reward_funcs followed by the environment's ({names}): give "
                f"{len(user) + len(columns)} weights in that order."
            )
        return user + columns

    # ------------------------------------------------------------------ the episodes

    async def run_episodes(
        self, prompts: Sequence[list[dict[str, Any]]], rows: Sequence[dict[str, Any]], seeds: Sequence[int], **common
    ) -> list[Trajectory]:
        """One episode per prompt, each with a new environment, at its own pace; ``common``: ``run_trajectory``'s
        sampler, renderer, parse, budget, tokenizer and prefix policy. Every environment is closed afterwards."""
        executor = ThreadPoolExecutor(max_workers=min(64, max(1, len(prompts))), thread_name_prefix="trlx-scale-gym")
        environments = [
            GymEnvironment(self.environment_factory(), environment_timeout=self.environment_timeout, executor=executor)
            for _ in prompts
        ]
        try:
            return await run_trajectories(
                prompts=prompts,
                rows=rows,
                environments=environments,
                seeds=seeds,
                max_concurrent=self.max_concurrent,
                **common,
            )
        finally:
            for environment in environments:
                environment.close()
            executor.shutdown(wait=False, cancel_futures=True)  # a timed-out step's thread runs on

    def trl_output(self, trajectories: Sequence[Trajectory]) -> dict[str, list]:
        """What ``rollout_func`` returns to TRL for these episodes (the module docstring)."""
        return {
            "prompt_ids": [list(t.tokens.prompt_ids) for t in trajectories],
            "completion_ids": [list(t.tokens.completion_ids) for t in trajectories],
            "logprobs": [list(t.tokens.logprobs) for t in trajectories],
            "env_mask": [t.tokens.trained_mask for t in trajectories],
            TRAJECTORY: [list(t.completion) for t in trajectories],
            TURN_REWARDS: [list(t.turn_rewards) for t in trajectories],
            STOP_REASON: [t.stop_reason for t in trajectories],
            DISCOUNTED_RETURN: [discounted_return(t.turn_rewards, self.turn_reward_discount) for t in trajectories],
            FINAL_REWARD: [t.final_reward for t in trajectories],
        }
