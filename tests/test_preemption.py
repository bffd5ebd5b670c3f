"""Preemption: SIGTERM/SIGUSR1 finishes the step, saves a complete checkpoint on every rank's agreement and exits
with code 75; a second signal exits at once; the restarted run resumes and repeats the uninterrupted one.

The runs are tests/scripts/interrupted_run.py (LoRA GRPO on the embedded model, regular saves off: save_steps=100,
so the only checkpoint is the one the signal asked for)."""

from __future__ import annotations

import json
import math
import os
import signal
import sys

import pytest
from transformers import TrainerControl, TrainerState

from trlx_scale.reliability import is_complete_checkpoint
from trlx_scale.reliability.checkpoints import checkpoint_dirs
from trlx_scale.reliability.preemption import (
    PREEMPTED_EXIT_CODE,
    REPEAT_WINDOW_S,
    PreemptionCallback,
    PreemptionHandler,
)

from .helpers.launch import ACCELERATE_LAUNCH, REPO_ROOT, run_result, signal_once_progressed

SCRIPT = os.path.join(REPO_ROOT, "tests", "scripts", "interrupted_run.py")
CPU_DDP = os.path.join(REPO_ROOT, "configs", "accelerate", "cpu_ddp.yaml")
STEPS = 5


def _command(output_dir, *extra, processes: int = 1, port: int = 29591) -> list[str]:
    arguments = [SCRIPT, str(output_dir), "--max_steps", str(STEPS), "--save_steps", "100", *extra]
    if processes == 1:
        return [sys.executable, *arguments]
    return [*ACCELERATE_LAUNCH, "--config_file", CPU_DDP, "--main_process_port", str(port), *arguments]


def _same_metrics(interrupted: dict, straight: dict) -> None:
    assert sorted(interrupted) == sorted(straight) == [str(step) for step in range(1, STEPS + 1)]
    for step, values in straight.items():
        for ours, theirs in zip(interrupted[step], values, strict=True):
            assert math.isclose(ours, theirs, rel_tol=1e-6, abs_tol=1e-9), (step, interrupted[step], values)


def test_sigterm_saves_the_step_in_progress_exits_75_and_the_resumed_run_repeats_the_straight_one(tmp_path):
    straight = run_result(_command(tmp_path / "straight"))
    code, output, finished, _ = signal_once_progressed(
        _command(tmp_path / "run", "--pid_dir", str(tmp_path / "pids")), tmp_path / "pids", 0, [signal.SIGTERM]
    )
    assert code == PREEMPTED_EXIT_CODE, output[-4000:]
    assert "SIGTERM received: finishing this step" in output
    saved = [step for step, path in checkpoint_dirs(str(tmp_path / "run")) if is_complete_checkpoint(path)]
    assert saved == [finished] and 2 <= finished < STEPS  # the step in progress was finished and saved: none lost
    assert f"Preempted by SIGTERM: step {finished} finished and saved" in output
    assert not os.path.exists(tmp_path / "run" / "trlx_scale_main.pid")  # removed when train() ends
    resumed = run_result(_command(tmp_path / "run", "--resume"))
    assert resumed["trained_steps"] == list(range(finished + 1, STEPS + 1))
    _same_metrics(resumed["logged"], straight["logged"])


@pytest.mark.slow
def test_a_signal_to_one_rank_of_two_stops_both_at_the_same_step_and_nothing_is_lost(tmp_path):
    """accelerate launch, 2 processes (cpu_ddp.yaml): SIGUSR1 to rank 1 only, mid-run. Both ranks finish that step,
    the checkpoint is complete (both ranks' parts), and the restart repeats the uninterrupted run's metrics."""
    straight = run_result(_command(tmp_path / "straight", processes=2))
    code, output, finished, _ = signal_once_progressed(
        _command(tmp_path / "run", "--pid_dir", str(tmp_path / "pids"), processes=2, port=29593),
        tmp_path / "pids",
        1,
        [signal.SIGUSR1],
    )
    assert code != 0, output[-4000:]  # the launcher reports its workers' exit code 75 as a failure
    assert "SIGUSR1 received: finishing this step" in output
    assert f"Preempted by a signal on another rank: step {finished} finished" in output  # rank 0 agreed
    saved = [step for step, path in checkpoint_dirs(str(tmp_path / "run")) if is_complete_checkpoint(path)]
    assert saved == [finished] and 2 <= finished < STEPS
    with open(tmp_path / "run" / f"checkpoint-{finished}" / "trlx_scale_checkpoint_complete.json") as handle:
        files = json.load(handle)["files"]
    assert {"rng_state_0.pth", "rng_state_1.pth", "rollout_state_rank1.pt"} <= set(files)
    resumed = run_result(_command(tmp_path / "run", "--resume", processes=2, port=29595))
    assert resumed["trained_steps"] == list(range(finished + 1, STEPS + 1))
    _same_metrics(resumed["logged"], straight["logged"])


def test_a_second_signal_exits_at_once_without_saving(tmp_path):
    code, output, _, _ = signal_once_progressed(
        _command(tmp_path / "run", "--pid_dir", str(tmp_path / "pids"), "--slow_steps", "8"),
        tmp_path / "pids",
        0,
        [signal.SIGTERM, signal.SIGTERM],
        after_step=1,
    )
    assert code == 128 + signal.SIGTERM, output[-4000:]
    assert "second preemption signal (SIGTERM): exiting now, without saving" in output
    assert not any(is_complete_checkpoint(path) for _, path in checkpoint_dirs(str(tmp_path / "run")))


def test_handler_and_callback_without_a_trainer():
    exits: list[int] = []
    now = [100.0]
    handler = PreemptionHandler(exit_now=exits.append, clock=lambda: now[0])
    previous = signal.getsignal(signal.SIGUSR1)
    assert handler.install()
    try:
        callback = PreemptionCallback(handler, any_rank=lambda flag: flag)
        control = callback.on_step_end(None, TrainerState(global_step=3), TrainerControl())
        assert not control.should_save and callback.preempted_at is None  # no signal yet
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.received == signal.SIGUSR1 and handler.signal_name == "SIGUSR1"
        now[0] += REPEAT_WINDOW_S / 2
        os.kill(os.getpid(), signal.SIGTERM)  # the same notice again (the launcher's copy): not a second signal
        assert exits == [] and handler.received == signal.SIGUSR1
        control = callback.on_step_end(None, TrainerState(global_step=4), TrainerControl())
        assert control.should_save and control.should_training_stop and callback.preempted_at == 4
        now[0] += REPEAT_WINDOW_S
        os.kill(os.getpid(), signal.SIGUSR1)
        assert exits == [128 + signal.SIGUSR1]
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is previous  # restored after train()
    # Another rank's signal: this rank received none, the all-reduce says one did.
    other = PreemptionCallback(PreemptionHandler(), any_rank=lambda flag: True)
    assert other.on_step_end(None, TrainerState(global_step=7), TrainerControl()).should_save
    assert other.handler.signal_name == "a signal on another rank"


def test_a_signal_after_the_last_step_is_raised_again_once_training_is_over():
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda number, frame: seen.append(number))
    try:
        handler = PreemptionHandler()
        handler.install()
        os.kill(os.getpid(), signal.SIGUSR1)  # during the final save: no step end will act on it
        handler.uninstall()
        assert seen == []
        handler.reraise_unhandled()
        assert seen == [signal.SIGUSR1]  # the previous handler gets it
    finally:
        signal.signal(signal.SIGUSR1, previous)
