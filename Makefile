# Two entry points do all the set-up themselves: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PREFIX := data/builtin.prefix

.PHONY: demo test test-fast reproduce setup data clean gpu-wheels

setup: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $@

# The built-in dataset (the stdlib's own sources), built once; its prefix is kept in $(PREFIX).
data: $(STAMP)
	@mkdir -p data
	$(PY) -m megatron.training.builtin_data --data-dir data > $(PREFIX)

# A small GPT on 4 local processes (pipeline 2 x data 2, the built-in dataset) under
# chameleon-launch: one worker is killed mid-run, the job recovers in-process, and a summary sets
# its losses beside a failure-free run's (runs/demo/losses.png). DEMO_ITERS=N: N iterations (60).
demo: data
	OMP_NUM_THREADS=1 $(PY) -m tools.demo --data-path "$$(cat $(PREFIX))" --out runs/demo

test: data
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -q --durations=20

# The paper's tables and plots: results/REPORT.md, a CSV per table, PNGs (about an hour on 2 cores,
# plus table 2's simulated traces: 11.5 min of one core per seed, 20 seeds, one process per core;
# see the README).
reproduce: data
	OMP_NUM_THREADS=1 $(PY) -m tools.reproduce all --out results

# What tools/gpu_check.sh installs on a GPU machine without network: megatron-core and its non-torch
# dependencies (Python 3.12, manylinux x86_64) and this project's wheel, in the git-ignored wheels/
# (about 20 MB; carry it along). Then, there: bash tools/gpu_check.sh
gpu-wheels: $(STAMP)
	PYTHON=$(PY) bash tools/gpu_check.sh --build-wheels wheels

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests/unit -q

clean:
	rm -rf runs results build *.egg-info
