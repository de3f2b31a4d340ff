# Two entry points do all the set-up themselves: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PREFIX := data/builtin.prefix
PORT   ?= 29531

.PHONY: demo test test-fast reproduce setup data clean

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
	$(PY) -W ignore -m megatron.training.builtin_data --data-dir data > $(PREFIX)

# Pipeline 2 x data 2 on 4 local gloo (or NCCL) processes, built-in dataset.
demo: data
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --nproc-per-node 4 --master-addr 127.0.0.1 \
	  --master-port $(PORT) pretrain_gpt.py \
	  --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 \
	  --seq-length 64 --micro-batch-size 4 --global-batch-size 32 --train-iters 60 \
	  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 5 \
	  --data-path $$(cat $(PREFIX)) --split 98,2,0 --eval-interval 20 --eval-iters 2 --log-interval 10 \
	  --chameleon-metrics-file runs/demo/metrics.jsonl --tensorboard-dir runs/demo/tensorboard

test: data
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -q

# The paper's tables and plots: results/REPORT.md, a CSV per table, PNGs (about 15 min on 2 cores).
reproduce: data
	OMP_NUM_THREADS=1 $(PY) -m tools.reproduce all --out results

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests/unit -q

clean:
	rm -rf runs results build *.egg-info
