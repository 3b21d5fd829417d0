#!/usr/bin/env bash
# GPU check for a lent GPU machine (issue 8): RetroMAE BERT-base len 512 bf16 for ~200 steps
# (tokens/s, MFU), a refresh over 1M random blocks with faiss-gpu, a 2-rank sharded refresh, and a
# 2-process NCCL DDP run when more than one GPU is visible. Under 10 minutes on one H200.
#   bash bench/gpu_check.sh          # GPU (falls back to the reduced CPU form when no GPU is visible)
#   bash bench/gpu_check.sh --cpu    # reduced CPU form (tests run this)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec timeout "${GPU_CHECK_TIMEOUT:-570}" "$PY" bench/gpu_check.py "$@"
