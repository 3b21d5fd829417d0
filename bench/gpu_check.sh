#!/usr/bin/env bash
# GPU check for a lent GPU machine (issue 8): RetroMAE BERT-base len 512 bf16 for ~200 steps
# (tokens/s, MFU) and a refresh over 1M random blocks with faiss-gpu. Under 8 minutes on one H200.
#   bash bench/gpu_check.sh          # GPU (falls back to the reduced CPU form when no GPU is visible)
#   bash bench/gpu_check.sh --cpu    # reduced CPU form (tests run this)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec timeout "${GPU_CHECK_TIMEOUT:-480}" "$PY" bench/gpu_check.py "$@"
