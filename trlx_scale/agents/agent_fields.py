"""Config fields of multi-turn tool calling (``GRPOConfig`` and the trainers built on it: PPO)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..trl_config_upgrade import registers_options
from .trajectory_tokens import PREFIX_MISMATCH_POLICIES

TOOL_SCHEDULINGS = ("concurrent", "lockstep")
TOOL_RESPONSE_OVERFLOW = ("truncate", "drop")
PREFIX_MISMATCH = PREFIX_MISMATCH_POLICIES


# A plain TRL config runs TRL's own loop, as TRL does.
@registers_options(plain_trl_defaults={"tool_scheduling": "lockstep"})
@dataclass
class AgentFields:
    """How a multi-turn rollout's tool calls and later turns are scheduled (``tools`` / ``environment_factory``)."""

    tool_scheduling: str = field(
        default="concurrent",
        metadata={
            "help": "With tools or an environment_factory on the colocated vLLM engine: 'concurrent' runs each "
            "trajectory at its own pace after the first turn (its tool calls run concurrently off the trainer's "
            "thread under tool_timeout, and its next turn goes to the engine as soon as its tools returned, while "
            "other trajectories generate or wait on theirs: vLLM's continuous batching takes whatever is ready); "
            "'lockstep' is TRL's loop (every turn waits for the whole batch's generations and tools, synchronous "
            "tools one after another). Under 'concurrent' an environment_factory's reset calls also run all at "
            "once off the trainer's thread, each under tool_timeout; 'lockstep' keeps TRL's serial resets (for "
            "resets that are not thread-safe). The same tokens, masks and messages either way. Default 'concurrent': "
            "faster whenever tools take time or trajectories need different numbers of turns "
            "(docs/benchmarks.md, 'Multi-turn tool calls'). Other engines always use TRL's loop.",
            "choices": list(TOOL_SCHEDULINGS),
        },
    )
    tool_timeout: float = field(
        default=300.0,
        metadata={
            "help": "Seconds a tool call may take under tool_scheduling='concurrent'; past it the call is cancelled "
            "(a coroutine) or abandoned (a synchronous tool's thread runs on, its result dropped) and the model "
            "reads a tool error, as for a tool that raised. Counted apart in tools/timeout. Also the bound of each "
            "environment's reset, past which the step stops with EnvironmentResetTimeout. Default 300: a safety "
            "bound, not a speed setting (no step waits on a hung tool past it), above the minutes a sandboxed test "
            "run can take."
        },
    )

    max_turn_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Under tool_scheduling='concurrent': the most tokens one later turn may sample (each turn's "
            "max_tokens is the least of this, what is left of max_completion_length and what is left of the "
            "engine's context). None: only the last two."
        },
    )
    max_tool_response_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Under tool_scheduling='concurrent': the most tokens of one tool result the model reads; a longer "
            "one is cut or replaced as tool_response_overflow says (counted in agents/truncated_tool_responses). "
            "None: results are not capped (TRL's loop)."
        },
    )
    tool_response_overflow: str = field(
        default="truncate",
        metadata={
            "help": "What a tool result over max_tool_response_tokens becomes: 'truncate' keeps its first tokens, "
            "'drop' replaces it by an error message the model reads.",
            "choices": list(TOOL_RESPONSE_OVERFLOW),
        },
    )

    prefix_mismatch: str = field(
        default="keep",
        metadata={
            "help": "Under tool_scheduling='concurrent' (and AsyncGRPOTrainer's tools): before each later turn, the "
            "held ids (the tokens sampled, the tool results rendered alone) are checked to be a prefix of the chat "
            "template's rendering of the whole conversation, as TRL renders prompts. A mismatch means a re-tokenizing "
            "stack would train other tokens than the sampled ones (a template that rewrites history, a tool call "
            "written otherwise than the template writes it). 'keep' trains the sampled tokens and counts it "
            "(agents/prefix_mismatches), 'discard' ends the trajectory there and masks it out of the loss "
            "(agents/stopped_prefix_mismatch_frac), 'off' renders nothing. 'keep' is the default: it changes no "
            "training, and a check costs 0.14-0.16 ms (one render of a 109-token conversation, "
            "benchmarks/prefix_check_cost.py) against tens of milliseconds for a turn.",
            "choices": list(PREFIX_MISMATCH),
        },
    )

    def validate_agent_fields(self) -> None:
        if self.tool_scheduling not in TOOL_SCHEDULINGS:
            raise ValueError(
                f"tool_scheduling must be one of {TOOL_SCHEDULINGS}, got {self.tool_scheduling!r} ('concurrent' "
                "runs each trajectory at its own pace, 'lockstep' is TRL's loop)."
            )
        if not self.tool_timeout > 0:
            raise ValueError(f"tool_timeout must be positive seconds, got {self.tool_timeout}.")
        for name in ("max_turn_tokens", "max_tool_response_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 token, or None for no cap; got {value}.")
        if self.tool_response_overflow not in TOOL_RESPONSE_OVERFLOW:
            raise ValueError(
                f"tool_response_overflow must be one of {TOOL_RESPONSE_OVERFLOW}, got {self.tool_response_overflow!r}."
            )
        if self.prefix_mismatch not in PREFIX_MISMATCH:
            raise ValueError(
                f"prefix_mismatch must be one of {PREFIX_MISMATCH}, got {self.prefix_mismatch!r} ('keep' counts a "
                "mismatch, 'discard' masks the trajectory out of the loss, 'off' does not check)."
            )
