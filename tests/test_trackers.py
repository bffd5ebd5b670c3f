"""`--report_to tensorboard` on a user's run: the event file holds trlx_scale's own metrics (phase times, weight
sync, asynchronous generation) and the trainer's evaluation (mean reward and pass@k of a binary reward on the
dataset's test split) beside TRL's."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from .helpers.launch import launch_env
from .helpers.user_model import USER_REWARD_MODULE, save_user_model, write_prompt_parquet

TRLX_SCALE = os.path.join(os.path.dirname(sys.executable), "trlx-scale")


def logged_scalars(output_dir) -> set[str]:
    """Every scalar tag TensorBoard event files under ``output_dir`` hold."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for path in glob.glob(os.path.join(output_dir, "**", "events.out.tfevents.*"), recursive=True):
        events = EventAccumulator(path)
        events.Reload()
        tags.update(events.Tags()["scalars"])
    return tags


def _user_folder(tmp_path) -> tuple[str, str]:
    """A user's model and a dataset folder with train and test splits (parquet), and their reward module."""
    model = save_user_model(tmp_path / "my-model")
    data = tmp_path / "my-data"
    data.mkdir()
    write_prompt_parquet(data / "train.parquet", 16)
    write_prompt_parquet(data / "test.parquet", 8)
    (tmp_path / "user_rewards.py").write_text(USER_REWARD_MODULE)
    return model, str(data)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["grpo", "async_grpo"])
def test_tensorboard_receives_trlx_scales_metrics_and_the_evaluation(command, tmp_path):
    model, data = _user_folder(tmp_path)
    out = tmp_path / "run"
    flags = ["--model_name_or_path", model, "--dataset_name", data, "--reward_funcs", "user_rewards.digit_reward"]
    flags += ["--output_dir", str(out), "--max_steps", "2", "--per_device_train_batch_size", "4"]
    flags += ["--num_generations", "4", "--max_completion_length", "8", "--logging_steps", "1"]
    flags += ["--report_to", "tensorboard", "--save_strategy", "no"]
    if command == "grpo":  # weight sync to the colocated engine, and the trainer's evaluation every step
        flags += ["--use_vllm", "true", "--vllm_mode", "colocate", "--eval_strategy", "steps", "--eval_steps", "1"]
    env = dict(launch_env(as_a_user=True), VLLM_CPU_KVCACHE_SPACE="1")
    result = subprocess.run(
        [TRLX_SCALE, command, *flags], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"

    tags = logged_scalars(out)
    assert any(tag.startswith("train/time/") for tag in tags), sorted(tags)
    if command == "grpo":
        assert any(tag.startswith("train/sync/") for tag in tags), sorted(tags)
        # The digit reward is binary: the evaluation logs pass@1 and pass@4 over each prompt's four completions.
        assert {"eval/reward", "eval/rewards/digit_reward/mean", "eval/pass@1", "eval/pass@4"} <= tags, sorted(tags)
    else:
        assert any(tag.startswith("train/async/") for tag in tags), sorted(tags)
