#!/usr/bin/env bash
# One short GPU check (single GPU): GRPO steps of the example under FSDP2 and under DeepSpeed ZeRO-3 (via
# Accelerate), with fp32 master weights, and PPO steps (full policy, its reference, a separate critic) under FSDP2,
# plus the GPU-only tests, the packing benchmark at a real size, the planner's GPU memory against the measured peak,
# and the model states each role holds
# (memory/held/<role>_gib) beside the peak. The device machine has torch, transformers, accelerate and peft but no vLLM and no network: carry wheels for
# trl (and deepspeed) in ./wheels; generation then uses transformers (--use_vllm false).
#   bash benchmarks/device_check.sh            -> prints one line per check and exits non-zero on a failure
set -uo pipefail
cd "$(dirname "$0")/.."
[ -d wheels ] && python -m pip install --no-index --find-links wheels trl deepspeed pytest >/dev/null 2>&1
export TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-/tmp/device_check}"; mkdir -p "$out"
status=0
check() {
    name=$1; shift
    if timeout 300 "$@" > "$out/$name.log" 2>&1; then echo "PASS $name"; else echo "FAIL $name (see $out/$name.log)"; status=1; fi
}
python - <<'PY' > "$out/fsdp2_1gpu.yaml"
from trlx_scale.launch_config import LaunchPlan
print(LaunchPlan(nodes=1, gpus_per_node=1, backend="fsdp2").to_yaml())
PY
common=(examples/grpo.py --use_vllm false --max_steps 3 --eval_size 40 --optim_preset grpo --bf16 true --logging_steps 1)
check fsdp2 accelerate launch --config_file "$out/fsdp2_1gpu.yaml" --num_processes 1 "${common[@]}" --output_dir "$out/fsdp2"
check zero3 accelerate launch --config_file configs/accelerate/zero3.yaml --num_processes 1 "${common[@]}" --output_dir "$out/zero3"
ppo=(examples/ppo.py --use_vllm false --use_peft false --max_steps 2 --eval_size 40 --optim_preset ppo_policy --bf16 true --logging_steps 1)
check ppo_fsdp2 accelerate launch --config_file "$out/fsdp2_1gpu.yaml" --num_processes 1 "${ppo[@]}" --output_dir "$out/ppo_fsdp2"
check gpu_tests python -m pytest -q tests/gpu
# Padding-free packed rows at a real size (docs/benchmarks.md): TRL's padded pass, packed rows, the prefix tree; then
# the token budget with the forwards kept or recomputed (recompute_forwards). A 0.55B Llama shape, fp32, sdpa,
# layer checkpointing (TRL's default), 16 long-tail completions of up to 4096 tokens.
packing=(benchmarks/packing.py --device cuda --repeats 3 --hidden 2048 --layers 8 --heads 16 --intermediate 5632
         --vocab-size 32768 --max-completion-len 4096 --gradient-checkpointing)
check packing_gpu python "${packing[@]}"
check packing_budget_gpu python "${packing[@]}" --budget 4096
for run in packing_gpu packing_budget_gpu; do grep -E "^(\||rows)" "$out/$run.log" | sed "s/^/PACKING $run: /"; done
# The memory planner against the GPU (docs/planning.md): planned per-GPU peak vs torch's max_memory_reserved.
for run in fsdp2 zero3; do
    python - "$out/$run/run_summary.json" "$run" <<'PY' || status=1
import json, sys
summary = json.load(open(sys.argv[1]))
planned, measured = summary["memory_planned_peak_gib"], summary["memory_measured_peak_gib"]
print(f"MEMORY {sys.argv[2]}: planned {planned:.2f} GiB per GPU, measured {measured:.2f} GiB (max_memory_reserved), "
      f"gap {100 * (planned - measured) / measured:+.0f}%")
PY
done
# Per role (docs/benchmarks.md "Memory per role on one GPU"): what each role holds at the last log, and the peak.
for run in fsdp2 ppo_fsdp2; do
    python - "$out/$run/trainer_state.json" "$run" <<'PY' || status=1
import json, sys
logs = [entry for entry in json.load(open(sys.argv[1]))["log_history"] if "memory/held/policy_gib" in entry]
last = logs[-1]
held = ", ".join(f"{key.split('/')[-1].removesuffix('_gib')} {value:.3f}" for key, value in last.items()
                 if key.startswith("memory/held/"))
print(f"ROLES {sys.argv[2]}: held GiB per role: {held}; peak {last.get('memory/peak_device_gib', float('nan')):.2f} GiB "
      f"(max_memory_reserved), planned {last['memory/planned_peak_gib']:.2f} GiB")
PY
done
exit $status
