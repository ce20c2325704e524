# Two commands do all set-up on a fresh machine:
#   make run   - install, build the embedded default model, SFT warm start, RL, summary table
#   make test  - install, run the whole test suite
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
CADENCE := $(VENV)/bin/cadence
CONFIG ?= configs/default.toml

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

runs/base/config.json: | $(STAMP)
	$(CADENCE) init-model --preset tiny --out runs/base --config $(CONFIG)

run: $(STAMP) runs/base/config.json
	$(CADENCE) sft $(CONFIG)
	$(CADENCE) train $(CONFIG) --out runs/default

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(CADENCE) bench --suite engine --out runs/bench-engine

clean:
	rm -rf runs
