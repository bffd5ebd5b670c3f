"""Agents: tools and environments a trajectory talks to over several turns (multi-turn rollouts).

- ``tool_runner``: a turn's tool calls run off the trainer's thread, concurrently, each under a timeout, every
  failure (raised, unknown tool, timeout, bad arguments) counted apart and handed back to the model as TRL hands it.
- ``environments``: one interface for TRL's ``tools`` / ``environment_factory`` contracts (a TRL user's environment
  runs unchanged) and gym-style environments (``reset`` / ``step`` returning messages, reward, done).
- ``trajectory_tokens``: a trajectory's tokens as sampled, observations rendered alone and masked out of the loss,
  the template's rendering checked each turn, and the budgets of the next turn.
- ``multi_turn_rollout``: trajectories run each at its own pace (no lockstep) against a ``TurnSampler`` (token
  ids in, sampled ids and log-probs out; ``colocated_turn_sampler`` in the training processes).

- ``tool_call_continuation``: GRPOTrainer's turns after TRL's first, each trajectory at its own pace (wired by
  ``agents/colocated_tool_loop.py``; ``agent_fields``: its config fields);
- ``server_tool_sampler``: ``AsyncGRPOTrainer``'s producer samples whole tool trajectories on the vLLM servers
  (wired by ``async_grpo/tool_loop.py``);
- ``gym_rollout``: ``GymRollout``, gym-style environments through TRL's ``rollout_func`` contract in every trainer
  (wired by ``agents/colocated_gym_rollout.py``; ``server_gym_sampler`` and ``async_grpo/gym_rollout.py`` under
  ``AsyncGRPOTrainer``);
- ``reasoning_gym_environment``: Reasoning Gym's tasks as TRL's environment contract.
"""

from .environments import AgentEnvironment, EnvironmentStep, GymEnvironment, ToolEnvironment
from .gym_rollout import GymRollout
from .tool_runner import ToolCallResult, ToolRunner, ToolStats

__all__ = [
    "AgentEnvironment",
    "EnvironmentStep",
    "GymEnvironment",
    "GymRollout",
    "ToolCallResult",
    "ToolEnvironment",
    "ToolRunner",
    "ToolStats",
]
