"""The colocated engine inside GRPOTrainer: LoRA-only sync, sleep/wake lifecycle on CPU, group generation,
metrics, and a staleness check that fails when a sync is skipped."""

import logging

import pytest
from peft import LoraConfig

from trlx_scale import GRPOTrainer
from trlx_scale.tasks import addition_dataset, exact_match_reward

from ..helpers.trainers import logged, small_grpo_config

LORA = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")


def _trainer(default_model_dir, tmp_path, peft_config=None, **overrides):
    values = dict(max_steps=3, learning_rate=5e-3, seed=11, use_vllm=True, vllm_dtype="trainer")
    values.update(overrides)
    return GRPOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=small_grpo_config(tmp_path / "out", **values),
        train_dataset=addition_dataset("train", size=64),
        peft_config=peft_config,
    )


_logged = logged


def test_lora_only_sync_sends_the_adapter_and_stays_in_sync(default_model_dir, tmp_path):
    trainer = _trainer(default_model_dir, tmp_path, peft_config=LORA, vllm_sync_mode="lora")
    engine = trainer.vllm_generation
    assert engine.sync_mode == "lora" and engine.sleep_level == 1
    assert engine.llm.llm_engine.vllm_config.lora_config is not None
    trainer.train()
    adapter_bytes = 4 * sum(p.numel() for n, p in trainer.model.named_parameters() if "lora_" in n)
    model_bytes = 4 * sum(p.numel() for n, p in trainer.model.named_parameters() if "lora_" not in n)
    assert _logged(trainer, "sync/bytes") == [adapter_bytes] * 3
    assert adapter_bytes < model_bytes / 4
    assert max(_logged(trainer, "sync/logprob_gap_max")) < 1e-3
    for key in ("sync/seconds", "generation/tokens_per_second", "lifecycle/sleep_seconds"):
        assert len(_logged(trainer, key)) == 3, key
    # 8 rows = 2 prompts x 4 samples: two requests with n=4.
    assert _logged(trainer, "generation/unique_prompts") == [2.0] * 3


def test_full_sync_of_a_merged_lora_policy_also_stays_in_sync(default_model_dir, tmp_path):
    """What "auto" does on a CPU engine (CPU_MERGED_SYNC_REASON)."""
    trainer = _trainer(default_model_dir, tmp_path, peft_config=LORA, vllm_sync_mode="auto")
    assert trainer.vllm_generation.sync_mode == "full" and trainer.vllm_generation.sleep_level == 2
    trainer.train()
    assert max(_logged(trainer, "sync/logprob_gap_max")) < 1e-3
    assert _logged(trainer, "sync/lora_only") == [0.0] * 3


@pytest.mark.parametrize(("use_peft", "level"), [(True, "2"), (False, "auto")], ids=["lora-level2", "full-auto"])
def test_sleep_mode_on_cpu_runs_the_lifecycle_and_warns_once(default_model_dir, tmp_path, caplog, use_peft, level):
    with caplog.at_level(logging.WARNING, logger="trlx_scale.generation.colocated_generation"):
        trainer = _trainer(
            default_model_dir,
            tmp_path,
            peft_config=LORA if use_peft else None,
            vllm_sync_mode="lora" if use_peft else "auto",
            vllm_enable_sleep_mode=True,
            vllm_sleep_level=level,
        )
    assert sum("no sleep mode on this platform" in r.message for r in caplog.records) == 1
    lifecycle = trainer.vllm_generation.lifecycle
    assert lifecycle.sleep_level == 2 and not lifecycle.enabled
    trainer.train()
    round_ = ["wake_weights", "wake_kv_cache", "reset_prefix_cache", "sleep"]
    assert lifecycle.transitions == ["sleep"] + round_ * 3
    # Level 2 discards the weights at every sleep, so every round re-sends them, and the engine stays in sync.
    assert max(_logged(trainer, "sync/logprob_gap_max")) < 1e-3


def test_a_skipped_sync_shows_as_a_large_gap(default_model_dir, tmp_path):
    """The staleness check can fail: an engine that is never updated drifts away from the policy."""
    trainer = _trainer(default_model_dir, tmp_path, max_steps=4, learning_rate=2e-2)
    engine = trainer.vllm_generation
    # Test only: the version check says "current" whatever the version, so the engine wakes as usual, pushes nothing.
    engine.ensure_version = lambda version: engine.lifecycle.wake_weights() or False
    trainer.train()
    gaps = _logged(trainer, "sync/logprob_gap_max")
    assert gaps[0] < 1e-3  # step 0: the engine still holds the initial weights, which are the policy's
    assert max(gaps[1:]) > 0.05, gaps


def test_a_failed_generation_leaves_the_engine_ready_for_a_retry(default_model_dir, tmp_path):
    """vLLM raising mid-rollout must not leave the lifecycle in GENERATING (a retry would then be refused)."""
    from trlx_scale.generation.lifecycle import EngineState

    trainer = _trainer(default_model_dir, tmp_path, peft_config=LORA, max_steps=1, vllm_enable_sleep_mode=True)
    engine = trainer.vllm_generation
    inner = engine.llm.inner

    class FailingOnce:
        def __init__(self, llm):
            self.llm, self.failed = llm, False

        def __getattr__(self, name):
            return getattr(self.llm, name)

        def generate(self, *args, **kwargs):
            if not self.failed:
                self.failed = True
                raise RuntimeError("engine hiccup")
            return self.llm.generate(*args, **kwargs)

    engine.llm.inner = FailingOnce(inner)
    with pytest.raises(RuntimeError, match="engine hiccup"):
        trainer.train()
    assert engine.lifecycle.state is not EngineState.GENERATING
    trainer.train()  # the retry runs a whole step
    assert trainer.state.global_step == 1
    engine.llm.inner = inner
