#!/usr/bin/env bash
# One command on a bare, air-gapped GPU node: install what it lacks from a folder of wheels, run the GPU
# tests and the GPU benchmark, and leave every table and log in one folder.
#
#   benchmarks/gpu_check.sh [WHEELS_DIR] [OUT_DIR]      (defaults: gpu-wheels, gpu-check)
#   make gpu-check WHEELS=... OUT=...                   (the same)
#
# WHEELS_DIR comes from `make gpu-wheels` on a machine with network (see benchmarks/gpu-requirements.txt).
# The node's own torch, transformers and accelerate are used as they are, even when older than the
# project's pins; the wheels go into a scratch folder, ahead of nothing the node has, and the project runs
# from this checkout's src/ (benchmarks/gpu_env.sh). Nothing is downloaded: the
# models are built locally at random init.
#
# STEPS (environment) picks what runs, in order: any of tests, bench, compiled (default: all three), so that
# a short lease can split the work; BENCH_ARGS is passed to both benchmark runs (e.g. "--sizes 0.5b").
#
# OUT_DIR receives: environment.txt (GPU, driver, versions), gpu-tests.log and gpu-tests.xml
# (`pytest -m gpu`), bench.md and bench.json (bench_gpu.py: ours vs TRL at 0.5B and 1.5B),
# bench-compiled.md and .json (ours with the static-cache, compiled decode), and bench.log.
# Exit status: non-zero when a test failed or a benchmark could not run; every step still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-${WHEELS:-gpu-wheels}}
OUT=${2:-${OUT:-gpu-check}}
PY=${PYTHON:-python3}
STEPS=${STEPS:-tests,bench,compiled}
read -r -a BENCH_ARGS <<<"${BENCH_ARGS:-}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# the wheels go to a scratch folder, not OUT_DIR: OUT_DIR holds results only
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
gpu_env_install gpu_check "$WHEELS"
gpu_env_report "$OUT/environment.txt"

status=0
has_step() { [[ ",$STEPS," == *",$1,"* ]]; }
if has_step tests; then
  echo "== GPU tests (pytest -m gpu) =="
  timeout_flag=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && timeout_flag=(--timeout 600)  # a hung kernel fails one test, not the run
  "$PY" -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider "${timeout_flag[@]}" --junitxml "$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1  # 5: nothing collected, every module skipped (no CUDA)
fi
if has_step bench; then
  echo "== GPU benchmark: ours vs TRL =="
  "$PY" benchmarks/bench_gpu.py "${BENCH_ARGS[@]}" --json "$OUT/bench.json" >"$OUT/bench.md" 2>>"$OUT/bench.log" || status=1
  cat "$OUT/bench.md"
fi
if has_step compiled; then
  echo "== GPU benchmark: ours, static cache + compiled decode =="
  "$PY" benchmarks/bench_gpu.py "${BENCH_ARGS[@]}" --only ours --generation compiled --json "$OUT/bench-compiled.json" >"$OUT/bench-compiled.md" 2>>"$OUT/bench.log" || status=1
  cat "$OUT/bench-compiled.md"
fi
echo "gpu_check: results in $OUT (exit $status)"
exit $status
