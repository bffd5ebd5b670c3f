# The two commands of the README:
#   make run    GRPO example on the embedded default model, vLLM colocated (CPU build on CPU-only machines)
#   make test   the test-suite (what CI runs)
# Each creates/updates .venv first.

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.trlx_scale_installed
NUM_PROCESSES ?= 1
ARGS ?=

# vLLM on CPU: a 1 GiB KV cache instead of most of the RAM (a user's exported value wins).
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install run test test-fast lint format clean constraints

$(STAMP): pyproject.toml scripts/install.sh constraints/cpu.txt
	bash scripts/install.sh $(VENV)
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/accelerate launch $(if $(filter-out 1,$(NUM_PROCESSES)),--multi_gpu,) \
		--num_processes $(NUM_PROCESSES) --num_machines 1 --mixed_precision no --dynamo_backend no \
		examples/grpo.py $(ARGS)

# Every test's time goes to outputs/test-times.xml (JUnit), to find what makes the suite slow.
test: $(STAMP)
	$(PY) -m pytest -q --durations=30 --junitxml=outputs/test-times.xml $(ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Rewrite constraints/cpu.txt: the newest stack pyproject.toml admits, installed into a fresh venv, then frozen. Run the
# suite on it (make clean test) before committing the new pins.
constraints:
	rm -rf $(VENV).constraints
	TRLX_SCALE_CONSTRAINTS=none bash scripts/install.sh $(VENV).constraints
	mkdir -p constraints
	$(VENV).constraints/bin/python -m pip freeze --exclude-editable --exclude trlx-scale > constraints/cpu.txt
	rm -rf $(VENV).constraints

clean:
	rm -rf $(VENV) outputs .pytest_cache .ruff_cache
