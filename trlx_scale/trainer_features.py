"""``TrainerFeatures``: the cross-cutting features every trlx_scale trainer has, assembled in one place.

Every trainer (GRPO, PPO, DPO, and any built from docs/contributing.md) is

    class MyTrainer(TrainerFeatures, TRLTrainer): ...

and gets, in this order of the MRO (the order matters where two features override the same transformers method;
each reason is given):

1. ``PhaseProfilerMixin`` (profiling/): times every phase. First, so that its timing of a training step wraps
   everything the other features do in it.
2. ``NonFiniteGuardMixin`` (reliability/): skips an optimizer step with a non-finite loss or gradient norm. It hooks
   ``_get_grad_norm`` (transformers computes the norm there, right before the step) and its callback drops the
   gradients in ``on_pre_optimizer_step``.
3. ``PolicyVersionMixin`` (rollout/): the policy version, +1 per optimizer step that changed the weights (after the
   guard decided), saved in each checkpoint. Before ``AtomicCheckpointMixin``: its state joins the checkpoint
   before the completion marker is written.
4. ``AtomicCheckpointMixin`` (reliability/): completion markers with checksums, verified resume, disk-space checks,
   preemption, asynchronous sharded saves; it saves every part of ``checkpoint_parts`` (the named checkpoint
   state the components register: ``reliability.checkpoint_parts``) before the completion marker.
5. ``HubPushMixin`` (hub/): Hub pushes without secrets, with retries; after the checkpoint feature, whose
   ``_on_checkpoint_complete`` seam starts a checkpoint's push.
6. ``PlannedMemoryMixin`` (planning/): the planner's verdict and the held memory per role in the logs.
7. ``MasterWeightsMixin`` (optim/): optimizer presets and fp32 master weights (``create_optimizer``); last, nearest
   TRL, whose optimizer it replaces.

One init protocol (``__init__`` here, the only one of the features): what must exist before TRL's ``__init__`` runs
(the profiler's timer: DPO scores its reference there; the planner's memory baseline: before any model is built),
then TRL's ``__init__``, then each feature's post-init setup in the order above, once. A trainer's own ``__init__``
does its pre-TRL work, calls ``super().__init__`` and then finds every feature ready.

One training step (``training_step``): profiled, the trainer's own step (``_training_step``: TRL's by default;
DPO's online round), then the guard notes its loss; every path of a trainer's step, DPO's batch without pairs
included, goes through the same three.

One log pipeline (``log``): the trainer's own metrics seam (``_before_log``), then each feature's contribution in the
order above (profiler, guard, memory), then TRL's ``log``.

``tests/test_trainer_features.py`` fails when a trainer class lacks ``TrainerFeatures`` or one of its features has
not run its setup.
"""

from __future__ import annotations

from .hub.push import HubPushMixin
from .optim.master_weights_mixin import MasterWeightsMixin
from .planning.trainer_memory import PlannedMemoryMixin
from .profiling.trainer_profiling import PhaseProfilerMixin
from .reliability.checkpoint_parts import CheckpointParts
from .reliability.checkpoints import AtomicCheckpointMixin
from .reliability.nonfinite_guard import NonFiniteGuardMixin
from .rollout.policy_version import PolicyVersionMixin

FEATURES: tuple[type, ...] = (
    PhaseProfilerMixin,
    NonFiniteGuardMixin,
    PolicyVersionMixin,
    AtomicCheckpointMixin,
    HubPushMixin,
    PlannedMemoryMixin,
    MasterWeightsMixin,
)


class TrainerFeatures(*FEATURES):
    """The features of every trlx_scale trainer, mixed in ahead of TRL's trainer class (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        model = kwargs.get("model", args[0] if args else None)
        # The named checkpoint state every component registers its part in (reliability.checkpoint_parts).
        self.checkpoint_parts = CheckpointParts()
        self._setup_profiler_before_trl(kwargs.get("args"))
        self._setup_planner_before_trl(model)
        super().__init__(*args, **kwargs)
        self._setup_features()

    def _setup_features(self) -> None:
        """Each feature's setup after TRL's ``__init__``, in the declared order, once."""
        self._setup_profiler()
        self._setup_nonfinite_guard()
        self._setup_policy_version()
        self._setup_master_weights()
        self.features_ready = True

    # ---------------------------------------------------------------- one training step
    def training_step(self, model, inputs, num_items_in_batch=None):
        with self._profiled_step():
            loss = self._training_step(model, inputs, num_items_in_batch)
        self._guard_note_loss(loss)
        return loss

    def _training_step(self, model, inputs, num_items_in_batch=None):
        """Seam: the trainer's own step of one micro-batch (TRL's, unless a trainer overrides it)."""
        return super().training_step(model, inputs, num_items_in_batch)

    # ---------------------------------------------------------------- one log pipeline
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self._before_log()
        extra: dict[str, float] = {}
        for contribution in (self._profiler_log_metrics, self._guard_log_metrics, self._memory_log_metrics):
            extra.update(contribution(logs))
        super().log({**logs, **extra}, start_time)

    def _before_log(self) -> None:
        """Seam: a trainer arranges its own metrics (TRL's ``_metrics``) before TRL's ``log`` averages them."""
