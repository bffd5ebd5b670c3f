"""AsyncGRPOTrainer under 2 processes (`accelerate launch`, DeepSpeed ZeRO-3 on gloo: weight gathers and the probe
forward are collectives) meeting one fault after another, each injected after step 2 on one rank or at the server:
every rank must stop with the same error within seconds, never in a collective's timeout. Between the faults, one
run with adapter-only sync reports the bytes each weight sync gathered. Each rank writes what it saw to
REPORT.rank<r>.json.

python tests/scripts/async_rank_faults.py PROXY_URL REPORT

Faults (the proxy is tests/helpers/fault_proxy.py, in front of a real vLLM server):
  reward_rank1       a reward function raises on rank 1 only
  producer_rank1     rank 1's producer crashes in its own scheduling (the prompt of its next group)
  server_500         the server answers HTTP 500 to the weight update (only the main process sends it)
  lost_update        the weight update is acknowledged but never applied (the main process's verification fails)
  lora_sync          no fault: a LoRA policy whose adapter alone goes to the server (sync/gathered_bytes)
  background         no fault: full-weight updates delivered in the background (weight_delivery="background"),
                     every rank's thread agreeing through the store (generation/delivery_rendezvous.py)
  server_500_background, lost_update_background
                     the two weight faults again, met by the main process's delivery thread while the trainers train
  server_dead        the server is gone mid-run (nothing listens any more)
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import httpx
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.trainers import small_grpo_config  # noqa: E402
from trlx_scale import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trlx_scale.async_grpo.producer_feed import ProducerFeed  # noqa: E402
from trlx_scale.process_exit import run_then_exit  # noqa: E402
from trlx_scale.tasks import addition_dataset, default_model_path, exact_match_reward  # noqa: E402

FAULTS = (
    "reward_rank1",
    "producer_rank1",
    "server_500",
    "lost_update",
    "lora_sync",
    "background",
    "server_500_background",
    "lost_update_background",
    "server_dead",
)
RANK = int(os.environ.get("RANK", "0"))
ARMED = {"fault": None}  # the fault now active in this process
BASE = {"path": None}


def reward_that_fails_on_rank1(completions, **kwargs):
    if ARMED["fault"] == "reward_rank1" and RANK == 1:
        raise ValueError("the verifier on rank 1 crashed")
    return [0.0] * len(completions)


class FaultyFeed(ProducerFeed):
    def producer_prompt(self, index: int):
        if ARMED["fault"] == "producer_rank1" and RANK == 1:
            raise KeyError(f"rank 1 has no prompt for group {index}")
        return super().producer_prompt(index)


class FaultyTrainer(AsyncGRPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.producer_feed = FaultyFeed(self)


class InjectAfterStep2(TrainerCallback):
    def __init__(self, fault: str, proxy: str, armed_at: dict):
        self.fault, self.proxy, self.armed_at = fault, proxy, armed_at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != 2:
            return
        self.armed_at["t"] = time.monotonic()
        ARMED["fault"] = self.fault
        mode = {"server_500": "500_on_weights", "lost_update": "drop_weights", "server_dead": "dead"}.get(
            self.fault.removesuffix("_background")
        )
        if mode and RANK == 0:
            httpx.post(f"{self.proxy}/_fault/{mode}", timeout=10).raise_for_status()


def write_the_base() -> str:
    """The embedded model's weights as the trainers write a version (before any trainer: under ZeRO-3 a model
    loaded later would be partitioned, a collective rank 0 cannot run alone)."""
    from transformers import AutoModelForCausalLM

    from trlx_scale.generation.server_weights import write_full_weights

    os.makedirs(f"{sys.argv[2]}.out", exist_ok=True)
    return write_full_weights(AutoModelForCausalLM.from_pretrained(default_model_path()), f"{sys.argv[2]}.out/base")


def put_the_base_back(proxy: str) -> None:
    """An adapter-only sync needs the server's base to be the trainer's: the runs before reloaded it with theirs."""
    from trlx_scale.generation.server_client import SamplingSettings, VLLMServerClient

    VLLMServerClient([proxy], model=default_model_path(), sampling=SamplingSettings(4)).reload_weights(0, BASE["path"])


def run(fault: str, proxy: str, output_dir: str) -> dict:
    ARMED["fault"] = None
    armed_at: dict = {}
    lora = {}
    if fault == "lora_sync":
        from peft import LoraConfig

        lora = dict(vllm_sync_mode="lora")
        if RANK == 0:
            put_the_base_back(proxy)
    args = small_grpo_config(
        output_dir,
        AsyncGRPOConfig,
        max_steps=3 if lora else 6,
        max_staleness=1,
        learning_rate=5e-3,
        request_timeout=300,  # a fault that waited for it would take minutes: the test allows seconds
        vllm_server_base_url=proxy,
        use_cpu=True,  # as examples/async_grpo.py does under configs/accelerate/cpu_ddp.yaml
        ddp_backend="gloo",
        weight_delivery="background" if fault.endswith("background") else "inline",
        **lora,
    )
    trainer = FaultyTrainer(
        model=default_model_path(),
        reward_funcs=[exact_match_reward, reward_that_fails_on_rank1],
        args=args,
        train_dataset=addition_dataset("train", size=128),
        callbacks=[] if lora or fault == "background" else [InjectAfterStep2(fault, proxy, armed_at)],
        peft_config=LoraConfig(r=8, target_modules=["q_proj", "v_proj"]) if lora else None,
    )
    outcome = {"fault": fault, "rank": RANK}
    try:
        trainer.train()
        outcome["error"] = None
    except Exception as error:  # noqa: BLE001 - the point of the test
        outcome.update(
            error=type(error).__name__,
            message=str(error),
            seconds_after_injection=time.monotonic() - armed_at["t"] if "t" in armed_at else None,
            traceback=traceback.format_exc()[-3000:],
        )
    outcome["steps"] = trainer.state.global_step
    outcome["background"] = [log["sync/background"] for log in trainer.state.log_history if "sync/background" in log]
    outcome["probe_gaps"] = [
        log["sync/probe_logprob_gap"] for log in trainer.state.log_history if "sync/probe_logprob_gap" in log
    ]
    outcome["staleness"] = [
        log["async/staleness_max"] for log in trainer.state.log_history if "async/staleness_max" in log
    ]
    outcome["gathered_bytes"] = [
        log["sync/gathered_bytes"] for log in trainer.state.log_history if "sync/gathered_bytes" in log
    ]
    model = trainer.accelerator.unwrap_model(trainer.model)
    outcome["model_bytes"] = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters())
    outcome["adapter_bytes"] = sum(
        getattr(p, "ds_numel", p.numel()) * p.element_size() for name, p in model.named_parameters() if "lora_" in name
    )
    trainer.accelerator.wait_for_everyone()  # both ranks are out of the run before the next one starts
    if RANK == 0 and fault != "server_dead":
        httpx.post(f"{proxy}/_fault/pass", timeout=10).raise_for_status()
    trainer.accelerator.wait_for_everyone()
    return outcome


def main() -> None:
    proxy, report = sys.argv[1], sys.argv[2]
    if RANK == 0:
        BASE["path"] = write_the_base()
    outcomes = [run(fault, proxy, f"{report}.out/{fault}") for fault in FAULTS]
    with open(f"{report}.rank{RANK}.json", "w") as handle:
        json.dump(outcomes, handle, indent=1)


if __name__ == "__main__":
    run_then_exit(main)
