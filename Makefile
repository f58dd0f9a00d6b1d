# reprotrain — every target takes Hydra overrides through ARGS="...".
# `make train` and `make test` build .venv from the hashed locks first when needed.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=
SEEDS  ?= 0,1,2
RUN    ?=
ARCHIVE ?=
EPOCHS ?=
PKG    ?=

# Hash randomisation is fixed at interpreter start; the entry point also re-execs itself
# when this is missing, so plain `python -m reprotrain.train` is covered too.
export PYTHONHASHSEED := 0
# Must be set before the first CUDA call (cuBLAS reads it once).
export CUBLAS_WORKSPACE_CONFIG := :4096:8

.DEFAULT_GOAL := help
.PHONY: help install train test lint format verify sweep resume archive reproduce \
        lock upgrade check-lock env-check pin-base docker-build docker-train docker-test \
        bench clean

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

# The stamp is newer than both locks and pyproject.toml once the venv matches them, so an
# unchanged lock installs nothing. A failed install leaves no stamp (and is retried).
$(STAMP): requirements.lock requirements-dev.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --require-hashes --no-deps -r requirements.lock -r requirements-dev.lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

install: $(STAMP) ## build .venv from the hashed locks (no-op when unchanged)

train: $(STAMP) ## one run: make train ARGS="experiment=smoke"
	$(PY) -m reprotrain.train $(ARGS)

test: $(STAMP) ## the test suite (CPU, offline)
	$(PY) -m pytest -q

lint: $(STAMP) ## ruff lint + format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP) ## ruff autofix + format
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

verify: $(STAMP) ## same config twice in fresh processes; exit 0 only if bitwise identical
	$(PY) -m reprotrain.tools.verify $(ARGS)

sweep: $(STAMP) ## Hydra multirun over seed.base=$(SEEDS) + summary.json / summary.md
	$(PY) -m reprotrain.train --multirun seed.base=$(SEEDS) $(ARGS)

resume: $(STAMP) ## continue an interrupted run in place: make resume RUN=outputs/...
	@test -n "$(RUN)" || { echo "error: give the run directory: make resume RUN=outputs/<run>"; exit 2; }
	$(PY) -m reprotrain.tools.resume $(RUN) $(ARGS)

archive: $(STAMP) ## pack a run: make archive RUN=outputs/...
	@test -n "$(RUN)" || { echo "error: give the run directory: make archive RUN=outputs/<run>"; exit 2; }
	$(PY) -m reprotrain.tools.archive $(RUN) $(ARGS)

reproduce: $(STAMP) ## replay an archive and compare: make reproduce ARCHIVE=archives/x.tar.gz [EPOCHS=1]
	@test -n "$(ARCHIVE)" || { echo "error: give the archive: make reproduce ARCHIVE=archives/<file>.tar.gz"; exit 2; }
	$(PY) -m reprotrain.tools.reproduce $(ARCHIVE) $(if $(EPOCHS),--epochs $(EPOCHS)) $(ARGS)

bench: $(STAMP) ## benchmarks: step time, checkpoint save/load ratio
	$(PY) scripts/bench.py $(ARGS)

clean: ## remove outputs (keeps .venv and data/)
	rm -rf outputs multirun archives .pytest_cache .ruff_cache
