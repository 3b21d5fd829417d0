#!/usr/bin/env bash
# Create .venv with the exact pinned stack (requirements/lock.txt) and install this project into it.
#
#   bash scripts/setup.sh            # idempotent; seconds with a warm uv cache (no bytecode compile, below), minutes cold
#
# CPU torch: if PIP_FIND_LINKS points at a folder holding the torch 2.13.0 CPU wheel, uv is told about it.
# Otherwise set UV_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu for a CPU build, or install your
# own CUDA torch afterwards (see docs/operations.md "GPU machines").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

if ! command -v uv >/dev/null 2>&1; then
  echo "[setup] installing uv (fast, deterministic resolver) with pip"
  "$PY" -m pip install --quiet "uv==0.13.9"
fi
UV="$(command -v uv || echo "$PY -m uv")"

find_links=()
for d in ${PIP_FIND_LINKS:-}; do find_links+=(--find-links "$d"); done

# the offline page template for `dvc plots show` (vega from npm; skipped without npm)
timeout 180 bash scripts/vega_offline.sh || echo "[setup] could not build plots/templates/offline.html (see scripts/vega_offline.sh)"

stamp="$VENV/.lock.sha256"
want="$(sha256sum requirements/lock.txt pyproject.toml | sha256sum | cut -c1-64)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] $VENV is up to date with requirements/lock.txt"
  exit 0
fi
[ -x "$VENV/bin/python" ] || $UV venv --quiet --python "$PY" "$VENV"
echo "[setup] syncing $VENV to requirements/lock.txt"
# No --compile-bytecode: compiling the whole stack (26k files) takes ~27 s on 2 cores, and a run imports
# a quarter of it. Python writes each module's .pyc at its first import instead (~14 s of one core,
# spread over a run's first processes); the Makefile clears PYTHONDONTWRITEBYTECODE for its commands
# so that it may. RR_COMPILE_BYTECODE=1 compiles everything here (a venv that will be read-only).
compile=()
[ "${RR_COMPILE_BYTECODE:-0}" = 1 ] && compile=(--compile-bytecode)
VIRTUAL_ENV="$VENV" $UV pip sync --quiet "${compile[@]}" "${find_links[@]}" requirements/lock.txt
VIRTUAL_ENV="$VENV" $UV pip install --quiet --no-deps "${compile[@]}" -e .
echo "$want" > "$stamp"
# the versions from the packages' metadata: importing the four libraries to print them cost ~4 s of every `make run`
echo "[setup] done: $("$VENV/bin/python" -c 'from importlib.metadata import version as v; print(*(f"{n} {v(n)}" for n in ("torch", "transformers", "mlflow", "prefect")))')"
