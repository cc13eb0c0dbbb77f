#!/usr/bin/env bash
# The next GPU session: benchmarks/gpu_window.py (one call does everything, the same call again reruns
# what did not finish; benchmarks/README.md, "The next GPU session"). Kept as a thin wrapper for the old
# name: every argument goes to gpu_window.py (--out, --budget, --dry-run...), PYTHON names the node's
# interpreter with its CUDA torch (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
exec "$PY" benchmarks/gpu_window.py --python "$PY" "$@"
