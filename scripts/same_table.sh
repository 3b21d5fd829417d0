#!/usr/bin/env bash
# Does a change alter any result? The tiny preset's table at two commits, everything but their code pinned.
#
#   bash scripts/same_table.sh BASE HEAD [WORKDIR]     # ~8-12 min per commit on 2 cores; exit 0: identical
#
# Each commit runs `flows.pipeline --preset tiny` in its own fresh clone (this checkout's .venv linked in).
# Two things would make two runs of one commit differ, so both are pinned (docs/reliability.md, Determinism):
#  - the tokenizer: WordPiece training is not deterministic (huggingface/tokenizers#1794), so HEAD's clone
#    gets BASE's data/tokens after its tokenize stage, recorded with `dvc commit -f tokenize`;
#  - REALM's index refresh: `realm.refresh_mode=sync`, so every step retrieves from the same index version.
# Then every number in metrics/eval.json must be equal but wall-clock seconds, and results.md is diffed.
# A commit whose evaluate fails after writing metrics/eval.json (e.g. on MLflow) is still compared.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 BASE HEAD [WORKDIR]" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
base=$(git -C "$ROOT" rev-parse --short "$1") || exit 2
head=$(git -C "$ROOT" rev-parse --short "$2") || exit 2
work=$(realpath -m "${3:-/tmp/same_table}")
mkdir -p "$work"
sets=(--preset tiny --set realm.refresh_mode=sync)

run() {  # run COMMIT: the pipeline in a fresh clone, on BASE's tokens unless COMMIT is BASE
  local c=$1 d="$work/ws-$1"
  rm -rf "$d" && git clone -q "$ROOT" "$d" && git -C "$d" checkout -q "$c" && ln -s "$ROOT/.venv" "$d/.venv" || return 1
  (
    cd "$d" || exit 1
    .venv/bin/python -m flows.pipeline "${sets[@]}" --upto tokenize > pipeline-tokenize.log 2>&1 || exit 1
    if [ "$c" = "$base" ]; then
      rm -rf "$work/tokens" && cp -r data/tokens "$work/tokens"
    else
      rm -rf data/tokens && cp -r "$work/tokens" data/tokens && .venv/bin/dvc commit -f -q tokenize || exit 1
    fi
    t0=$(date +%s)
    .venv/bin/python -m flows.pipeline "${sets[@]}" > pipeline.log 2>&1 || echo "$c: the pipeline failed; comparing metrics/eval.json if it was written" >&2
    echo "$c: $(( $(date +%s) - t0 )) s after tokenize, log $d/pipeline.log" >&2
    test -f metrics/eval.json
  )
}

run "$base" || { echo "$base: no metrics/eval.json (see $work/ws-$base)" >&2; exit 2; }
run "$head" || { echo "$head: no metrics/eval.json (see $work/ws-$head)" >&2; exit 2; }
diff "$work/ws-$base/metrics/eval/results.md" "$work/ws-$head/metrics/eval/results.md" && echo "results.md: identical"
"$ROOT/.venv/bin/python" - "$work/ws-$base/metrics/eval.json" "$work/ws-$head/metrics/eval.json" <<'EOF'
import json, sys

def leaves(node, path=""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from leaves(value, f"{path}[{i}]")
    else:
        yield path, node

a, b = (dict(leaves(json.load(open(p)))) for p in sys.argv[1:3])
timing = lambda k: k.endswith("seconds")  # wall clock: differs run to run  # noqa: E731
differ = sorted(k for k in a.keys() | b.keys() if not timing(k) and a.get(k) != b.get(k))
print(f"metrics/eval.json: {sum(not timing(k) for k in a)} values, {len(differ)} differ (wall-clock seconds ignored)")
for k in differ[:40]:
    print(f"  {k}: {a.get(k)} -> {b.get(k)}")
sys.exit(1 if differ else 0)
EOF
