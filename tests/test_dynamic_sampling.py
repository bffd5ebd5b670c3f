"""Dynamic sampling (grpo.dynamic_sampling): groups without signal are dropped and replaced, every step fills its
batch with informative groups where it can, and says so where it cannot. Exact resume with carried-over groups is in
tests/test_exact_resume.py (kind grpo_dynamic_sampling); two processes with uneven groups at the end of this file."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from trlx_scale import AsyncGRPOConfig, GRPOTrainer, PPOConfig
from trlx_scale.rollout.refill_prompts import RefillPrompts
from trlx_scale.tasks import addition_dataset

from .helpers.launch import REPO_ROOT, launch_env
from .helpers.trainers import small_grpo_config

ENGINE = dict(use_vllm=True, vllm_mode="colocate")


def _token_hash(ids) -> float:
    return int.from_bytes(hashlib.blake2b(str(list(ids)).encode(), digest_size=2).digest(), "big") / 65535


def odd_answers_only(completion_ids, answer, **kwargs):
    """No signal for prompts with an even answer (a constant), a function of the completion's tokens otherwise."""
    return [0.5 if int(a) % 2 == 0 else _token_hash(ids) for ids, a in zip(completion_ids, answer, strict=True)]


class RecordingTrainer(GRPOTrainer):
    """Keeps each rollout's trained rows and rewards (the trainer's own code runs unchanged)."""

    def _finish_rollout(self, batch):
        self.rollouts.append({"answers": [row["answer"] for row in batch.rows], "rewards": batch.rewards_per_func})
        return super()._finish_rollout(batch)


def _train(tmp_path, reward, **overrides) -> RecordingTrainer:
    from trlx_scale.tasks import default_model_path

    args = small_grpo_config(tmp_path, **ENGINE, dynamic_sampling=True, max_completion_length=6, **overrides)
    trainer = RecordingTrainer(default_model_path(), reward, args, train_dataset=addition_dataset("train", size=64))
    trainer.rollouts = []
    trainer.train()
    return trainer


def _logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_every_step_trains_on_groups_with_signal_only(tmp_path):
    """Half the prompts give groups without signal: each step's batch is full (8 rows, 2 groups) and every trained
    group is an odd-answer one with rewards that differ, while the sampled groups without signal are counted."""
    trainer = _train(tmp_path, odd_answers_only, max_steps=3)
    assert len(trainer.rollouts) == 3
    for rollout in trainer.rollouts:
        assert len(rollout["answers"]) == 8 and all(int(answer) % 2 == 1 for answer in rollout["answers"])
        assert (rollout["rewards"][:, 0].view(-1, 4).std(dim=1) > 0).all()
    logs = _logs(trainer)
    assert [entry["batch/filled_frac"] for entry in logs] == [1.0, 1.0, 1.0]
    assert all(entry["frac_reward_zero_std"] == 0.0 for entry in logs)
    assert all(0 < entry["batch/zero_variance_frac"] < 1 for entry in logs)
    # The first step knows no zero-variance fraction yet: no over-sampling, a second round; later ones over-sample.
    assert logs[0]["batch/oversampling_factor"] == 1.0 and logs[0]["batch/generation_rounds"] == 2.0
    assert all(entry["batch/oversampling_factor"] > 1.0 for entry in logs[1:])


def test_a_step_that_cannot_fill_trains_on_what_it_has_and_says_so(tmp_path):
    """No group has signal: each step stops after dynamic_sampling_max_rounds rounds and trains its batch of dropped
    groups (advantage 0), with batch/filled_frac 0; the over-sampling factor stays at its cap."""
    trainer = _train(tmp_path, lambda completions, **kwargs: [1.0] * len(completions), dynamic_sampling_max_rounds=2)
    logs = _logs(trainer)
    assert [entry["batch/generation_rounds"] for entry in logs] == [2.0, 2.0]
    assert [entry["batch/filled_frac"] for entry in logs] == [0.0, 0.0]
    assert [entry["batch/zero_variance_frac"] for entry in logs] == [1.0, 1.0]
    assert logs[1]["batch/oversampling_factor"] == 2.0  # 1 / (1 - z) capped by dynamic_sampling_max_oversample
    assert all(len(rollout["answers"]) == 8 for rollout in trainer.rollouts)


def test_a_spread_floor_drops_groups_whose_rewards_differ_too_little(tmp_path):
    """dynamic_sampling_min_std above every group's reward std (token hashes in [0, 1]: std well under 0.9): every
    group is dropped, though the odd-answer groups' rewards do differ."""
    trainer = _train(
        tmp_path,
        odd_answers_only,
        dynamic_sampling_min_std=0.9,
        dynamic_sampling_max_rounds=1,
    )
    logs = _logs(trainer)
    assert [entry["batch/zero_variance_frac"] for entry in logs] == [1.0, 1.0]
    assert [entry["batch/filled_frac"] for entry in logs] == [0.0, 0.0]
    # Groups with spread (below the floor) were among them: dropped, then trained as the fill.
    assert any((rollout["rewards"][:, 0].view(-1, 4).std(dim=1) > 0).any() for rollout in trainer.rollouts)


def test_the_batch_of_kept_groups_is_what_trls_loss_trains(tmp_path):
    """The kept groups' advantages are their own group's (TRL's formula on the trained batch's rewards), so the loss
    TRL computes on this batch is the loss of those groups alone: no dropped group moves a kept one's baseline."""
    from trlx_scale.rollout.group_advantages import group_advantages

    advantages = []

    class Capturing(RecordingTrainer):
        def _finish_rollout(self, batch):
            advantages.append(batch.advantages.clone())
            return super()._finish_rollout(batch)

    from trlx_scale.tasks import default_model_path

    args = small_grpo_config(tmp_path, **ENGINE, dynamic_sampling=True, max_completion_length=6, max_steps=2)
    trainer = Capturing(default_model_path(), odd_answers_only, args, train_dataset=addition_dataset("train", size=64))
    trainer.rollouts = []
    trainer.train()
    for got, rollout in zip(advantages, trainer.rollouts, strict=True):
        rewards = rollout["rewards"]
        expected = group_advantages(rewards, torch.ones(1), 4, "group").advantages
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert got.abs().sum() > 0


def test_the_prompt_stream_deals_distinct_prompts_to_the_ranks_and_resumes_by_position():
    dataset = addition_dataset("train", size=10)
    ranks = [RefillPrompts(dataset, seed=3, rank=rank, world_size=2, num_generations=2) for rank in (0, 1)]
    drawn = [[row["prompt"][-1]["content"] for row in stream.draw(5)[::2]] for stream in ranks]
    assert len(set(drawn[0]) | set(drawn[1])) == 10  # one pass over the dataset between the two ranks
    again = RefillPrompts(dataset, seed=3, rank=0, world_size=2, num_generations=2)
    again.position = 2
    assert [row["prompt"][-1]["content"] for row in again.draw(3)[::2]] == drawn[0][2:]


def test_bad_settings_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="dynamic_sampling_max_oversample must be a factor >= 1"):
        small_grpo_config(tmp_path, dynamic_sampling_max_oversample=0.5)
    with pytest.raises(ValueError, match="dynamic_sampling_max_rounds must be an integer >= 1"):
        small_grpo_config(tmp_path, dynamic_sampling_max_rounds=0)
    with pytest.raises(ValueError, match="dynamic_sampling_min_std must be a finite reward std >= 0"):
        small_grpo_config(tmp_path, dynamic_sampling_min_std=-1.0)
    with pytest.raises(ValueError, match="PPO's advantages come from its critic"):
        small_grpo_config(tmp_path, PPOConfig, dynamic_sampling=True)
    with pytest.raises(ValueError, match="dynamic_sampling_max_carry: AsyncGRPOTrainer carries no group over"):
        small_grpo_config(
            tmp_path,
            AsyncGRPOConfig,
            dynamic_sampling=True,
            dynamic_sampling_max_carry=2,
            vllm_server_base_url="http://x:1",
        )
    with pytest.raises(ValueError, match="dynamic_sampling_max_oversample: AsyncGRPOTrainer has no generation rounds"):
        small_grpo_config(
            tmp_path,
            AsyncGRPOConfig,
            dynamic_sampling=True,
            dynamic_sampling_max_oversample=3.0,
            vllm_server_base_url="http://x:1",
        )


class _Lookup:
    """A TRL environment (environment_factory): per-trajectory state dynamic sampling cannot move yet."""

    def reset(self, **kwargs) -> str:
        return ""

    def lookup(self, q: str) -> str:
        """Look a query up.

        Args:
            q: The query.
        """
        return "ok"


@pytest.mark.parametrize("trainer_name", ["GRPOTrainer", "AsyncGRPOTrainer"])
def test_environment_rollouts_are_refused_by_name(tmp_path, default_model_dir, default_tokenizer, trainer_name):
    """Both trainers, at construction (the asynchronous one before any server is reached)."""
    from trlx_scale import AsyncGRPOTrainer
    from trlx_scale.tasks.tool_chat_template import with_tool_template

    if trainer_name == "GRPOTrainer":
        trainer_class, args = GRPOTrainer, small_grpo_config(tmp_path, **ENGINE, dynamic_sampling=True)
    else:
        trainer_class = AsyncGRPOTrainer
        args = small_grpo_config(
            tmp_path, AsyncGRPOConfig, dynamic_sampling=True, vllm_server_base_url="http://127.0.0.1:9"
        )
    with pytest.raises(ValueError, match="environment_factory and rollout_func hold per-trajectory state"):
        trainer_class(
            default_model_dir,
            odd_answers_only,
            args,
            train_dataset=addition_dataset("train", size=8),
            processing_class=with_tool_template(default_tokenizer),
            environment_factory=_Lookup,
        )


@pytest.mark.slow
def test_tool_trajectories_keep_their_own_tool_mask(tmp_path):
    """The embedded tool model with tools=[add] on the calculator task, groups of 2 (about half have equal rewards):
    every trained row's tool mask (0 on the tool's result, which the loss leaves out) is the one TRL's tool loop
    returned for that very completion, through the drops, the second rounds and the carried-over groups; what TRL
    reports of the trained batch (frac_reward_zero_std) is what dynamic sampling could not fill."""
    from trlx_scale.tasks.calculator_task import add, calculator_dataset, exact_answer
    from trlx_scale.tasks.tool_model import load_tool_model_tokenizer, tool_model_path

    class Recording(GRPOTrainer):
        def _sample_rollout(self, prompts, rows):
            samples = super()._sample_rollout(prompts, rows)
            for ids, mask in zip(samples.completion_ids, samples.tool_mask, strict=True):
                self.sampled_masks[tuple(ids)] = list(mask)
            return samples

        def _finish_rollout(self, batch):
            self.trained.append((batch.completion_ids, batch.completion_mask, batch.extras["tool_mask"]))
            return super()._finish_rollout(batch)

    args = small_grpo_config(
        tmp_path,
        **ENGINE,
        dynamic_sampling=True,
        num_generations=2,
        max_completion_length=100,
        max_tool_calling_iterations=1,
        vllm_max_model_length=256,
        max_steps=3,
        learning_rate=2e-4,
    )
    trainer = Recording(
        tool_model_path(),
        exact_answer,
        args,
        train_dataset=calculator_dataset("train", size=64),
        processing_class=load_tool_model_tokenizer(),
        tools=[add],
    )
    trainer.sampled_masks, trainer.trained = {}, []
    trainer.train()
    called = 0
    for completion_ids, completion_mask, tool_mask in trainer.trained:
        for row in range(completion_ids.size(0)):
            ids = completion_ids[row][completion_mask[row].bool()].tolist()
            expected = trainer.sampled_masks[tuple(ids)]
            assert tool_mask[row, : len(expected)].tolist() == expected
            called += 0 in expected
    assert called > 0  # some trained trajectories called the tool: their masks have the result left out
    logs = _logs(trainer)
    assert max(entry["batch/zero_variance_frac"] for entry in logs) > 0
    assert [entry["frac_reward_zero_std"] for entry in logs] == pytest.approx(
        [1.0 - entry["batch/filled_frac"] for entry in logs]
    )


@pytest.mark.slow
def test_two_ranks_train_equal_batches_when_one_ranks_groups_all_lack_signal(tmp_path):
    """2 gloo processes: every group rank 1 scores is zero-variance. Both ranks train the same number of rows each
    step, and rank 1's rows are rank 0's informative groups dealt to it."""
    script = os.path.join(REPO_ROOT, "tests", "distributed", "dynamic_sampling_uneven.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29687"]
    env = dict(launch_env(), VLLM_CPU_KVCACHE_SPACE="1")
    result = subprocess.run(
        [*command, script, str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [report["steps"] for report in reports] == [2, 2]
    for rank0, rank1 in zip(reports[0]["rollouts"], reports[1]["rollouts"], strict=True):
        assert rank0["rows"] == rank1["rows"] == 8
        assert all(std > 0 for std in rank0["all_group_std"])  # every trained group, on either rank, has signal
        assert all(std > 0 for std in rank1["group_std"])
    for entry in reports[0]["logs"]:
        assert entry["batch/filled_frac"] == 1.0 and entry["batch/zero_variance_frac"] >= 0.5


@pytest.mark.slow
def test_the_example_trains_with_it_under_deepspeed_zero3(tmp_path):
    """2 processes under ZeRO-3 (every forward a collective over the ranks' shards): each step's kept groups are dealt
    evenly, so both ranks run the same passes, and the logged batch is the filled one."""
    from .helpers.launch import ACCELERATE_LAUNCH, read_run_summary, run_command

    out = tmp_path / "zero3"
    config = os.path.join(REPO_ROOT, "configs", "accelerate", "cpu_zero3.yaml")
    example = os.path.join(REPO_ROOT, "examples", "grpo.py")
    run_command(
        [*ACCELERATE_LAUNCH, "--config_file", config, example]
        + ["--max_steps", "2", "--eval_size", "40", "--output_dir", str(out), "--logging_steps", "1"]
        + ["--dynamic_sampling", "true"],
        timeout=800,
    )
    summary = read_run_summary(out)
    assert summary["world_size"] == 2 and summary["steps"] == 2
    logs = [entry for entry in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert entry["batch/filled_frac"] == 1.0 and entry["frac_reward_zero_std"] == 0.0
        assert entry["batch/zero_variance_frac"] > 0  # the embedded task's exact match leaves groups without signal
