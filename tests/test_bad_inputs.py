"""Bad inputs are caught before the first step (or at the first batch that reveals them) with an error that names the
field and the fix. docs/reliability.md lists each input, its message and the test below (by id)."""

from __future__ import annotations

import gc
import logging
import os

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from trlx_scale import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
from trlx_scale.generation.engine_options import check_tensor_parallel_layout
from trlx_scale.generation.weight_sync import LoRAAdapterSync, choose_sync_mode, ram_backed_directory
from trlx_scale.reliability.input_checks import (
    DPO_COLUMNS,
    GRPO_COLUMNS,
    check_dataset_columns,
    check_prompts_fit_context,
)
from trlx_scale.tasks import addition_dataset, addition_preference_dataset, exact_match_reward

from .helpers.trainers import small_dpo_config, small_grpo_config

# (config class, the bad field(s), the start of the error message)
CONFIG_CASES = {
    "engine_dtype": (GRPOConfig, {"vllm_dtype": "fp8"}, "vllm_dtype must be one of"),
    "kvcache_space": (GRPOConfig, {"vllm_cpu_kvcache_space": 0}, "vllm_cpu_kvcache_space must be a positive number"),
    "sync_mode": (GRPOConfig, {"vllm_sync_mode": "adapter"}, "vllm_sync_mode must be one of"),
    "sleep_level": (GRPOConfig, {"vllm_sleep_level": "3"}, r"vllm_sleep_level must be one of \('auto', '1', '2'\)"),
    "sync_bucket": (GRPOConfig, {"vllm_sync_bucket_mb": 0}, "vllm_sync_bucket_mb must be a positive number"),
    "is_level": (GRPOConfig, {"importance_sampling_level": "group"}, "importance_sampling_level must be one of"),
    "shared_prefix": (
        GRPOConfig,
        {"shared_prefix": "yes"},
        r"shared_prefix must be one of \('auto', 'true', 'false'\), got 'yes'",
    ),
    "loss_recipe": (GRPOConfig, {"loss_recipe": "dapo"}, r"loss_recipe must be one of \['gspo'\]"),
    "optim_preset": (GRPOConfig, {"optim_preset": "adam"}, "optim_preset must be one of"),
    "peak_tflops": (GRPOConfig, {"peak_tflops": 0}, "peak_tflops must be a positive number"),
    "skip_limit": (GRPOConfig, {"max_consecutive_skipped_steps": -1}, "max_consecutive_skipped_steps must be an"),
    "reward_errors": (GRPOConfig, {"reward_errors": "ignore"}, "reward_errors must be one of"),
    "reward_scoring": (GRPOConfig, {"reward_scoring": "parallel"}, "reward_scoring must be one of"),
    "hub_retries": (GRPOConfig, {"hub_push_retries": -1}, "hub_push_retries must be an integer >= 0"),
    "ppo_beta": (PPOConfig, {"beta": 0.1}, "Set beta=0 and use kl_coef"),
    "kl_estimator": (PPOConfig, {"kl_estimator": "k2"}, "kl_estimator must be 'k1' or 'k3'"),
    "critic_mode": (PPOConfig, {"critic_mode": "tied"}, "critic_mode must be 'separate' or 'shared_base'"),
    "gae_lambda": (PPOConfig, {"lam": 1.5}, r"gamma and lam must lie in \[0, 1\]"),
    "kl_target": (PPOConfig, {"kl_target": 0}, "kl_target and kl_horizon must be positive"),
    "kl_coef": (PPOConfig, {"kl_coef": -0.1}, "kl_coef must be >= 0"),
    "vf_coef": (PPOConfig, {"vf_coef": 0}, r"vf_coef must be a positive number \(the value loss' weight"),
    "cliprange_value": (PPOConfig, {"cliprange_value": 0}, "cliprange_value must be a positive number"),
    "critic_lr": (PPOConfig, {"critic_learning_rate": 0}, "critic_learning_rate must be a positive number"),
    "target_kl": (PPOConfig, {"target_kl": -1.0}, r"target_kl must be a positive number \(unset it"),
    "online_group": (DPOConfig, {"online": True, "online_num_generations": 1}, "online_num_generations must be at"),
    "online_ref": (DPOConfig, {"online": True, "vllm_ref_log_probs": True}, "set vllm_ref_log_probs=False"),
    "online_temperature": (DPOConfig, {"online": True, "online_temperature": 0.0}, "online_temperature must be"),
    "online_length": (DPOConfig, {"online": True, "online_max_completion_length": 0}, "online_max_completion_length"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_refuses_bad_value(case, tmp_path):
    config_cls, overrides, message = CONFIG_CASES[case]
    build = small_dpo_config if config_cls is DPOConfig else small_grpo_config
    with pytest.raises(ValueError, match=message):
        build(tmp_path, config_cls, **overrides)


def test_empty_train_dataset(default_model_dir, tmp_path):
    empty = addition_dataset("train", size=8).select([])
    with pytest.raises(ValueError, match=r"train_dataset is empty \(0 rows\)\. Check the dataset split"):
        GRPOTrainer(default_model_dir, exact_match_reward, small_grpo_config(tmp_path), train_dataset=empty)
    with pytest.raises(ValueError, match=r"train_dataset is empty \(0 rows\)"):
        DPOTrainer(default_model_dir, args=small_dpo_config(tmp_path), train_dataset=empty)


def test_dataset_without_the_columns_a_trainer_reads(default_model_dir, tmp_path):
    """Without the check this was a bare ``KeyError: 'prompt'`` at the first batch (GRPO) or deep inside TRL's
    preprocessing (DPO). The message lists the columns found and the ones needed, with a rename hint."""
    questions = addition_dataset("train", size=8).rename_column("prompt", "question")
    with pytest.raises(
        ValueError,
        match=r"train_dataset has the columns \['question', 'answer'\], but GRPOTrainer reads \('prompt'\)\. .*"
        r"dataset\.rename_column\('question', 'prompt'\)",
    ):
        GRPOTrainer(default_model_dir, exact_match_reward, small_grpo_config(tmp_path), train_dataset=questions)
    with pytest.raises(ValueError, match=r"eval_dataset\['held'\] has the columns \['question', 'answer'\]"):
        GRPOTrainer(
            default_model_dir,
            exact_match_reward,
            small_grpo_config(tmp_path),
            train_dataset=addition_dataset("train", size=8),
            eval_dataset={"held": questions},
        )
    with pytest.raises(ValueError, match=r"but PPOTrainer reads \('prompt'\)"):
        PPOTrainer(default_model_dir, exact_match_reward, small_grpo_config(tmp_path, PPOConfig), questions)
    pairs = addition_preference_dataset(size=8)
    with pytest.raises(
        ValueError,
        match=r"has the columns \['prompt', 'chosen'\], but DPOTrainer reads \('prompt', 'chosen', 'rejected'\) or "
        r"\('chosen', 'rejected'\) or \('prompt_ids', 'chosen_ids', 'rejected_ids'\)",
    ):
        DPOTrainer(default_model_dir, args=small_dpo_config(tmp_path), train_dataset=pairs.remove_columns("rejected"))
    with pytest.raises(ValueError, match=r"but DPOTrainer \(online\) reads \('prompt'\)"):
        DPOTrainer(
            default_model_dir,
            args=small_dpo_config(tmp_path, online=True),
            train_dataset=pairs.remove_columns("prompt"),
            reward_funcs=exact_match_reward,
        )
    # Accepted: plain-text prompts, and an implicit-prompt preference dataset (TRL extracts the prompt).
    check_dataset_columns(addition_dataset("train", size=4, conversational=False), GRPO_COLUMNS, "GRPOTrainer")
    check_dataset_columns(pairs.remove_columns("prompt"), DPO_COLUMNS, "DPOTrainer")


def test_fp32_masters_with_an_optimizer_of_ones_own(default_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(default_model_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"fp32_master_weights builds its own optimizer .* drop one of the two"):
        GRPOTrainer(
            model,
            exact_match_reward,
            small_grpo_config(tmp_path, fp32_master_weights=True),
            train_dataset=addition_dataset("train", size=8),
            optimizers=(optimizer, None),
        )


def test_split_larger_than_available():
    with pytest.raises(ValueError, match=r"size=2001 asks for more problems than the 'held_out' split has \(2000\)"):
        addition_dataset("held_out", size=2001)


def test_tensor_parallel_group_across_nodes():
    check_tensor_parallel_layout(2, 8, 4)  # two groups per node: fine
    with pytest.raises(ValueError, match=r"vllm_tensor_parallel_size=8 would put a tensor-parallel group across"):
        check_tensor_parallel_layout(8, 16, 4)
    with pytest.raises(ValueError, match=r"vllm_tensor_parallel_size \(3\) must divide the number of processes"):
        check_tensor_parallel_layout(3, 8, 8)


def test_prompt_longer_than_the_engine_context_unit():
    check_prompts_fit_context([[1] * 10, [1] * 12], max_completion_length=4, context=16)
    with pytest.raises(
        ValueError,
        match=r"A prompt of 13 tokens \(row 1 of this batch\) plus max_completion_length=4 "
        r"exceeds the engine's context of 16 tokens \(vllm_max_model_length\)\. Raise "
        r"vllm_max_model_length to at least 17",
    ):
        check_prompts_fit_context([[1] * 10, [1] * 13], max_completion_length=4, context=16)


@pytest.mark.slow
def test_prompt_longer_than_the_engine_context_in_a_run(default_model_dir, tmp_path):
    """The real engine (vllm_max_model_length=32): the batch holding a long prompt fails before generation."""
    rows = addition_dataset("train", size=7).to_list()
    rows.append({"prompt": [{"role": "user", "content": "1 + " * 40 + "1 ="}], "answer": "41"})
    args = small_grpo_config(
        tmp_path, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=32, vllm_cpu_kvcache_space=0.5
    )
    trainer = GRPOTrainer(default_model_dir, exact_match_reward, args, train_dataset=Dataset.from_list(rows))
    with pytest.raises(ValueError, match=r"exceeds the engine's context of 32 tokens \(vllm_max_model_length\)"):
        trainer.train()
    assert trainer.state.global_step == 0
    del trainer
    gc.collect()


def _lora_model(default_model_dir, **lora):
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], **lora))


def test_base_rewriting_lora_init_falls_back_to_full_sync(default_model_dir):
    model = _lora_model(default_model_dir, init_lora_weights="pissa")
    mode, reason = choose_sync_mode(model, "auto", cpu_engine=False)
    assert mode == "full" and "init_lora_weights='pissa' rewrote the base weights" in reason
    with pytest.raises(ValueError, match=r"vllm_sync_mode='lora' is impossible: init_lora_weights='pissa'"):
        choose_sync_mode(model, "lora")


def test_in_memory_base_edit_falls_back_to_full_sync(default_model_dir):
    model = _lora_model(default_model_dir)
    assert choose_sync_mode(model, "auto", cpu_engine=False) == ("lora", None)  # the control: an untouched base
    with torch.no_grad():
        model.get_base_model().model.layers[1].mlp.up_proj.weight.mul_(1.01)
    mode, reason = choose_sync_mode(model, "auto", cpu_engine=False)
    assert mode == "full"
    assert (
        reason == "the base weight model.layers.1.mlp.up_proj.weight differs from the checkpoint's (model.safetensors)"
    )


def test_lora_target_vllm_cannot_serve(default_model_dir):
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match=r"vllm_sync_mode='lora' is impossible: LoRA on the LM head \(.*lm_head\)"):
        choose_sync_mode(model, "lora")


def test_small_dev_shm_falls_back_to_disk_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="trlx_scale.generation.weight_sync"):
        directory = ram_backed_directory("trlx_scale_test_", needed_bytes=2**50)  # 1 PiB: never fits
    try:
        assert not directory.startswith("/dev/shm")
        assert "adapters are exchanged through" in caplog.text and "--shm-size" in caplog.text
    finally:
        os.rmdir(directory)


def test_adapter_directory_is_removed_with_its_sync(default_model_dir):
    sync = LoRAAdapterSync(_lora_model(default_model_dir), gather_params=_no_gather, dtype=torch.float32)
    sync.write_adapter()
    directory = sync.directory
    assert os.path.isfile(os.path.join(directory, "adapter_model.safetensors"))
    del sync
    gc.collect()
    assert not os.path.exists(directory)


class _no_gather:
    def __init__(self, params):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.distributed
def test_a_two_process_cpu_launch_without_use_cpu_is_refused(tmp_path):
    """Without use_cpu on a machine without a GPU, Accelerate forms no process group: each of the 2 launched
    processes would train alone on the same output_dir. Both refuse, naming the fix."""
    import subprocess

    from .helpers.launch import ACCELERATE_LAUNCH, LAUNCH_VARIABLES, REPO_ROOT

    config = os.path.join(REPO_ROOT, "configs", "accelerate", "cpu_ddp.yaml")
    script = os.path.join(REPO_ROOT, "tests", "scripts", "launch_without_use_cpu.py")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    command = [*ACCELERATE_LAUNCH, "--config_file", config, "--main_process_port", "29538", script, str(tmp_path)]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    # The two ranks share stdout: their lines can interleave on one line (seen in CI), so count the messages.
    refusals = ["REFUSED" + text for text in result.stdout.split("REFUSED")[1:]]
    assert len(refusals) == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert all("WORLD_SIZE=2" in text and "set use_cpu=True and ddp_backend='gloo'" in text for text in refusals)
