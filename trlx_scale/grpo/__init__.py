"""GRPO: ``GRPOTrainer`` (``trainer.py``: its overrides of TRL's methods), ``GRPOConfig`` (``config.py``) and the
parts only GRPO has: the log-prob passes a batch runs and the loss pass's correction."""
