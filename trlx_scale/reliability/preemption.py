"""Preemption: a SIGTERM or SIGUSR1 saves a complete checkpoint and exits with a code that says "resume me".

Slurm (``--signal=USR1@<s>`` before the time limit, or on preemption), Kubernetes (SIGTERM, then SIGKILL after the
grace period) and spot instances warn before they kill. Without a handler the process dies at once and every step
since the last save is lost. Here:

1. The first signal only sets a flag (a Python signal handler runs between bytecodes, so the step in progress is
   never torn).
2. At the end of each optimizer step every rank contributes its flag to one MAX all-reduce: one rank receiving the
   signal is enough, and all ranks decide at the same step (a rank that stopped alone would hang the others in
   their next collective).
3. That step is finished, a complete checkpoint of it is saved (``should_save``: the atomic, checksummed save of
   ``checkpoints.py``), training stops, and ``train()`` raises ``TrainingPreempted``: a ``SystemExit`` with
   ``PREEMPTED_EXIT_CODE`` (75, sysexits' EX_TEMPFAIL: "try again"), so an unchanged script exits with it.
4. A second signal exits at once (``128 + signal``, the shell's convention), for a user who really wants it gone.
   Signals within ``REPEAT_WINDOW_S`` of the first count as the same notice: one preemption often arrives several
   times within milliseconds (Slurm signals every process of the step, torchrun forwards its own copy, a batch
   script forwards another).
5. A signal that arrives after the last step (during the final save or evaluation) is not swallowed: once ``train()``
   is over it is raised again with the previous handler (by default: the process ends). A run preempted at its last
   step has finished: it returns normally.

So the work lost is at most the part of the step in progress past the grace period: a step must finish within the
warning time (Slurm's ``@<s>``; Kubernetes' ``terminationGracePeriodSeconds``). Under ``torchrun``/``accelerate
launch`` a SIGTERM to the launcher reaches the workers, but the launcher kills them 30 s later: signal the workers
(``main_pid_file`` holds rank 0's pid), as ``scripts/slurm/grpo_multinode.sbatch`` does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from transformers import TrainerCallback
from transformers.utils import logging

logger = logging.get_logger(__name__)

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_EXIT_CODE = 75
MAIN_PID_FILE = "trlx_scale_main.pid"  # in output_dir, written by rank 0 while it trains
REPEAT_WINDOW_S = 2.0


class TrainingPreempted(SystemExit):
    """Training stopped on a preemption signal after saving a complete checkpoint; resume from it."""

    def __init__(self, step: int, checkpoint: str, signal_name: str):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step, self.checkpoint, self.signal_name = step, checkpoint, signal_name

    def __str__(self) -> str:
        return (
            f"Preempted by {self.signal_name}: step {self.step} finished and saved in {self.checkpoint}. Resume with "
            f"resume_from_checkpoint=True (exit code {PREEMPTED_EXIT_CODE})."
        )


class PreemptionHandler:
    """Installs the signal handlers for the length of ``train()`` and restores the previous ones after."""

    def __init__(
        self,
        signals: tuple[int, ...] = PREEMPTION_SIGNALS,
        exit_now: Callable[[int], None] = os._exit,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.signals = signals
        self.exit_now = exit_now
        self.clock = clock
        self.received: int | None = None
        self.received_at = 0.0
        self._previous: dict[int, object] = {}

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False  # Python delivers signals to the main thread only; a trainer run in a thread keeps defaults
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._on_signal)
        return True

    def uninstall(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()

    def reraise_unhandled(self) -> None:
        """After ``uninstall``: a signal no step end acted on goes to the previous handler (default: exit)."""
        if self.received is not None:
            signal.raise_signal(self.received)

    def _on_signal(self, number: int, frame) -> None:
        name = signal.Signals(number).name
        if self.received is not None and self.clock() - self.received_at < REPEAT_WINDOW_S:
            return  # the same notice, delivered again (by the launcher, the batch script)
        if self.received is not None:
            sys.stderr.write(f"trlx_scale: second preemption signal ({name}): exiting now, without saving.\n")
            sys.stderr.flush()
            self.exit_now(128 + number)
            return
        self.received, self.received_at = number, self.clock()
        # No logging here: a handler may interrupt the logging module while it holds its lock.
        sys.stderr.write(f"trlx_scale: {name} received: finishing this step, then saving a checkpoint and exiting.\n")
        sys.stderr.flush()

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a signal on another rank"


class PreemptionCallback(TrainerCallback):
    """At each optimizer step's end: did any rank get a signal? Then save this step and stop."""

    def __init__(self, handler: PreemptionHandler, any_rank: Callable[[bool], bool]):
        self.handler = handler
        self.any_rank = any_rank  # True on every rank when it is True on one (a MAX all-reduce)
        self.preempted_at: int | None = None
        self.decided_at: float | None = None  # the handler's clock when every rank agreed to stop (a grace's start)

    def on_step_end(self, args, state, control, **kwargs):
        if self.preempted_at is None and self.any_rank(self.handler.received is not None):
            self.preempted_at = state.global_step
            self.decided_at = self.handler.clock()
            control.should_save = True
            control.should_training_stop = True
        return control


def write_main_pid(output_dir: str) -> str:
    path = os.path.join(output_dir, MAIN_PID_FILE)
    os.makedirs(output_dir, exist_ok=True)
    with open(path, "w") as handle:
        handle.write(f"{os.getpid()}\n")
    return path
