"""Small trainer configs for seconds-long runs on the embedded model, and reading a trainer's logs."""

from __future__ import annotations


def small_grpo_config(output_dir, config_cls=None, **overrides):
    """A GRPO config for seconds-long runs on the default model: 2 prompts x 4 samples per step, fp32 on CPU."""
    from trlx_scale import GRPOConfig

    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=5,
        max_steps=2,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        seed=7,
        disable_tqdm=True,
    )
    values.update(overrides)
    return (config_cls or GRPOConfig)(**values)


def small_dpo_config(output_dir, config_cls=None, **overrides):
    """A DPO config for seconds-long runs on the default model: 8 pairs per step, fp32 on CPU."""
    from trlx_scale import DPOConfig

    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        max_steps=2,
        learning_rate=1e-4,
        max_length=64,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        seed=3,
        disable_tqdm=True,
    )
    values.update(overrides)
    return (config_cls or DPOConfig)(**values)


def logged(trainer, key):
    """Every value of one metric in a trainer's log history, in order."""
    return [entry[key] for entry in trainer.state.log_history if key in entry]
