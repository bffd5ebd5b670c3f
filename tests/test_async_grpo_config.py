"""AsyncGRPOConfig and AsyncGRPOTrainer refuse what asynchronous generation cannot do, naming the field and the fix
(no server is started: every check runs before one would be)."""

from __future__ import annotations

import pytest
import torch

from trlx_scale import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig
from trlx_scale.tasks import addition_dataset, exact_match_reward

from .helpers.trainers import small_grpo_config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_staleness": -1}, "max_staleness must be >= 0"),
        ({"max_staleness": 1, "weight_sync_steps": 3}, r"weight_sync_steps \(3\) must be between 1 and max_staleness"),
        ({"gradient_accumulation_steps": 2, "steps_per_generation": 3}, "must be a multiple of gradient_accumulation"),
        (
            {"num_iterations": 2, "eval_strategy": "steps", "eval_steps": 3},
            "eval_steps=3 with 2 optimizer steps per rollout.*multiple of 2",
        ),
        (
            {"eval_strategy": "steps", "eval_steps": 5, "max_staleness": 2, "weight_sync_steps": 2},
            "eval_strategy='steps' with weight_sync_steps=2: .*Set weight_sync_steps=1",
        ),
        ({"request_timeout": 0}, "must be positive"),
        ({"vllm_server_weight_transfer": "ipc"}, "vllm_server_weight_transfer='ipc': choose 'files'"),
        ({"sequence_behaviour_weight": "median"}, "sequence_behaviour_weight='median': choose 'product'"),
        ({"async_reward_workers": 0}, "async_reward_workers must be at least 1"),
        ({"async_reward_processes": -1}, "async_reward_processes must be 0 \\(threads\\) or a number"),
        ({"full_weight_reload": "abort"}, "full_weight_reload='abort': choose 'drain'"),
        ({"weight_delivery": "later"}, "weight_delivery='later': choose 'auto', 'background'"),
        (
            {"full_weight_reload": "keep", "vllm_server_weight_transfer": "nccl"},
            "full_weight_reload='keep' .*use full_weight_reload='drain' with it",
        ),
        # A truncating or penalising sampler would bias the correction (its log-probs are not the trainer's).
        ({"top_p": 0.9}, "top_p=0.9: .*weights of an unchanged policy would not be 1"),
        ({"top_k": 5}, "top_k=5: .*Leave top_k at its default"),
        ({"min_p": 0.1}, "min_p=0.1: "),
        ({"repetition_penalty": 1.2}, "repetition_penalty=1.2: "),
        # What the server would never receive.
        ({"generation_kwargs": {"stop": ["\n"]}}, "generation_kwargs is set, but AsyncGRPOTrainer does not send"),
        ({"vllm_structured_outputs_regex": "[0-9]+"}, "vllm_structured_outputs_regex is set"),
        (
            {"vllm_max_model_length": 128, "vllm_server_base_url": "http://127.0.0.1:1"},
            "give them --max-model-len and unset the field",
        ),
    ],
)
def test_bad_settings_are_named(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        small_grpo_config(tmp_path, AsyncGRPOConfig, **overrides)


def test_the_config_implies_a_server_and_reads_several_urls(tmp_path):
    args = small_grpo_config(tmp_path, AsyncGRPOConfig, vllm_server_base_url="http://a:8000, http://b:8001")
    assert args.use_vllm and args.vllm_mode == "server"
    assert args.server_urls == ["http://a:8000", "http://b:8001"]
    assert small_grpo_config(tmp_path, AsyncGRPOConfig).server_urls == []


def test_the_correction_truncates_per_token_by_default_and_per_sequence_under_gspo(tmp_path):
    """AReaL's truncated token weight, not TRL's sequence mask (chosen by the learning benchmark, docs/benchmarks.md);
    GSPO's sequence-level objective gets the weight at its level; a mode the user sets is kept; GRPOConfig keeps TRL's."""
    assert small_grpo_config(tmp_path, AsyncGRPOConfig).vllm_importance_sampling_mode == "token_truncate"
    gspo = small_grpo_config(tmp_path, AsyncGRPOConfig, loss_recipe="gspo")
    assert (gspo.importance_sampling_level, gspo.vllm_importance_sampling_mode) == ("sequence", "sequence_truncate")
    chosen = small_grpo_config(tmp_path, AsyncGRPOConfig, vllm_importance_sampling_mode="sequence_mask")
    assert chosen.vllm_importance_sampling_mode == "sequence_mask"
    assert small_grpo_config(tmp_path, GRPOConfig).vllm_importance_sampling_mode == "sequence_mask"


def test_the_trainer_refuses_what_the_producer_cannot_run(tmp_path, default_model_dir):
    dataset = addition_dataset("train", size=16)
    with pytest.raises(TypeError, match="needs an AsyncGRPOConfig"):
        AsyncGRPOTrainer(default_model_dir, exact_match_reward, small_grpo_config(tmp_path, GRPOConfig), dataset)
    args = small_grpo_config(tmp_path, AsyncGRPOConfig)
    with pytest.raises(TypeError, match="load a reward model inside a function"):
        AsyncGRPOTrainer(default_model_dir, torch.nn.Linear(2, 1), args, dataset)
    with pytest.raises(ValueError, match="takes rollout_func=GymRollout"):
        AsyncGRPOTrainer(default_model_dir, exact_match_reward, args, dataset, rollout_func=lambda prompts, t: {})


def test_prompt_stream_deals_whole_groups_as_accelerate_deals_batches():
    """A sampler of 3 prompts x G=2 per rank batch, repeated twice (steps_per_generation 2), over 2 ranks: rank r
    gets the r-th batch of each world's worth, every repeat skipped. Rows that split a group are refused."""
    from trlx_scale.rollout.prompt_stream import RankPromptStream

    def sampler():  # two generation batches of 2 ranks x 6 rows, each yielded twice (TRL's repeat_count)
        for batch in ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]):
            for _ in range(2):
                yield from (index for index in batch for _ in range(2))

    dataset = [{"prompt": f"p{i}"} for i in range(12)]
    rank1 = RankPromptStream(
        sampler, dataset, rank=1, world_size=2, rows_per_rollout=6, num_generations=2, repeat_count=2
    )
    assert rank1.rollout_indices(0) == [3, 3, 4, 4, 5, 5]
    assert rank1.rollout_indices(1) == [9, 9, 10, 10, 11, 11]
    assert [rank1.group(k)["prompt"] for k in range(6)] == ["p3", "p4", "p5", "p9", "p10", "p11"]
    assert rank1.rollout_indices(2) == [3, 3, 4, 4, 5, 5]  # the next epoch re-iterates the sampler
    with pytest.raises(RuntimeError, match="differ from the ones the asynchronous producer sampled ahead"):
        rank1.check_rollout(0, [{"prompt": "p0"}] * 6)
    with pytest.raises(ValueError, match="must be a multiple of num_generations"):
        RankPromptStream(sampler, dataset, rank=0, world_size=2, rows_per_rollout=5, num_generations=2, repeat_count=1)


def test_gspo_sequence_weights_are_geometric_means_by_default(tmp_path):
    """An unchanged policy's product of token weights leaves the clip bounds on long sequences (measured,
    benchmarks/gspo_sequence_weight.py); the default is the geometric mean, TRL's product on request."""
    gspo = small_grpo_config(tmp_path, AsyncGRPOConfig, loss_recipe="gspo")
    assert gspo.sequence_behaviour_weight == "geometric_mean"
    product = small_grpo_config(tmp_path, AsyncGRPOConfig, loss_recipe="gspo", sequence_behaviour_weight="product")
    assert product.sequence_behaviour_weight == "product"


def test_background_weight_delivery_runs_where_a_thread_can_carry_it():
    """weight_delivery: 'auto' is background with one training process and full weights through files, inline
    otherwise; 'background' runs with several processes too (their threads agree through a store), and where it
    cannot run (adapters and NCCL travel another way) it is refused by name."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from trlx_scale.generation.server_generation import delivers_in_background
    from trlx_scale.generation.server_weight_transports import FullWeightFilesTransport

    files = FullWeightFilesTransport(accelerator=Accelerator(cpu=True), client=None)
    adapters = SimpleNamespace(name="adapter_files")
    assert delivers_in_background("auto", files, num_processes=1)
    assert delivers_in_background("background", files, num_processes=1)
    assert not delivers_in_background("inline", files, num_processes=1)
    assert not delivers_in_background("auto", files, num_processes=2)
    assert delivers_in_background("background", files, num_processes=2)
    assert not delivers_in_background("auto", adapters, num_processes=1)
    with pytest.raises(ValueError, match="weight_delivery='background'.*'adapter_files' transport"):
        delivers_in_background("background", adapters, num_processes=1)
    files.close()
