"""Asynchronous GRPO on vLLM servers: ``AsyncGRPOTrainer`` (``trainer.py``), ``AsyncGRPOConfig`` (``config.py``) and
its parts: the servers it starts, the engine built at the first rollout, what the producer calls back for, tool
trajectories and gym episodes on the servers, the rollout window a checkpoint carries, the behaviour metrics."""
