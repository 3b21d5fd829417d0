# retro-realm: every entry point. `make help` lists them.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)
export OMP_NUM_THREADS ?= 2
export TOKENIZERS_PARALLELISM ?= false
# setup compiles no bytecode: each module's .pyc is written at its first import (scripts/setup.sh), so
# a PYTHONDONTWRITEBYTECODE=1 in the caller's environment would make every process compile from source
export PYTHONDONTWRITEBYTECODE :=

.PHONY: help setup run test test-fast bench lock servers-up servers-down clean-outputs

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

setup:  ## create .venv from requirements/lock.txt (idempotent)
	@bash scripts/setup.sh

run: setup  ## the main job: the whole pipeline (dvc repro) on the default (real text: the shipped SQuAD slice; PRESET=tiny|small|paper)
	$(PY) -m flows.pipeline $(if $(PRESET),--preset $(PRESET))

# The suite runs its modules on TEST_WORKERS pytest-xdist workers (a module's tests on one worker, so its
# fixtures are built once; each worker starts its own servers), one OpenMP thread each: two on 2 cores.
# TEST_WORKERS=0 (or empty): one process, the modules in order, at OMP_NUM_THREADS as above.
TEST_WORKERS ?= 2
SERIAL_TESTS = $(filter 0,$(or $(TEST_WORKERS),0))
PYTEST = $(if $(SERIAL_TESTS),,OMP_NUM_THREADS=1) $(PY) -m pytest -q $(if $(SERIAL_TESTS),,-n $(TEST_WORKERS) --dist loadfile)

test: setup  ## the full test suite (slow tests included; 9-12 min on 2 cores)
	$(PYTEST) --durations=15

test-fast: setup  ## unit + stage tests only
	$(PYTEST) -m "not slow"

bench: setup  ## the benchmark suite: bench/results/*.json and bench/README.md
	$(PY) -m bench.run_all

lock:  ## recompile requirements/lock.txt from requirements/lock.in (needs uv)
	uv pip compile requirements/lock.in --python-version 3.11 --no-header -q --upgrade-package torch -o requirements/lock.txt $(foreach d,$(PIP_FIND_LINKS),--find-links $(d))
	sed -i 's/^torch==\([0-9.]*\)+cpu/torch==\1/' requirements/lock.txt

servers-up: setup  ## start MLflow, Prefect (+ process worker) and S3 (moto) on 127.0.0.1
	bash infra/servers.sh up all

servers-down:  ## stop them
	bash infra/servers.sh down all

clean-outputs:  ## delete pipeline outputs and checkpoints (not the DVC cache)
	rm -rf data models metrics plots checkpoints
