"""``AsyncGRPOConfig``: ``GRPOConfig`` plus the fields of asynchronous generation on vLLM servers.

Where TRL's experimental ``AsyncGRPOConfig`` has a field, this one has it under the same name and meaning
(``vllm_server_base_url``, ``vllm_server_timeout``, ``request_timeout``, ``max_staleness``, ``weight_sync_steps``,
``max_inflight_tasks``, ``queue_maxsize``), so a TRL async user switches the import. One difference in meaning, on
purpose: ``max_staleness`` is kept by admission control (a group starts only if it will be at most that many
versions old when trained), not by dropping older samples at dequeue; nothing is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..grpo.config import GRPOConfig
from ..trl_config_upgrade import registers_options


@registers_options()
@dataclass
class AsyncGRPOConfig(GRPOConfig):
    r"""
    Configuration for [`trlx_scale.AsyncGRPOTrainer`]: every field of [`trlx_scale.GRPOConfig`] plus the fields of
    asynchronous generation below. Generation runs on vLLM servers (`use_vllm` is implied), overlapping training by
    at most `max_staleness` policy versions; the off-policy correction is TRL's vLLM importance-sampling correction
    with the trainer's log-probs at the start of the step as the proximal policy (the decoupled objective,
    docs/async.md).
    """

    vllm_server_base_url: str | None = field(
        default=None,
        metadata={
            "help": "URL of the vLLM server to generate with (`trlx-scale serve MODEL` starts one and prints it); "
            "several comma-separated URLs are data-parallel replicas (groups balanced over them, every weight "
            "update sent to each). Unset: the trainer starts a server itself on `vllm_server_devices` and stops it "
            "at the end."
        },
    )
    vllm_server_devices: str | None = field(
        default=None,
        metadata={
            "help": "CUDA_VISIBLE_DEVICES of the server the trainer starts when vllm_server_base_url is unset "
            "(GPUs the trainers do not use). Ignored on CPU."
        },
    )
    vllm_server_weight_transfer: str = field(
        default="files",
        metadata={
            "help": "How weight updates reach the servers: 'files' (an adapter per version for a LoRA policy, else "
            "the full weights reloaded in place; what runs on CPU and is tested), or 'nccl' (vLLM's NCCL weight "
            "transfer from the main process's GPU memory to one server with one worker; needs CUDA on both sides "
            "and vllm_sync_mode='full'; not run in this project's tests yet: docs/async.md). A server the trainer "
            "starts gets the matching --weight-transfer-config; start your own with it."
        },
    )
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={"help": "Seconds to wait for a server the trainer starts to answer (TRL's field)."},
    )
    request_timeout: int = field(
        default=600,
        metadata={
            "help": "Seconds a request to the server (a group, a weight update) may take, and the longest the "
            "trainer waits for a step's groups, before the run stops with an error naming the server."
        },
    )
    max_staleness: int = field(
        default=4,
        metadata={
            "help": "How many policy versions older than the trainer's a sample's weights may be (a version per "
            "rollout: per optimizer step unless num_iterations or steps_per_generation make a rollout train several). "
            "Kept by admission control: a group starts only if it will be at most this old when trained (nothing is "
            "dropped). 0: "
            "synchronous generation on the server. Default 4, TRL's: with long-tail completion times the simulated "
            "benchmark reaches 90 percent of the max(generation, training) bound at 4, 63 percent at 2; on a "
            "2-core CPU machine with short completions and a 1 s reward, 1, 2 and 4 reach 1.6x, 2.1x and 1.9x "
            "GRPOTrainer's samples per second (docs/benchmarks.md)."
        },
    )
    weight_sync_steps: int = field(
        default=1,
        metadata={
            "help": "Rollouts (optimizer steps, with one step per rollout) between weight updates sent to the "
            "servers (at most max_staleness + 1)."
        },
    )
    max_inflight_tasks: int = field(
        default=-1,
        metadata={
            "help": "Groups in flight on the servers at most, per rank. -1: every group admission control allows "
            "((max_staleness + 1) steps' worth)."
        },
    )
    queue_maxsize: int = field(
        default=1024,
        metadata={"help": "Groups sampled and not yet trained at most, per rank (in flight included)."},
    )
    async_reward_workers: int = field(
        default=8,
        metadata={
            "help": "Threads that run synchronous reward functions off the training loop, concurrently for the "
            "groups in flight (async reward functions are awaited together on the producer's event loop)."
        },
    )
    async_reward_processes: int = field(
        default=0,
        metadata={
            "help": "Worker processes that run the synchronous reward functions (0: threads of the trainer's process, "
            "async_reward_workers of them). A reward that computes in Python (parsing, math verification) holds the "
            "GIL in a thread and slows the training loop's own Python; in a process it does not. Each function must "
            "be importable by name from a module (not defined in the training script, not a lambda or a closure), "
            "and runs with environment_factory or a GymRollout are refused. Measured with a reward of 0.14 s of "
            "Python per step: 1 process ran 1.20x the threads (docs/benchmarks.md). Default 0 all the same: a "
            "process cannot import the functions most scripts define in themselves, and a reward that waits (a "
            "remote verifier) gains nothing from one."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="token_truncate",
        metadata={
            "help": "TRL's field, with another default here: how the behaviour weight pi_prox / pi_behave of the "
            "off-policy correction is bounded. 'token_truncate' (AReaL's decoupled objective): each token's weight "
            "clipped to [vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max]. Chosen by "
            "measurement: at max_staleness=4 over eight seeds, 200 steps on the embedded task, it ended 0.9 points "
            "of held-out accuracy below synchronous GRPO on the mean (worst seed -5.7), where TRL's default "
            "'sequence_mask' (sequences whose weight leaves the bounds dropped) ended 2.7 below, one seed collapsing "
            "by 14.8 (docs/benchmarks.md). With importance_sampling_level='sequence' (GSPO) and this field at its "
            "default, the weight is taken at the sequence level too: 'sequence_truncate'.",
            "choices": ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"],
        },
    )
    sequence_behaviour_weight: str = field(
        default="geometric_mean",
        metadata={
            "help": "In a sequence mode of vllm_importance_sampling_mode (GSPO's), how a sequence's weight pi_prox / "
            "pi_behave combines its tokens: 'geometric_mean' (exp of their mean log-ratio, GSPO's own length "
            "normalisation, the decoupled objective's: docs/async.md) or 'product' (TRL's: exp of their sum). Chosen by "
            "measurement: an unchanged policy on a bf16 engine against the fp32 trainer (per-token log-ratio std "
            "0.18) leaves the product outside [1/3, 3] for 53 percent of 256-token sequences and 99.9 percent of "
            "4096-token ones, the geometric mean for none (benchmarks/gspo_sequence_weight.py, docs/benchmarks.md).",
            "choices": ["product", "geometric_mean"],
        },
    )
    preemption_grace_period: float = field(
        default=20.0,
        metadata={
            "help": "Seconds a preemption's save (SIGTERM, SIGUSR1) waits for the groups in flight that its "
            "checkpoint's rollout window needs, counted from the end of the step the signal came in. Past it they "
            "are cancelled and the resumed run samples them again, deterministically, from the checkpoint's weights "
            "(fresher, inside the bound). Default 20: well inside Kubernetes' default 30 s grace and a Slurm "
            "--signal=USR1@60 notice, with room for the step in progress and the save itself. Regular saves wait up "
            "to request_timeout, as before."
        },
    )
    full_weight_reload: str = field(
        default="drain",
        metadata={
            "help": "What a full-weight update (vllm_sync_mode='full', or a policy that is not LoRA) does with the "
            "requests in flight at the servers. 'drain': new requests wait and those in flight finish on the old "
            "weights first, so each completion comes from one version: deterministic at any max_staleness (exact "
            "resume), but every update waits for the longest completion in flight. 'keep': vLLM pauses them where "
            "they are (/pause?mode=keep), the weights load, their KV cache is recomputed by the new weights and they "
            "continue; each token carries the version that sampled it (RolloutBatch.token_policy_version, from vLLM's "
            "token-in/token-out endpoint: the servers need --enable-scale-out, which servers the trainer or "
            "`trlx-scale serve` start have) and a completion's version is its oldest token's. Samples then depend on "
            "when an update lands: a resumed run does not repeat an uninterrupted one at max_staleness > 0. LoRA "
            "updates never pause the servers and ignore this. Default 'drain' by measurement: on this project's "
            "2-core CPU machine and task the completions finish before an update lands (0 percent of tokens after "
            "an update), so 'keep' made 1.03x the samples per second, within noise, while a reload under one long "
            "group in flight took 0.093 s against 0.163 s (docs/benchmarks.md).",
            "choices": ["drain", "keep"],
        },
    )
    weight_delivery: str = field(
        default="auto",
        metadata={
            "help": "Where a full-weight update's servers' side runs (pause, reload from the files, prefix-cache "
            "reset, resume, the servers' probe and its check). 'inline': on the trainer's thread, which waits for "
            "it every rollout. 'background': in a thread of its own while the trainer goes on to its next step "
            "(which trains on groups older versions sampled); the version is published to the producer the moment "
            "it is served and verified, and the next update, an evaluation, a checkpoint or the run's end waits "
            "for it first; a failure stops the run at once, by name, on every rank. Needs full weights through files. "
            "With several training processes each rank's thread agrees on every update through a key-value store "
            "the main process hosts, not a collective (generation/delivery_rendezvous.py). 'auto': 'background' "
            "with one training process and full weights through files, else 'inline'. Measured on this project's "
            "2-core CPU machine (one process, full weights, medians of 3): background made 1.10x inline's samples "
            "per second without reward latency (median of nine paired runs) and 1.01x with a 1 s reward "
            "(docs/benchmarks.md), hence the default 'auto'. With 2 processes on the same cores background equalled "
            "inline (median of 18 paired runs 1.01x), so 'auto' leaves several processes inline and 'background' "
            "asks for it.",
            "choices": ["auto", "background", "inline"],
        },
    )
    weight_sync_verify_tolerance: float | None = field(
        default=None,
        metadata={
            "help": "After each weight update the servers' log-probs of a probe sequence must match the trainer's "
            "within this (max absolute difference), or the run stops. None: 1e-3 when the server computes in "
            "float32, 0.1 in 16-bit precision."
        },
    )

    @property
    def optimizer_steps_per_rollout(self) -> int:
        """How many optimizer steps train each rollout: its mini-batches (``steps_per_generation`` micro-batches,
        ``gradient_accumulation_steps`` per step) times ``num_iterations``. The staleness bound, the servers'
        weight versions and ``weight_sync_steps`` count rollouts."""
        return self.steps_per_generation // self.gradient_accumulation_steps * self.num_iterations

    def __post_init__(self) -> None:
        self.use_vllm = True
        self.vllm_mode = "server"
        super().__post_init__()
        if self.dynamic_sampling and self.dynamic_sampling_max_carry is not None:
            raise ValueError(
                "dynamic_sampling_max_carry: AsyncGRPOTrainer carries no group over (its producer replaces each "
                "dropped group as soon as it is scored, so no step has a surplus). Leave it unset."
            )
        default_oversample = type(self).__dataclass_fields__["dynamic_sampling_max_oversample"].default
        if self.dynamic_sampling and self.dynamic_sampling_max_oversample != default_oversample:
            raise ValueError(
                "dynamic_sampling_max_oversample: AsyncGRPOTrainer has no generation rounds to over-sample (its "
                "producer replaces each dropped group as soon as it is scored; dynamic_sampling_max_rounds bounds the "
                "groups one slot samples). Leave it at its default."
            )
        if self.importance_sampling_level == "sequence" and self.vllm_importance_sampling_mode == "token_truncate":
            # GSPO (its recipe sets the level): the behaviour weight at the level of the objective's ratio.
            self.vllm_importance_sampling_mode = "sequence_truncate"
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}.")
        if self.weight_sync_steps < 1 or self.weight_sync_steps > self.max_staleness + 1:
            raise ValueError(
                f"weight_sync_steps ({self.weight_sync_steps}) must be between 1 and max_staleness + 1 "
                f"({self.max_staleness + 1}): between two syncs the trainer trains on samples that many steps old."
            )
        if self.steps_per_generation % self.gradient_accumulation_steps:
            raise ValueError(
                f"steps_per_generation ({self.steps_per_generation}) must be a multiple of "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps}) for asynchronous generation: a "
                "rollout trains whole optimizer steps, and the servers get weights between rollouts. Leave "
                "steps_per_generation unset for one optimizer step per rollout."
            )
        if self.sequence_behaviour_weight not in ("product", "geometric_mean"):
            raise ValueError(
                f"sequence_behaviour_weight={self.sequence_behaviour_weight!r}: choose 'product' (TRL's) or "
                "'geometric_mean' (GSPO's length normalisation)."
            )
        if self.full_weight_reload not in ("drain", "keep"):
            raise ValueError(
                f"full_weight_reload={self.full_weight_reload!r}: choose 'drain' (requests in flight finish on the "
                "old weights) or 'keep' (they continue on the new ones, each token tagged with its version)."
            )
        if self.full_weight_reload == "keep" and self.vllm_server_weight_transfer == "nccl":
            raise ValueError(
                "full_weight_reload='keep' reloads the weight files with the requests paused in place; vLLM's NCCL "
                "transfer (vllm_server_weight_transfer='nccl') has not been run that way here: use "
                "full_weight_reload='drain' with it."
            )
        if self.weight_delivery not in ("auto", "background", "inline"):
            raise ValueError(
                f"weight_delivery={self.weight_delivery!r}: choose 'auto', 'background' (a full-weight update's "
                "servers' side in a thread while the trainer goes on) or 'inline' (the trainer waits for it)."
            )
        if self.vllm_server_weight_transfer not in ("files", "nccl"):
            raise ValueError(
                f"vllm_server_weight_transfer={self.vllm_server_weight_transfer!r}: choose 'files' (updates as "
                "files the servers load) or 'nccl' (vLLM's NCCL weight transfer, GPUs only)."
            )
        evaluation = str(getattr(self.eval_strategy, "value", self.eval_strategy))
        steps = self.optimizer_steps_per_rollout
        if (
            evaluation == "steps"
            and steps > 1
            and float(self.eval_steps or 0).is_integer()
            and self.eval_steps % steps
        ):
            raise ValueError(
                f"eval_steps={self.eval_steps} with {steps} optimizer steps per rollout (steps_per_generation / "
                "gradient_accumulation_steps x num_iterations): evaluation samples with the weights the servers can "
                f"hold, which exist at rollout boundaries only. Make eval_steps a multiple of {steps}."
            )
        if evaluation != "no" and self.weight_sync_steps != 1:
            raise ValueError(
                f"eval_strategy={evaluation!r} with weight_sync_steps={self.weight_sync_steps}: evaluation samples "
                "with the trainer's current weights, which the servers get only every weight_sync_steps-th step. "
                "Set weight_sync_steps=1, or eval_strategy='no' and evaluate the saved model."
            )
        if self.preemption_grace_period < 0:
            raise ValueError(
                f"preemption_grace_period must be >= 0 seconds, got {self.preemption_grace_period}: it bounds how "
                "long a preempted save waits for the groups in flight (0: not at all)."
            )
        if self.request_timeout <= 0 or self.vllm_server_timeout <= 0:
            raise ValueError("request_timeout and vllm_server_timeout must be positive (seconds).")
        if self.async_reward_workers < 1:
            raise ValueError(f"async_reward_workers must be at least 1, got {self.async_reward_workers}.")
        if self.async_reward_processes < 0:
            raise ValueError(
                f"async_reward_processes must be 0 (threads) or a number of processes, got {self.async_reward_processes}."
            )
        self._check_sampling_settings()

    def _check_sampling_settings(self) -> None:
        """Refuse, by name, each generation field that would not reach the server or would bias the correction."""
        # A truncating or penalising sampler: the server reports log-probs of the processed distribution it sampled
        # from, the trainer computes those of the plain temperature-scaled one, so pi_prox / pi_behave is not 1 even
        # for an unchanged policy (measured: top_p=0.9 at max_staleness=0 gave behaviour weights of 0.90-0.91).
        biased = {
            "top_p": self.top_p is not None and self.top_p < 1.0,
            "top_k": bool(self.top_k) and self.top_k > 0,
            "min_p": bool(self.min_p),
            "repetition_penalty": self.repetition_penalty not in (None, 1.0),
        }
        for name, is_set in biased.items():
            if is_set:
                raise ValueError(
                    f"{name}={getattr(self, name)!r}: under asynchronous generation the off-policy correction needs "
                    "the sampler's and the trainer's log-probs of the same distribution, and the trainer's ignore "
                    f"{name} (the weights of an unchanged policy would not be 1). Leave {name} at its default and "
                    "shape the distribution with temperature, or use GRPOTrainer."
                )
        unsent = {
            "generation_kwargs": "the server's sampling parameters are the config's fields",
            "vllm_structured_outputs_regex": "structured outputs are not requested from the server yet",
        }
        for name, why in unsent.items():
            if getattr(self, name, None):
                raise ValueError(
                    f"{name} is set, but AsyncGRPOTrainer does not send it to the server ({why}): unset it."
                )
        if self.vllm_max_model_length and self.vllm_server_base_url:
            raise ValueError(
                f"vllm_max_model_length={self.vllm_max_model_length} applies to a server the trainer starts; the "
                "servers at vllm_server_base_url were started by you: give them --max-model-len and unset the field."
            )

    @property
    def server_urls(self) -> list[str]:
        """The servers' URLs (empty: the trainer starts one)."""
        if not self.vllm_server_base_url:
            return []
        return [url.strip() for url in self.vllm_server_base_url.split(",") if url.strip()]
