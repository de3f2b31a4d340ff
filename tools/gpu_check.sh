#!/usr/bin/env bash
# The first GPU check of this project, prepared to run unattended on a lent machine with one GPU,
# Python 3 and a CUDA torch preinstalled, and NO network: everything else comes from wheels/.
#
#   make gpu-wheels               # here, with the registries reachable: fills wheels/ (git-ignored)
#   bash tools/gpu_check.sh       # there, from the repository root, with wheels/ carried along
#   bash tools/gpu_check.sh --dry-run    # anywhere, no GPU: the same logic on the CPU (make test)
#   bash tools/gpu_check.sh --build-wheels DIR   # what `make gpu-wheels` runs
#
# Steps, each under its own timeout, all of them under one deadline (GPU_CHECK_TOTAL_S, 450 s by
# default, so the whole fits 8 minutes with the machine's start):
#   1. versions: nvidia-smi, Python, torch, CUDA, cuDNN, NCCL, bf16 support, transformer-engine
#      and apex (importable or not);
#   2. install: a venv with --system-site-packages (the machine's torch) in a temp dir, then
#      `pip install --no-index --find-links wheels/` of megatron-core, its non-torch
#      dependencies and this project's wheel (all --no-deps: the machine's torch is never
#      replaced; `pip check` is printed for information);
#   3. train: pretrain_gpt.py, one process without a launcher (RANK 0 of WORLD_SIZE 1, NCCL),
#      --bf16 --mock-data, a GPT of 4 layers, hidden 512, seq 512, with --transformer-impl local
#      (apex's fused kernels when importable, the trainer's banner says which), then with
#      transformer_engine where it is importable ("skipped: ..." otherwise);
#   4. profile: tools/profile_model.py measured on the GPU and analytical (--device-name H200),
#      for the training shape and for a 1.3B-like layer (hidden 2048, seq 2048);
#   5. compare: tools/compare_profiles.py, one table measured / analytical per op and shape.
# pretrain_gpt.py and the tools run from this checkout (its code comes first on sys.path); the
# installed project wheel is what the import check of step 2 loads.
#
# Results (logs, metrics files, profiles, tables, summary.txt) go to $OUT when it is set (the
# device machine brings that folder back), else --out DIR, else runs/gpu_check (runs/gpu_check-dry-run
# with --dry-run). Exit status: 0 when every step that ran passed (a skip is no failure), 1 when
# one failed or timed out, 2 on bad usage.
#
# --dry-run needs no GPU and no wheels/: it prints every command the GPU run would run, then runs
# what the CPU can: the training command without --bf16 for 2 iterations of a tiny GPT on gloo,
# a measured CPU profile and an analytical one of a tiny shape, and their ratio table (< 60 s).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

MODE=gpu
OUT_DIR="${OUT:-}"
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/wheels}"
TOTAL_S="${GPU_CHECK_TOTAL_S:-450}"

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) MODE=dry; shift ;;
    --out) [ $# -ge 2 ] || { echo "gpu_check.sh: error: --out needs a directory" >&2; exit 2; }
           [ -n "${OUT:-}" ] || OUT_DIR="$2"; shift 2 ;;
    --wheels) [ $# -ge 2 ] || { echo "gpu_check.sh: error: --wheels needs a directory" >&2; exit 2; }
              WHEELS="$2"; shift 2 ;;
    --build-wheels) [ $# -ge 2 ] || { echo "gpu_check.sh: error: --build-wheels needs a directory" >&2; exit 2; }
                    MODE=wheels; WHEELS="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

# ---- what the device machine needs besides its torch --------------------------------------------
# megatron-core 0.16.1 requires torch>=2.6.0, numpy, packaging>=24.2 (its extras are not used);
# the project adds tqdm (progress bars, profile_model.py). tokenizers (GPT2BPE/HuggingFace
# tokenizers), tensorboard (--tensorboard-dir) and matplotlib (make demo's plot) are not needed by
# the check (ByteLevelTokenizer, --mock-data) and stay out to keep wheels/ small.
pin() { sed -n "s/^\($1==[^ #]*\).*/\1/p" "$ROOT/requirements.txt" | head -n 1; }
GPU_PYTHON_VERSION="${GPU_PYTHON_VERSION:-3.12}"
GPU_PLATFORM="${GPU_PLATFORM:-manylinux_2_28_x86_64}"   # pip adds the older manylinux tags

if [ "$MODE" = wheels ]; then
  PY="${PYTHON:-$ROOT/.venv/bin/python}"
  case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # for the cd below
  abi="cp${GPU_PYTHON_VERSION/./}"
  reqs=()
  for name in megatron-core numpy tqdm; do
    r="$(pin "$name")"
    [ -n "$r" ] || { echo "gpu_check.sh: error: requirements.txt pins no $name" >&2; exit 2; }
    reqs+=("$r")
  done
  reqs+=("packaging>=24.2")
  if [ -d "$WHEELS" ] && find "$WHEELS" -mindepth 1 ! -name '*.whl' | grep -q .; then
    echo "gpu_check.sh: error: $WHEELS holds more than wheels: not emptying it" >&2; exit 2
  fi
  rm -rf "$WHEELS"; mkdir -p "$WHEELS"
  WHEELS="$(cd "$WHEELS" && pwd)"
  echo "+ pip download (Python $GPU_PYTHON_VERSION, $GPU_PLATFORM, no torch): ${reqs[*]}"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PYTHON_VERSION" \
    --implementation cp --abi "$abi" --platform "$GPU_PLATFORM" -d "$WHEELS" "${reqs[@]}"
  # The project's wheel, pure Python (CHAMELEON_NO_EXT=1: no csrc extension, which would be
  # built for this machine's Python), from a copy of the working tree: setup.py run in place
  # would remove the checkout's own built extension.
  src="$(mktemp -d)"
  trap 'rm -rf "$src"' EXIT
  git ls-files -co --exclude-standard -z | while IFS= read -r -d '' f; do
    if [ -e "$f" ]; then mkdir -p "$src/$(dirname "$f")"; cp -p "$f" "$src/$f"; fi
  done
  echo "+ pip wheel --no-deps . (CHAMELEON_NO_EXT=1, from a copy of the working tree)"
  (cd "$src" && CHAMELEON_NO_EXT=1 "$PY" -m pip wheel -q --no-deps --no-build-isolation \
     -w "$WHEELS" . >/dev/null)
  ls -l "$WHEELS"
  echo "wheels: $(du -sh "$WHEELS" | cut -f1) in $WHEELS"
  exit 0
fi

if [ -z "$OUT_DIR" ]; then
  OUT_DIR="$ROOT/runs/gpu_check"; [ "$MODE" = dry ] && OUT_DIR="$ROOT/runs/gpu_check-dry-run"
fi
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)
DEADLINE=$((START + TOTAL_S))
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
FAILED=0

log() { echo "[gpu_check $(($(date +%s) - START))s] $*"; }
note() { log "$*"; echo "$*" >> "$SUMMARY"; }
# Print a command the way a shell would take it back.
show() { local q; printf -v q '%q ' "$@"; echo "${q% }"; }

# step NAME TIMEOUT_S CMD...: runs CMD under `timeout` (capped by the deadline), its output to the
# terminal and OUT/NAME.log; records ok / FAILED (rc) / TIMED OUT / skipped in summary.txt.
step() {
  local name="$1" want="$2"; shift 2
  local left=$((DEADLINE - $(date +%s) - 5))
  if [ "$left" -lt 10 ]; then
    note "$name: skipped: the check's deadline (${TOTAL_S}s) is reached"; FAILED=1; return 0
  fi
  local limit=$((want < left ? want : left))
  log "== $name (timeout ${limit}s): $(show "$@")"
  local t0=$(date +%s) rc=0
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log" || rc=$?
  local took=$(($(date +%s) - t0))
  if [ "$rc" -eq 0 ]; then
    note "$name: ok (${took}s)"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    note "$name: TIMED OUT after ${took}s (limit ${limit}s)"; FAILED=1
  else
    note "$name: FAILED with exit status $rc (${took}s), see $name.log"; FAILED=1
  fi
  return 0
}

free_port() { "$PYX" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# ---- the configuration ----------------------------------------------------------------------------
# configure gpu|cpu: the shapes, lengths and precision of the runs. The GPU run trains a GPT of
# 4 layers, hidden 512, seq 512 in bf16; its profiles also take a 1.3B-like layer (2 of its 24
# layers timed). The CPU (dry run) takes a tiny GPT, fp32, 2 iterations.
configure() {
  if [ "$1" = gpu ]; then
    TRAIN_MODEL=(--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 512
                 --micro-batch-size 4 --global-batch-size 8)
    TRAIN_ITERS=(--train-iters 30 --log-interval 5)
    PRECISION=(--bf16)
    PROFILE_SHAPES=("train:--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 512 --micro-batch-size 4"
                    "gpt1.3b:--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --micro-batch-size 1")
    PROFILE_ITERS=(--iters 10)
  else
    TRAIN_MODEL=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32
                 --micro-batch-size 2 --global-batch-size 4)
    TRAIN_ITERS=(--train-iters 2 --log-interval 1)
    PRECISION=()
    PROFILE_SHAPES=("tiny:--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --vocab-size 128")
    PROFILE_ITERS=(--iters 2)
  fi
}

# RUN_PY, RUN_WORK, RUN_OUT: the python, temp dir and results dir the commands name.
# train_argv IMPL: ARGV = one single-process training job (RANK 0 of 1, no launcher).
train_argv() {
  local impl="$1"
  ARGV=(env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
        MASTER_PORT="$PORT" "$RUN_PY" pretrain_gpt.py "${TRAIN_MODEL[@]}" "${TRAIN_ITERS[@]}"
        ${PRECISION[@]+"${PRECISION[@]}"} --transformer-impl "$impl" --mock-data
        --data-cache-path "$RUN_WORK/data-cache" --lr 3e-4 --no-progress-bar
        --chameleon-metrics-file "$RUN_OUT/train_$impl.metrics.jsonl")
}

# profile_argv NAME measured|analytical|compare: ARGV = that command for the shape NAME.
profile_argv() {
  local name="$1" kind="$2" entry flags=()
  for entry in "${PROFILE_SHAPES[@]}"; do
    # shellcheck disable=SC2206  # the shape's flags are words without spaces
    [ "${entry%%:*}" = "$name" ] && flags=(${entry#*:})
  done
  local m="$RUN_OUT/profile_${name}_measured.json" a="$RUN_OUT/profile_${name}_analytical.json"
  case "$kind" in
    measured) ARGV=("$RUN_PY" tools/profile_model.py "${flags[@]}" ${PRECISION[@]+"${PRECISION[@]}"}
                    "${PROFILE_ITERS[@]}" --output "$m") ;;
    analytical) ARGV=("$RUN_PY" tools/profile_model.py --mode analytical --device-name H200
                      "${flags[@]}" ${PRECISION[@]+"${PRECISION[@]}"} --output "$a") ;;
    compare) ARGV=("$RUN_PY" tools/compare_profiles.py "$m" "$a" --output "$RUN_OUT/compare_${name}.txt") ;;
  esac
}

# ---- 1. versions ------------------------------------------------------------------------------------
VERSIONS_PY='
import importlib, importlib.util, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    try:
        p = torch.cuda.get_device_properties(0)
        print("device", p.name, "capability", torch.cuda.get_device_capability(0),
              "memory GiB", round(p.total_memory / 2**30, 1), "count", torch.cuda.device_count())
        print("bf16 supported", torch.cuda.is_bf16_supported())
        print("cudnn", torch.backends.cudnn.version())
        print("nccl", torch.cuda.nccl.version())
    except Exception as e:
        print("CUDA query failed:", type(e).__name__, e)
        sys.exit(1)
for name in ("transformer_engine", "apex", "numpy", "megatron.core"):
    if importlib.util.find_spec(name.split(".")[0]) is None:
        print(name + ": not installed")
        continue
    try:
        mod = importlib.import_module(name)
        print(name + ":", getattr(mod, "__version__", "?"), getattr(mod, "__file__", ""))
    except Exception as e:
        print(name + ": installed but not importable:", type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
'
TE_PY='
import transformer_engine, transformer_engine.pytorch
print("transformer_engine", getattr(transformer_engine, "__version__", "?"), "importable")
'
IMPORTS_PY='
import megatron.core, numpy, packaging, torch, tqdm
import chameleon_ext, megatron.training, megatron.elastic
from megatron.core.models.gpt import GPTModel
from chameleon_ext.comm import packed
print("megatron-core", megatron.core.__version__, megatron.core.__file__)
print("megatron.training", list(megatron.training.__path__))
print("chameleon_ext", chameleon_ext.__file__)
print("numpy", numpy.__version__, "torch", torch.__version__)
'

printf '%s' "$VERSIONS_PY" > "$WORK/versions.py"
printf '%s' "$TE_PY" > "$WORK/te.py"
printf '%s' "$IMPORTS_PY" > "$WORK/imports.py"
log "mode $MODE, results in $OUT_DIR, deadline ${TOTAL_S}s"
rev="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || true)"
if [ -n "$rev" ]; then
  git -C "$ROOT" diff --quiet HEAD 2>/dev/null || rev="$rev + local changes"
else
  rev="a copy without .git"
fi
note "gpu_check ($MODE) of $rev on $(uname -n), $(date -u +%FT%TZ)"

if [ "$MODE" = gpu ]; then
  configure gpu
  PY0=""
  for cand in "${PYTHON:-}" python3 python3.12 python; do
    [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import torch' 2>/dev/null \
      && { PY0="$(command -v "$cand")"; break; }
  done
  if [ -z "$PY0" ]; then
    note "versions: FAILED: no python3 on PATH imports torch (set PYTHON=...)"; exit 1
  fi
  if command -v nvidia-smi >/dev/null 2>&1; then
    step nvidia_smi 30 nvidia-smi
  else
    note "nvidia_smi: skipped: nvidia-smi is not on PATH"
  fi
  step versions 60 "$PY0" "$WORK/versions.py"
  if ! "$PY0" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    note "versions: FAILED: torch sees no CUDA device; nothing more to check"
    cat "$SUMMARY"; exit 1
  fi

  # ---- 2. install (offline) -------------------------------------------------------------------------
  if ! ls "$WHEELS"/megatron_core-*.whl "$WHEELS"/chameleon_megatron-*.whl >/dev/null 2>&1; then
    note "install: FAILED: no megatron_core-*.whl and chameleon_megatron-*.whl in $WHEELS (make gpu-wheels here, then carry wheels)"
    cat "$SUMMARY"; exit 1
  fi
  # megatron-core pinned: a machine (an NGC container) may have another one to shadow
  PKGS=("$(pin megatron-core)" tqdm "packaging>=24.2" chameleon-megatron)
  "$PY0" -c 'import numpy' 2>/dev/null || PKGS+=(numpy)   # never replace the machine's numpy
  # GPU_CHECK_NO_VENV=1: straight to the fallback below
  if [ "${GPU_CHECK_NO_VENV:-0}" != 1 ] \
     && "$PY0" -m venv --system-site-packages "$WORK/venv" > "$OUT_DIR/venv.log" 2>&1 \
     && "$WORK/venv/bin/python" -m pip --version >/dev/null 2>&1; then
    PYX="$WORK/venv/bin/python"; TARGET=()
  else  # no ensurepip (Debian without python3-venv): a --target folder on PYTHONPATH instead
    note "install: no venv with pip ($(tail -n 1 "$OUT_DIR/venv.log" 2>/dev/null || echo GPU_CHECK_NO_VENV=1)); pip install --target instead"
    PYX="$PY0"; TARGET=(--target "$WORK/site"); export PYTHONPATH="$WORK/site"
  fi
  # --no-deps: megatron-core's torch>=2.6 and the project's torch pin must not pull a torch
  # --isolated: no PIP_CONSTRAINT (NGC containers set one) or pip.conf of the machine's
  step install 120 "$PYX" -m pip --isolated install --no-index --find-links "$WHEELS" --no-deps \
    --disable-pip-version-check ${TARGET[@]+"${TARGET[@]}"} "${PKGS[@]}"
  "$PYX" -m pip check > "$OUT_DIR/pip_check.log" 2>&1 || true   # information only
  # from the temp dir: the installed wheels, not this checkout
  (cd "$WORK" && step imports 60 "$PYX" "$WORK/imports.py")
  grep -q '^imports: ok' "$SUMMARY" || { echo; cat "$SUMMARY"; exit 1; }
else
  PYX="${PYTHON:-$ROOT/.venv/bin/python}"
  [ -x "$PYX" ] || PYX="$(command -v python3)"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  # What the GPU run runs, from the same functions (PY: the machine's python3 with torch;
  # VENV: a venv in a temp dir).
  echo "--- the GPU run would run:"
  configure gpu
  RUN_PY=VENV/bin/python RUN_WORK=WORK RUN_OUT=OUT PORT="<free port>"
  echo "nvidia-smi"
  echo "PY -c '<versions: python, torch, CUDA, cuDNN, NCCL, bf16, transformer_engine, apex>'"
  echo "PY -m venv --system-site-packages VENV"
  show "$RUN_PY" -m pip --isolated install --no-index --find-links "$WHEELS" --no-deps "$(pin megatron-core)" tqdm \
    "packaging>=24.2" chameleon-megatron "[numpy where PY has none]"
  for impl in local transformer_engine; do train_argv "$impl"; show "${ARGV[@]}"; done
  for entry in "${PROFILE_SHAPES[@]}"; do
    for kind in measured analytical compare; do profile_argv "${entry%%:*}" "$kind"; show "${ARGV[@]}"; done
  done
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "--- $WHEELS holds: $(cd "$WHEELS" && ls -- *.whl | tr '\n' ' ')($(du -sh "$WHEELS" | cut -f1))"
  else
    echo "--- $WHEELS holds no wheels yet: make gpu-wheels before a GPU run"
  fi
  echo "--- the dry run (CPU, fp32, a tiny GPT, gloo) with $PYX:"
  configure cpu
  step versions 30 "$PYX" "$WORK/versions.py"
fi

RUN_PY="$PYX" RUN_WORK="$WORK" RUN_OUT="$OUT_DIR"

# ---- 3. train ----------------------------------------------------------------------------------------
PORT="$(free_port)"
train_argv local
step train_local 200 "${ARGV[@]}"
if [ "$MODE" = gpu ]; then
  if [ $((DEADLINE - $(date +%s))) -lt 30 ]; then
    note "train_transformer_engine: skipped: the check's deadline (${TOTAL_S}s) is reached"; FAILED=1
  elif te_out="$(timeout 60 "$PYX" "$WORK/te.py" 2>&1)"; then
    log "$te_out"
    PORT="$(free_port)"
    train_argv transformer_engine
    step train_transformer_engine 200 "${ARGV[@]}"
  else
    note "train_transformer_engine: skipped: transformer_engine is not importable ($(echo "$te_out" | tail -n 1 | cut -c1-200))"
  fi
  if "$PYX" -c 'import apex' >/dev/null 2>&1; then
    note "apex: importable (train_local.log's \"fused kernels:\" line says whether it was used)"
  else
    note "apex: not importable (train_local used the torch fallbacks)"
  fi
else
  note "train_transformer_engine: skipped: dry run (no CUDA)"
fi

# ---- 4 and 5. profiles and their comparison -----------------------------------------------------------------
for entry in "${PROFILE_SHAPES[@]}"; do
  name="${entry%%:*}"
  profile_argv "$name" measured;   step "profile_${name}_measured" 150 "${ARGV[@]}"
  profile_argv "$name" analytical; step "profile_${name}_analytical" 30 "${ARGV[@]}"
  if [ -f "$OUT_DIR/profile_${name}_measured.json" ] && [ -f "$OUT_DIR/profile_${name}_analytical.json" ]; then
    profile_argv "$name" compare;  step "compare_${name}" 30 "${ARGV[@]}"
  else
    note "compare_${name}: skipped: a profile is missing"; FAILED=1
  fi
done

# ---- summary ---------------------------------------------------------------------------------------------------
echo
echo "==================== gpu_check ($MODE) summary, in $OUT_DIR ===================="
cat "$SUMMARY"
for t in "$OUT_DIR"/compare_*.txt; do
  [ -f "$t" ] && { echo; echo "$(basename "$t" .txt):"; cat "$t"; }
done
for impl in local transformer_engine; do
  f="$OUT_DIR/train_$impl.log"
  if [ -f "$f" ]; then
    echo; echo "train_$impl:"; grep -E 'backend|loss:|median iteration time' "$f" || true
  fi
done
echo "total $(($(date +%s) - START))s; result: $([ "$FAILED" -eq 0 ] && echo PASS || echo FAIL)"
exit "$FAILED"
