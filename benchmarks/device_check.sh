#!/usr/bin/env bash
# Device check: train-step MFU per attention path, sampler tokens/s, peak memory against the
# memory plan, full GSM8K RL steps, and (on a host with 2 or more GPUs) the same RL steps sync
# against async rollouts, in under 8 minutes on one H200 (default --budget-s 420). What each
# number means: the docstring of benchmarks/device_check.py.
#
#   bash benchmarks/device_check.sh                       # GPU: Qwen2.5-0.5B shapes, bf16
#   bash benchmarks/device_check.sh --arch qwen2.5-1.5b   # 1.5B shapes
#   bash benchmarks/device_check.sh --tiny                # smoke run, any backend (~1-2 min on CPU)
#   bash benchmarks/device_check.sh --out /path/r.json --budget-s 300 --attention cudnn,xla
#
# Needs a Python with this repo and GPU jax; it installs nothing. If the environment lacks
# them: pip install -e ".[cuda]"  (".[cuda,test]" adds torch + transformers, which the RL
# section then uses to write its random checkpoint; without them it writes it with
# m2po_jax.models.hf.save_pretrained). Python: $PYTHON, else ./.venv/bin/python, else python3.
#
# Environment set here (override by exporting first):
#   XLA_PYTHON_CLIENT_PREALLOCATE=false  memory is allocated on demand, so each worker's
#                                        peak_bytes_in_use is what it really used;
#   JAX_COMPILATION_CACHE_DIR            persistent compile cache: the behaviour log-prob
#                                        forward compiles once for all train sections, and
#                                        a rerun skips compiles (its compile_s then reads
#                                        the cache; the report's meta names the dir).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-${TMPDIR:-/tmp}/m2po_device_check_jax_cache}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-1}"

echo "python: $PY ($("$PY" -c 'import jax; print("jax", jax.__version__)' 2>&1 | tail -1))"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit \
    --format=csv,noheader 2>&1 | sed 's/^/nvidia-smi: /'
else
  echo "nvidia-smi: not found"
fi
exec "$PY" "$HERE/device_check.py" "$@"
