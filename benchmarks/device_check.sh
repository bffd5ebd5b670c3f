#!/usr/bin/env bash
# One short GPU check (single GPU): GRPO steps of the example under FSDP2 and under DeepSpeed ZeRO-3 (via
# Accelerate), with fp32 master weights, plus the GPU-only tests and the planner's GPU memory against the measured
# peak. The device machine has torch, transformers, accelerate and peft but no vLLM and no network: carry wheels for
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
common=(examples/grpo.py --use_vllm false --max_steps 3 --eval_size 40 --optim_preset grpo --bf16 true)
check fsdp2 accelerate launch --config_file "$out/fsdp2_1gpu.yaml" --num_processes 1 "${common[@]}" --output_dir "$out/fsdp2"
check zero3 accelerate launch --config_file configs/accelerate/zero3.yaml --num_processes 1 "${common[@]}" --output_dir "$out/zero3"
check gpu_tests python -m pytest -q tests/gpu
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
exit $status
