"""How ``AsyncGRPOTrainer`` sets up its servers: which weights they get (adapter or full, in which dtype), the
server it starts when no URL is given (``generation.vllm_server``), and the probe that verifies each update.

A component of the trainer (``server_start``): each answer reads the trainer's model, config and accelerator;
building the engine from them is ``server_engine.py``'s (``AsyncEngineBuilder``).
"""

from __future__ import annotations

from accelerate.utils import broadcast_object_list

from ..generation.cpu_environment import running_on_cpu_only
from ..generation.vllm_server import ServerLaunch, VLLMServerProcess
from ..generation.weight_sync import choose_sync_mode, vllm_max_lora_rank
from ..peft_models import is_peft_model
from ..trainer_part import TrainerPart

PROBE_TOKENS = 8  # completion tokens appended to the probe prompt (any tokens: their log-probs are compared)


class AsyncServerStart(TrainerPart):
    """Part of ``AsyncGRPOTrainer``: the servers' weights format, the server it starts, and the update probe."""

    def sync_mode(self) -> str:
        if not is_peft_model(self.trainer.model):
            return "full"
        mode, _ = choose_sync_mode(
            self.trainer.model, self.trainer.args.vllm_sync_mode, cpu_engine=running_on_cpu_only()
        )
        return mode

    def dtype(self) -> str:
        if self.trainer.args.bf16:
            return "bfloat16"
        if self.trainer.args.fp16:
            return "float16"
        return str(self.trainer.accelerator.unwrap_model(self.trainer.model).dtype).removeprefix("torch.")

    def base_model_path(self) -> str:
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        base = model.get_base_model() if is_peft_model(model) else model
        return base.name_or_path

    def start(self, sync_mode: str) -> tuple[list[str], VLLMServerProcess | None]:
        urls = self.trainer.args.server_urls
        process = None
        if not urls:
            if self.trainer.accelerator.is_main_process:
                rank = None
                if sync_mode == "lora":
                    config = self.trainer.accelerator.unwrap_model(self.trainer.model).active_peft_config
                    rank = vllm_max_lora_rank(max([config.r, *(config.rank_pattern or {}).values()]))
                launch = ServerLaunch(
                    model=self.base_model_path(),
                    dtype=self.dtype(),
                    enable_lora=sync_mode == "lora",
                    max_loras=self.trainer.args.max_staleness + 2,
                    max_lora_rank=rank or 16,
                    seed=self.trainer.args.seed,
                    max_model_len=self.trainer.args.vllm_max_model_length,
                    devices=self.trainer.args.vllm_server_devices,
                    weight_transfer="nccl" if self.trainer.args.vllm_server_weight_transfer == "nccl" else None,
                )
                process = VLLMServerProcess(launch, startup_timeout=self.trainer.args.vllm_server_timeout).start()
                urls = [launch.url]
            urls = broadcast_object_list([urls])[0] if self.trainer.accelerator.num_processes > 1 else urls
        return urls, process

    def verify_tolerance(self) -> float:
        if self.trainer.args.weight_sync_verify_tolerance is not None:
            return self.trainer.args.weight_sync_verify_tolerance
        return 1e-3 if self.dtype() == "float32" else 0.1

    def probe_ids(self) -> list[int]:
        """A probe sequence: the first training prompt and a few tokens (the same on every rank)."""
        ids = self.trainer.producer_feed.group_prompt_ids(self.trainer.train_dataset[0])
        vocab = self.trainer.accelerator.unwrap_model(self.trainer.model).config.vocab_size
        return ids + [(ids[i % len(ids)] + i) % vocab for i in range(PROBE_TOKENS)]
