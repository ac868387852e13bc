#!/usr/bin/env bash
# jaxtp on an NVIDIA GPU host: bf16 GPT-3 1.3B-shaped train-step throughput and MFU, in a few
# minutes. The host brings its own CUDA jax + flax, optax, orbax-checkpoint, chex (no internet is
# needed: jaxtp is installed with --no-deps and without build isolation, and PYTHONPATH covers a
# failed install). With no GPU it prints why, writes a "skipped" result and exits 0.
#
#   bash benchmarks/gpu.sh [gpu_throughput.py args, e.g. --batches 8,4 parallel.model=8]
#
# Results go to $OUT if set, else benchmarks/results/gpu/ (gpu_throughput.md / .json, logs).
# Knobs: PYTHON (default python3, else python), GPU_BENCH_TIMEOUT_S (default 300: the whole script
# stays under ~6 minutes), XLA_FLAGS (appended to, never replaced).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
T0=$(date +%s)
say() { echo "[gpu.sh +$(( $(date +%s) - T0 ))s] $*"; }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >"$OUT_DIR/nvidia-smi.txt" 2>&1; then
  say "no NVIDIA GPU (nvidia-smi missing or failing); skipping the GPU benchmark"
  printf '# jaxtp GPU throughput\n\nskipped: no NVIDIA GPU on %s (nvidia-smi unavailable)\n' \
    "$(hostname)" >"$OUT_DIR/gpu_throughput.md"
  exit 0
fi
nvidia-smi >>"$OUT_DIR/nvidia-smi.txt" 2>&1 || true
say "GPUs: $(nvidia-smi -L | tr '\n' ';')"

# Install jaxtp itself only; --no-build-isolation so pip does not fetch setuptools.
if "$PY" -m pip install --no-deps --no-build-isolation -e . >"$OUT_DIR/pip.log" 2>&1; then
  say "pip install --no-deps -e . ok"
else
  say "pip install failed (see $OUT_DIR/pip.log); using PYTHONPATH=$PWD instead"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# XLA flags from JAX's GPU performance tips: the latency-hiding scheduler overlaps collectives with
# compute; combine thresholds make the data-parallel gradient sync a few large all-reduces (these
# only matter with more than one GPU). An unknown flag is fatal to XLA and names change between
# releases, so the set is probed and shrunk until jax starts.
FULL="--xla_gpu_enable_latency_hiding_scheduler=true \
--xla_gpu_all_reduce_combine_threshold_bytes=134217728 \
--xla_gpu_all_gather_combine_threshold_bytes=134217728 \
--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728"
MIN="--xla_gpu_enable_latency_hiding_scheduler=true"
BASE_FLAGS="${XLA_FLAGS:-}"
CHOSEN=""
for CAND in "$FULL" "$MIN" ""; do
  if XLA_FLAGS="$BASE_FLAGS $CAND" timeout 120 "$PY" -c \
      "import jax, jax.numpy as jnp; jnp.ones(8).block_until_ready(); print(jax.devices())" \
      >"$OUT_DIR/flag_probe.log" 2>&1; then
    CHOSEN="$CAND"; break
  fi
  say "XLA flags rejected: ${CAND:-<none>} ($(tail -n 1 "$OUT_DIR/flag_probe.log"))"
done
export XLA_FLAGS="$BASE_FLAGS $CHOSEN"
# Let XLA's allocator use most of the device (default 75%).
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
say "XLA_FLAGS=$XLA_FLAGS"

set +e
timeout "${GPU_BENCH_TIMEOUT_S:-300}" "$PY" benchmarks/gpu_throughput.py --out "$OUT_DIR" "$@" \
  2>&1 | tee "$OUT_DIR/gpu_throughput.log"
RC=${PIPESTATUS[0]}
set -e
if [ "$RC" = 124 ]; then
  say "timed out; partial results (if any) in $OUT_DIR/gpu_throughput.md"
fi
say "done (rc=$RC); results in $OUT_DIR"
exit "$RC"
