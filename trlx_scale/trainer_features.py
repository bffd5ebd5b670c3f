"""``TrainerFeatures``: what every trlx_scale trainer has, held as components, and the transformers overrides that
delegate to them.

Every trainer (GRPO, PPO, DPO, AsyncGRPO, and any built from docs/contributing.md) is

    class MyTrainer(TrainerFeatures, TRLTrainer): ...

This is the one base the trainers share, and it is shared because the methods below are transformers ``Trainer``'s,
overridden the same way in each (TRL's GRPO and DPO trainers are both ``Trainer``s). It holds, built in ``__init__``:

- ``profiler`` (``profiling.trainer_profiling.StepProfiler``): times every phase, counts tokens and FLOPs;
  ``phase_timer`` is its timer, which the trainers open phases on. Built before TRL's ``__init__``: DPO scores its
  reference log-probs there.
- ``memory_planner`` (``planning.trainer_memory.MemoryPlanner``): the planner's verdict and the held memory per
  role in the logs. Built before TRL's ``__init__``: its memory baseline is taken before any model is built.
- ``pass_layout`` (``passes.padding_free_choice.PassLayout``): whether the passes run on packed rows and recompute
  their forwards (decided once, at the first pass), and the layout metrics of every loss pass.
- ``checkpoint_parts`` (``reliability.checkpoint_parts.CheckpointParts``): the named checkpoint state the components
  register (the policy version's here; the trainers add theirs).
- ``nonfinite_guard`` (``reliability.nonfinite_guard.NonFiniteGuard``): skips an optimizer step with a non-finite
  loss or gradient norm (``_get_grad_norm``: transformers computes the norm there, right before the step).
- ``policy`` (``rollout.policy_version.PolicyVersion``, read as ``policy_version``): +1 per optimizer step that
  changed the weights (its callback), saved in each checkpoint (its part), read by the engines.
- ``checkpoints`` (``reliability.checkpoints.AtomicCheckpoints``): completion markers with checksums, verified
  resume, disk-space checks, preemption, asynchronous sharded saves; it saves every checkpoint part before the
  completion marker.
- ``hub_push`` (``hub.push.HubPush``): Hub pushes without secrets, with retries; a checkpoint's push starts once the
  checkpoint is complete (``_on_checkpoint_complete``).
- ``master_weights`` (``optim.trainer_master_weights.MasterWeights``): optimizer presets and fp32 master weights
  (``create_optimizer``).

No behaviour depends on an order of bases: each transformers method is overridden here once, and says in its body
what it runs in which order.

One training step (``training_step``): profiled, the trainer's own step (``_training_step``: TRL's by default;
DPO's online round), then the guard notes its loss; every path of a trainer's step, DPO's batch without pairs
included, goes through the same three. One log pipeline (``log``): the trainer's own metrics seam
(``_before_log``), then the profiler's, the guard's and the planner's metrics, then TRL's ``log``.

``tests/test_trainer_features.py`` trains each trainer a step and checks what each component leaves in the logs.
"""

from __future__ import annotations

import shutil
from typing import Any

import torch

from .hub.push import HubPush
from .optim.trainer_master_weights import MasterWeights
from .passes.padding_free_choice import PassLayout
from .planning.trainer_memory import MemoryPlanner
from .profiling.trainer_profiling import StepProfiler
from .reliability.checkpoint_parts import CheckpointParts
from .reliability.checkpoints import AtomicCheckpoints
from .reliability.disk_space import existing_ancestor
from .reliability.nonfinite_guard import NonFiniteGuard
from .rollout.policy_version import CountPolicyUpdates, PolicyVersion, PolicyVersionPart


class TrainerFeatures:
    """The components of every trlx_scale trainer, and transformers' methods that delegate to them (see the module
    docstring)."""

    def __init__(self, *args, **kwargs):
        model = kwargs.get("model", args[0] if args else None)
        self.checkpoint_parts = CheckpointParts()
        self.policy = PolicyVersion()  # 0: the weights the run starts from (also while TRL's __init__ runs)
        self.profiler = StepProfiler(self, kwargs.get("args"))
        self.phase_timer = self.profiler.phase_timer
        self.memory_planner = MemoryPlanner(self, model)
        self.pass_layout = PassLayout(self)
        # transformers' __init__ already creates the Hub repo (push_to_hub) through init_hf_repo.
        self.checkpoints = AtomicCheckpoints(self)
        self.hub_push = HubPush(self)
        super().__init__(*args, **kwargs)
        self.profiler.start()
        self.nonfinite_guard = NonFiniteGuard(self)
        self.add_callback(CountPolicyUpdates(self))
        self.checkpoint_parts.register("policy_version", PolicyVersionPart(self))
        self.master_weights = MasterWeights(self)
        self.features_ready = True

    # ---------------------------------------------------------------- one training step
    def training_step(self, model, inputs, num_items_in_batch=None):
        with self.profiler.profiled_step():
            loss = self._training_step(model, inputs, num_items_in_batch)
        self.nonfinite_guard.note_loss(loss)
        return loss

    def _training_step(self, model, inputs, num_items_in_batch=None):
        """Seam: the trainer's own step of one micro-batch (TRL's, unless a trainer overrides it)."""
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.memory_planner.note_batch(inputs)
        return super().compute_loss(model, inputs, *args, **kwargs)

    def evaluate(self, *args, **kwargs):
        # An evaluation between steps is part of no phase: everything it runs counts as "other".
        with self.phase_timer.phase("other", absorb=True):
            return super().evaluate(*args, **kwargs)

    # ---------------------------------------------------------------- one log pipeline
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self._before_log()
        extra: dict[str, float] = {}
        for component in (self.profiler, self.nonfinite_guard, self.memory_planner):
            extra.update(component.log_metrics(logs))
        super().log({**logs, **extra}, start_time)

    def _before_log(self) -> None:
        """Seam: a trainer arranges its own metrics (TRL's ``_metrics``) before TRL's ``log`` averages them."""

    # ---------------------------------------------------------------- the optimizer step
    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if not self.master_weights.builds_optimizer:
            return super().create_optimizer(model)
        if self.optimizer is None:
            self.optimizer = self.master_weights.create_optimizer(self.model if model is None else model)
        return self.optimizer

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self.nonfinite_guard.decide(grad_norm)
        return grad_norm

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped by the non-finite guard so far in this run."""
        return self.nonfinite_guard.skipped_total

    def _on_skipped_step(self) -> None:
        """Seam, right before the skipped optimizer step (PPO drops its critic's gradients here)."""

    def _extra_gradients_finite(self) -> torch.Tensor | bool:
        """Seam: gradients stepped outside the trainer's optimizer (PPO's critic) that must be finite as well."""
        return True

    # ---------------------------------------------------------------- the policy version
    @property
    def policy_version(self) -> int:
        """The version of the weights the policy holds now (``policy``: 0 at the start, +1 per optimizer step that
        changed them)."""
        return self.policy.value

    def _weights_were_updated(self) -> bool:
        """Whether the optimizer step that just ran changed the weights: unless the non-finite guard skipped it.
        DeepSpeed steps inside ``backward``, before the guard decides: there every step counts."""
        return bool(getattr(self, "is_deepspeed_enabled", False)) or not self.nonfinite_guard.skip

    def _policy_engine(self) -> Any:
        """Seam: the engine that serves this trainer's policy, if any (GRPO/PPO: the colocated one; DPO: its own)."""
        return None

    def _weights_replaced(self) -> None:
        """Weights loaded from outside the optimizer (a checkpoint, the best model at the end): whatever the version
        numbers say, no engine serves them yet."""
        engine = self._policy_engine()
        if engine is not None:
            engine.served_version = None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._weights_replaced()

    def _load_best_model(self) -> None:
        super()._load_best_model()
        self._weights_replaced()

    # ---------------------------------------------------------------- checkpoints
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        return self.checkpoints.run_training(super().train, resume_from_checkpoint, *args, **kwargs)

    def _finalize_training(self, trial, num_train_samples, start_time):
        # transformers may now load the best checkpoint or rotate checkpoints away: not while one is being written.
        self.checkpoints.finish_pending_saves(block=True)
        return super()._finalize_training(trial, num_train_samples, start_time)

    def _save_checkpoint(self, model, trial) -> None:
        self.checkpoints.save_checkpoint(super()._save_checkpoint, model, trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.checkpoints.save_optimizer_and_scheduler(super()._save_optimizer_and_scheduler, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        self.checkpoints.after_optimizer_loaded(checkpoint)

    def _free_disk_bytes(self, directory: str) -> int:
        """Seam for tests: the free bytes of the filesystem holding ``directory``."""
        return shutil.disk_usage(existing_ancestor(directory)).free

    def _on_checkpoint_complete(self, path: str) -> None:
        """On every rank once a checkpoint is complete (marker written): its Hub push, if one was asked for."""
        self.hub_push.push_checkpoint(path)

    # ---------------------------------------------------------------- the Hub
    def init_hf_repo(self, token: str | None = None) -> None:
        self.hub_push.create_repo(token)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict=state_dict)
        self.hub_push.after_save(output_dir)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.hub_push.saved_consolidated(output_dir, _internal_call):
            return
        # transformers' save_model also uploads when args.push_to_hub is set: a first, unretried upload of the whole
        # output_dir before the run's summary and card exist, then push_to_hub uploads again. Here saving only
        # saves; the upload is push_to_hub's, once (checkpoint uploads during training, hub_strategy, are unchanged).
        super().save_model(output_dir, _internal_call=True)

    def create_model_card(self, *args, **kwargs) -> None:
        super().create_model_card(*args, **kwargs)  # TRL's card: the trainer, its paper, the base model, the tags
        self.hub_push.append_card_section()

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        **kwargs,
    ):
        return self.hub_push.push(commit_message, blocking, token, revision, **kwargs)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # transformers calls this inside _save_checkpoint, before the checkpoint is complete: noted, pushed later.
        self.hub_push.note_checkpoint(checkpoint_folder)

    # ---------------------------------------------------------------- what the memory planner asks
    def _planner_algorithm(self) -> str:
        return "grpo"

    def _planner_num_generations(self) -> int:
        return getattr(self.args, "num_generations", None) or 2

    def _planner_engine(self) -> Any:
        """The colocated engine this trainer runs, if any (an engine on servers holds no memory here)."""
        engine = getattr(self, "vllm_generation", None) if getattr(self, "use_vllm", False) else None
        return engine if getattr(engine, "in_training_processes", True) else None

    def _planner_extra_roles(self) -> dict:
        """RunSpec fields a trainer adds for its own roles (PPO: critic, reference)."""
        return {}

    def _held_roles(self) -> dict[str, tuple[torch.nn.Module, object]]:
        """Each role's module and optimizer, for ``memory/held/<role>_gib``: the policy, and the reference model
        where there is a separate one (a LoRA policy's reference is its own base). PPO adds its critic."""
        roles: dict[str, tuple[torch.nn.Module, object]] = {"policy": (self.model, self.optimizer)}
        reference = getattr(self, "ref_model", None)
        if isinstance(reference, torch.nn.Module):
            roles["reference"] = (reference, None)
        return roles
