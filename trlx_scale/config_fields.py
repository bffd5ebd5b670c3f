"""Config fields shared by the trlx_scale trainers: profiling, reliability, the Hub push.

Mixed into each trainer's config (``GRPOConfig``, ``DPOConfig``) ahead of TRL's class, so a field means the same
thing, with the same default and check, in every trainer. The engine's fields live beside the engine
(``generation/engine_fields.py``), the optimizer presets' beside the presets (``optim/preset_fields.py``). Every component reads them through ``trlx_scale.options.option``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .generation.engine_options import check_positive
from .trl_config_upgrade import registers_options


@registers_options()
@dataclass
class ProfilingFields:
    """Per-phase step profiling (trlx_scale.profiling): ``time/*``, ``throughput/*``, ``perf/mfu`` in the logs."""

    profile_phases: bool = field(
        default=True,
        metadata={
            "help": "Time every phase of each step (generation, weight sync, reward, log-prob passes, loss, "
            "optimizer, ...) on every rank and log the slowest rank's times as time/<phase>, with token throughput "
            "and MFU (docs/profiling.md). Costs well under one percent of a step (logged as time/profiler_fraction)."
        },
    )
    peak_tflops: float | None = field(
        default=None,
        metadata={
            "help": "Peak TFLOP/s of one device, the denominator of perf/mfu. Unset: the bf16 dense peak of known "
            "GPUs (A100, H100, H200, L40S, A10G), a short measured matmul on CPU; MFU is not logged on other GPUs."
        },
    )

    def validate_profiling_fields(self) -> None:
        if self.peak_tflops is not None:
            check_positive("peak_tflops", self.peak_tflops, "It is the TFLOP/s of one device, e.g. 989 for an H100.")


REWARD_ERROR_MODES = ("raise", "skip")
REWARD_SCORING_MODES = ("concurrent", "sequential")


@registers_options()
@dataclass
class ReliabilityFields:
    """Fault handling (trlx_scale.reliability): non-finite steps, failing reward functions, checkpoint integrity."""

    max_consecutive_skipped_steps: int = field(
        default=3,
        metadata={
            "help": "A step whose loss or gradient norm is NaN/inf is skipped (gradients dropped; weights, fp32 "
            "masters and Adam moments untouched; vLLM keeps its weights) and counted in reliability/skipped_steps. "
            "After this many skipped steps in a row training stops with an error. 0 turns the guard off."
        },
    )
    reward_errors: str = field(
        default="raise",
        metadata={
            "help": "What a reward function that raises does to the run. 'raise': stop on every rank with an error "
            "naming the function, the sample index and its completion. 'skip': score that sample NaN (as TRL does "
            "with None: the other functions' rewards still count), count it in reliability/reward_errors, go on. "
            "A reward of inf is an error in both modes. A batch call that raises is retried sample by sample (one "
            "call per sample: a paid judge is called N+1 times) to find the failing sample; each retry is counted in "
            "reliability/reward_retries and the first of each function is logged with the batch's error.",
            "choices": list(REWARD_ERROR_MODES),
        },
    )
    reward_scoring: str = field(
        default="concurrent",
        metadata={
            "help": "How GRPOTrainer, PPOTrainer and online DPOTrainer run a rollout's reward functions. "
            "'concurrent': trlx_scale's scorer (the asynchronous producer's): coroutine functions awaited together, "
            "synchronous ones each in a thread of its own at once, so a slow verifier's latency overlaps another's; "
            "a single synchronous function runs on the trainer's thread, as in TRL. 'sequential': one after the "
            "other on the trainer's thread (TRL's own loop in GRPO and PPO), for functions that are not thread-safe "
            "or need the main thread (signal-based timeouts). A reward model (nn.Module) among the functions is "
            "always scored by TRL's loop. Default by measurement: two synchronous functions of 0.3 s each cost "
            "0.3 s a step instead of 0.6 (docs/benchmarks.md). AsyncGRPOTrainer always scores concurrently.",
            "choices": list(REWARD_SCORING_MODES),
        },
    )
    verify_checkpoints: bool = field(
        default=True,
        metadata={
            "help": "Record the size and SHA-256 of every file of a checkpoint in its completion marker and verify "
            "them on resume: a damaged checkpoint given by path is refused naming the file, resume_from_checkpoint="
            "True falls back to the newest intact one. The hashing is split across ranks; its cost per GB is in "
            "docs/benchmarks.md. False: neither recorded nor verified."
        },
    )
    async_checkpoints: bool = field(
        default=False,
        metadata={
            "help": "Under FSDP2 with fsdp_state_dict_type SHARDED_STATE_DICT: write each rank's model and optimizer "
            "shards in the background (torch.distributed.checkpoint.async_save) while training goes on; the "
            "checkpoint counts (completion marker) only once every rank's shards are durable. Off by default: the "
            "background write holds a host-memory copy of this rank's shards until it lands, and its blocking time "
            "is measured on CPU only so far (docs/benchmarks.md). Ignored elsewhere (DeepSpeed writes its own "
            "per-rank files)."
        },
    )
    save_on_preemption: bool = field(
        default=True,
        metadata={
            "help": "On SIGTERM or SIGUSR1 (Slurm's --signal, Kubernetes, spot instances) finish the current step on "
            "every rank (one rank receiving the signal is enough), save a complete checkpoint and exit with code 75 "
            "(TrainingPreempted); a second signal exits at once. Resume with resume_from_checkpoint=True. False: "
            "the signals keep their previous handlers."
        },
    )

    def validate_reliability_fields(self) -> None:
        if not isinstance(self.max_consecutive_skipped_steps, int) or self.max_consecutive_skipped_steps < 0:
            raise ValueError(
                f"max_consecutive_skipped_steps must be an integer >= 0 (0 turns the non-finite guard off), got "
                f"{self.max_consecutive_skipped_steps!r}."
            )
        if self.reward_errors not in REWARD_ERROR_MODES:
            raise ValueError(
                f"reward_errors must be one of {REWARD_ERROR_MODES} ('raise' stops the run, 'skip' scores the sample "
                f"NaN), got {self.reward_errors!r}."
            )
        if self.reward_scoring not in REWARD_SCORING_MODES:
            raise ValueError(
                f"reward_scoring must be one of {REWARD_SCORING_MODES} ('concurrent' runs the reward functions at "
                f"once, 'sequential' one after the other on the trainer's thread), got {self.reward_scoring!r}."
            )


@registers_options()
@dataclass
class HubFields:
    """How a run goes to the Hugging Face Hub (trlx_scale.hub): what is pushed, and how failures are retried."""

    push_merged: bool = field(
        default=False,
        metadata={
            "help": "Push the LoRA adapter merged into its base (a plain transformers model: config.json + "
            "model.safetensors) instead of the adapter. Needs the whole model in one process (not DeepSpeed/FSDP)."
        },
    )
    hub_push_retries: int = field(
        default=3,
        metadata={
            "help": "Retries of a Hub upload that failed on the server's side (HTTP 5xx, 429, a dropped connection), "
            "with exponential backoff; then an error saying the run is saved locally. Client errors are not retried."
        },
    )
    hub_push_backoff_s: float = field(
        default=2.0,
        metadata={"help": "Seconds before the first retry of a failed Hub upload; doubled at each retry."},
    )

    def validate_hub_fields(self) -> None:
        if not isinstance(self.hub_push_retries, int) or self.hub_push_retries < 0:
            raise ValueError(f"hub_push_retries must be an integer >= 0, got {self.hub_push_retries!r}.")
        if self.hub_push_backoff_s < 0:
            raise ValueError(f"hub_push_backoff_s must be >= 0 seconds, got {self.hub_push_backoff_s}.")
