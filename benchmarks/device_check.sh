#!/usr/bin/env bash
# One short GPU check (single GPU), sized to end within about 8 minutes (DEVICE_CHECK_BUDGET_S, default 470 s of wall
# time: every check runs under `timeout`, capped by what is left of that budget, and a check that would start with
# too little left is skipped with the reason printed). In order of priority:
#   1. async_fsdp2: the asynchronous trainer's side under FSDP2 against the simulated engine
#      (benchmarks/async_fsdp2_gpu.py: the real RolloutProducer, real GRPO-like steps of a Qwen2-0.5B-shaped model
#      sharded with fully_shard, the package's FSDP2 weight gather each step; max_staleness 0, 1, 2, 4);
#   2. fsdp2: GRPO steps of the example under FSDP2 (via Accelerate), bf16 compute with fp32 masters;
#   3. gpu_offload, gpu_sharded_checkpoint, gpu_shared_prefix, gpu_nccl (or gpu_tests for all four): pytest on each
#      file of tests/gpu (the NCCL weight-transfer test skips itself without vLLM);
#   4. ppo_fsdp2: PPO steps (full policy, its reference, a separate critic) under FSDP2;
#   5. zero3: GRPO steps under DeepSpeed ZeRO-3 (skipped, with the reason, when deepspeed is not importable);
#   6. packing_gpu, packing_budget_gpu: the packing benchmark at a real size;
# then the memory planner's GPU peak against the measured one, and the model states each role holds.
# The device machine has torch, transformers, accelerate and peft but no TRL, datasets, DeepSpeed or vLLM and no
# network: the examples need TRL and datasets, carried as wheels (py3.12, --no-deps) in outputs/device_wheels
# (DEVICE_WHEELS; ignored by git, named in the device tool's `carry`); generation then uses transformers
# (--use_vllm false). vLLM's CUDA wheel is far over what may travel, so the NCCL transport cannot run there.
#   bash benchmarks/device_check.sh     -> one line per check (PASS/FAIL/SKIP), exits non-zero on a failure
# Logs and results go to DEVICE_CHECK_DIR (default /tmp/device_check); when $OUT is set (the device tool), the
# summary, the async benchmark's JSON and all logs (one file) are copied there (at most 8 files come back).
set -uo pipefail
cd "$(dirname "$0")/.."
began=$SECONDS
budget=${DEVICE_CHECK_BUDGET_S:-470}
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || PY=python
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
wheels=${DEVICE_WHEELS:-outputs/device_wheels}
if compgen -G "$wheels/*.whl" >/dev/null; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/device_site \
        "$wheels"/*.whl >/dev/null 2>&1; then
        export PYTHONPATH="/tmp/device_site${PYTHONPATH:+:$PYTHONPATH}"
        echo "wheels: installed $(ls "$wheels" | tr '\n' ' ')"
    else
        echo "wheels: install from $wheels failed"
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${DEVICE_CHECK_DIR:-/tmp/device_check}"; mkdir -p "$out"
rm -rf "$out"/*.log "$out"/async_fsdp2_gpu.json "$out"/fsdp2 "$out"/ppo_fsdp2 "$out"/zero3  # no stale results
summary="$out/summary.txt"; : > "$summary"
status=0
say() { echo "$*" | tee -a "$summary"; }
say "device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
say "python: $("$PY" -c 'import sys, torch, transformers, accelerate; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__)' 2>&1 | tail -1)"
have() { "$PY" -c "import $1" >/dev/null 2>&1; }
# DEVICE_CHECKS: the checks to run (names as below; default: all, in order of priority). Everything does not fit in one
# 8-minute call (the first H200 run, docs/benchmarks.md: async_fsdp2 ~200 s, tests/gpu over 200 s), so a lease runs
# e.g. DEVICE_CHECKS="async_fsdp2 fsdp2 ppo_fsdp2 packing_gpu packing_budget_gpu" and the next one
# DEVICE_CHECKS="gpu_offload gpu_sharded_checkpoint gpu_shared_prefix gpu_nccl zero3".
selected=" ${DEVICE_CHECKS:-all} "
wanted() { [ "$selected" = " all " ] || [[ "$selected" == *" $1 "* ]]; }
# check NAME LIMIT_S CMD...: run under timeout min(LIMIT_S, what is left of the budget); skip when under 30 s are left.
check() {
    local name=$1 limit=$2; shift 2
    wanted "$name" || return 0
    local left=$((budget - (SECONDS - began)))
    if [ "$left" -lt 30 ]; then say "SKIP $name (only ${left}s left of the ${budget}s budget)"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$SECONDS
    if timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1; then
        say "PASS $name ($((SECONDS - t0))s)"
    else
        local rc=$?
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then why="timed out after ${limit}s"; else why="exit $rc"; fi
        say "FAIL $name ($why, $((SECONDS - t0))s; see $name.log)"
        status=1
    fi
}
launch=("$PY" -m accelerate.commands.launch)
"$PY" - <<'PY' > "$out/fsdp2_1gpu.yaml" 2>"$out/fsdp2_1gpu.yaml.err"
from trlx_scale.launch_config import LaunchPlan
print(LaunchPlan(nodes=1, gpus_per_node=1, backend="fsdp2").to_yaml())
PY

# 1. The asynchronous trainer's side under FSDP2 against the simulated engine (needs no TRL).
# Sized from the first H200 run: ~20 s start, ~2.6 s per training step (1.0 train + 1.5 sync gather), steps at
# max_staleness 0 ~9.5 s (each waits for its slowest group), 1 ~5 s, 2 and 4 ~3 s: about 170 s for 6 steps of each.
# The JSON is rewritten after every setting, so a run cut by its limit keeps the settings it finished.
check async_fsdp2 230 "$PY" benchmarks/async_fsdp2_gpu.py --device cuda --steps 6 --warmup 1 --calibrate-steps 2 \
    --out "$out/async_fsdp2_gpu.json"
grep -E "^(RESULT|model )" "$out/async_fsdp2.log" 2>/dev/null | sed "s/^/ASYNC: /" | tee -a "$summary"

if have trl && have datasets; then
    common=(examples/grpo.py --use_vllm false --max_steps 3 --eval_size 40 --optim_preset grpo --bf16 true --logging_steps 1)
    # 2. GRPO steps under FSDP2.
    check fsdp2 120 "${launch[@]}" --config_file "$out/fsdp2_1gpu.yaml" --num_processes 1 "${common[@]}" --output_dir "$out/fsdp2"
    # 3. The GPU-only tests, one check per file (a file cut by its limit loses no other file's report; -x prints a
    # failure at once). The sharded-checkpoint file launches the example four times (~50 s each).
    tmo=(); have pytest_timeout && tmo=(--timeout 240)
    for test in offload:test_optimizer_offload_gpu:60 sharded_checkpoint:test_sharded_checkpoint_gpu:240 \
                shared_prefix:test_shared_prefix_fsdp2_gpu:120 nccl:test_nccl_weight_transfer_gpu:60; do
        IFS=: read -r short file limit <<< "$test"
        wanted gpu_tests && [ "$selected" != " all " ] && selected="$selected gpu_$short "
        check "gpu_$short" "$limit" "$PY" -m pytest -x -q -rs --tb=short "${tmo[@]}" "tests/gpu/$file.py"
        grep -E "(passed|failed|skipped|error)" "$out/gpu_$short.log" 2>/dev/null | tail -3 | sed "s/^/GPU_TESTS $short: /" | tee -a "$summary"
    done
    # 4. PPO steps under FSDP2.
    ppo=(examples/ppo.py --use_vllm false --use_peft false --max_steps 2 --eval_size 40 --optim_preset ppo_policy --bf16 true --logging_steps 1)
    check ppo_fsdp2 120 "${launch[@]}" --config_file "$out/fsdp2_1gpu.yaml" --num_processes 1 "${ppo[@]}" --output_dir "$out/ppo_fsdp2"
    # 5. GRPO steps under DeepSpeed ZeRO-3.
    if ! wanted zero3; then :
    elif have deepspeed; then
        check zero3 120 "${launch[@]}" --config_file configs/accelerate/zero3.yaml --num_processes 1 "${common[@]}" --output_dir "$out/zero3"
    else
        say "SKIP zero3 (deepspeed is not installed on this machine and was not carried)"
    fi
else
    for name in fsdp2 gpu_tests ppo_fsdp2 zero3; do
        wanted "$name" || continue
        say "SKIP $name (trl/datasets not importable: carry their wheels in $wheels)"
    done
fi
# 6. Padding-free packed rows at a real size (docs/benchmarks.md): TRL's padded pass, packed rows, the prefix tree; then
# the token budget with the forwards kept or recomputed (recompute_forwards). A 0.55B Llama shape, fp32, sdpa,
# layer checkpointing (TRL's default), 16 long-tail completions of up to 4096 tokens.
packing=(benchmarks/packing.py --device cuda --repeats 2 --hidden 2048 --layers 8 --heads 16 --intermediate 5632
         --vocab-size 32768 --max-completion-len 4096 --gradient-checkpointing)
# 200 s: on an H100 (docs/benchmarks.md) 90 s ended it after its first mode, TRL's padded step.
check packing_gpu 200 "$PY" "${packing[@]}"
check packing_budget_gpu 90 "$PY" "${packing[@]}" --budget 4096
for run in packing_gpu packing_budget_gpu; do
    wanted "$run" || continue
    grep -E "^(\||rows)" "$out/$run.log" 2>/dev/null | sed "s/^/PACKING $run: /" | tee -a "$summary"
done
# The memory planner against the GPU (docs/planning.md): planned per-GPU peak vs torch's max_memory_reserved.
for run in fsdp2 zero3; do
    wanted "$run" || continue
    [ -f "$out/$run/run_summary.json" ] || { say "SKIP MEMORY $run (no run_summary.json)"; continue; }
    "$PY" - "$out/$run/run_summary.json" "$run" <<'PY' 2>&1 | tee -a "$summary" || status=1
import json, sys
summary = json.load(open(sys.argv[1]))
planned, measured = summary["memory_planned_peak_gib"], summary["memory_measured_peak_gib"]
print(f"MEMORY {sys.argv[2]}: planned {planned:.2f} GiB per GPU, measured {measured:.2f} GiB (max_memory_reserved), "
      f"gap {100 * (planned - measured) / measured:+.0f}%")
PY
done
# Per role (docs/benchmarks.md "Memory per role on one GPU"): what each role holds at the last log, and the peak.
for run in fsdp2 ppo_fsdp2; do
    wanted "$run" || continue
    [ -f "$out/$run/trainer_state.json" ] || { say "SKIP ROLES $run (no trainer_state.json)"; continue; }
    "$PY" - "$out/$run/trainer_state.json" "$run" <<'PY' 2>&1 | tee -a "$summary" || status=1
import json, sys
logs = [entry for entry in json.load(open(sys.argv[1]))["log_history"] if "memory/held/policy_gib" in entry]
last = logs[-1]
held = ", ".join(f"{key.split('/')[-1].removesuffix('_gib')} {value:.3f}" for key, value in last.items()
                 if key.startswith("memory/held/"))
print(f"ROLES {sys.argv[2]}: held GiB per role: {held}; peak {last.get('memory/peak_device_gib', float('nan')):.2f} GiB "
      f"(max_memory_reserved), planned {last['memory/planned_peak_gib']:.2f} GiB")
PY
done
say "total $((SECONDS - began))s of the ${budget}s budget; exit $status"
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    cp "$summary" "$OUT/summary.txt"
    [ -f "$out/async_fsdp2_gpu.json" ] && cp "$out/async_fsdp2_gpu.json" "$OUT/"
    for run in fsdp2 ppo_fsdp2 zero3; do
        [ -f "$out/$run/run_summary.json" ] && cp "$out/$run/run_summary.json" "$OUT/${run}_run_summary.json"
    done
    for log in "$out"/*.log "$out"/*.err; do
        [ -f "$log" ] || continue
        echo "===== $(basename "$log")"; tail -c 400000 "$log"
    done > "$OUT/all_logs.txt"
fi
exit $status
