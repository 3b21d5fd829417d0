"""REALM's diagnostic for a workspace that ran `pretrain_realm`: does the reader read, and does the
retriever's gradient carry signal? What each number means: components/eval/realm_diagnostics.py and
docs/experiments/realm.md ("The diagnostic").

    .venv/bin/python -m experiments.realm_diagnostic                          # this checkout, 96 queries, CPU
    .venv/bin/python -m experiments.realm_diagnostic --workspace /path/to/ws --arm stale --seed 1 --device cuda
    .venv/bin/python -m experiments.realm_diagnostic --out diag.json --queries 192 --batch-size 16
    .venv/bin/python -m experiments.realm_diagnostic --at start     # the retriever REALM started from (ICT's): before vs after
    .venv/bin/python -m experiments.realm_diagnostic --spans        # the corpus only: how many other blocks hold each span

Prints a report and writes the JSON atomically (default: <workspace>/metrics/realm_diagnostic[_<arm>][_start].json).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # shared 2-core machines; raise it where cores are free


def _fmt(v) -> str:
    if isinstance(v, dict) and "mean" in v:
        return "n/a" if v["mean"] is None else f"{v['mean']:+.4g} ± {v['sd']:.2g} (n={v['n']})"
    return "n/a" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))


def format_report(result: dict[str, Any]) -> str:
    """The result as indented `name: value` lines, one section per part."""
    lines = [f"REALM diagnostic: {result['workspace']}, {result.get('at', 'final')} retriever ({result['n_queries']} queries, "
             f"batch {result['batch_size']}, seed {result['seed']}, top_k {result['top_k']}, {result['marginalization']})"]
    for part in ("reader", "retrieval", "gradient"):
        lines += _section(part, result[part])
    return "\n".join(lines)


def _section(name: str, part: dict[str, Any]) -> list[str]:
    lines = [f"{name}:"]
    for k, v in part.items():
        if isinstance(v, dict) and "mean" not in v:
            lines += [f"  {k}:"] + [f"    {kk}: {_fmt(vv)}" for kk, vv in v.items()]
        else:
            lines.append(f"  {k}: {_fmt(v)}")
    return lines


def main(argv: list[str] | None = None) -> dict:
    from components.config_stages import REALM_ARMS
    from components.eval.realm_diagnostics import AT

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workspace", type=Path, default=Path("."), help="folder with params.yaml, data/tokens, models/realm")
    ap.add_argument("--arm", default="refreshed", choices=REALM_ARMS, help="pretrain_realm arm: refreshed (models/realm) or stale (models/realm-stale)")
    ap.add_argument("--at", default="final", choices=AT, help="final: REALM's retriever and index/final; start: the one REALM "
                    "started from (ICT's, models/realm/ict_retriever) and index/first, the same reader when realm.freeze_reader")
    ap.add_argument("--queries", type=int, default=96, help="masked queries measured (whole batches)")
    ap.add_argument("--batch-size", type=int, default=8, help="queries per retriever-gradient batch (REALM's B)")
    ap.add_argument("--seed", type=int, default=0, help="which queries, documents and question batches")
    ap.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1)")
    ap.add_argument("--params", type=Path, default=None, help="params file (default: <workspace>/params.yaml)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: <workspace>/metrics/realm_diagnostic[_<arm>].json)")
    ap.add_argument("--spans", action="store_true", help="only the corpus: how many other blocks hold each salient span "
                    "(what realm.span_min/max_other_blocks choose from); needs data/tokens only, no model "
                    "(default --out: <workspace>/metrics/realm_span_holders.json)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("components.eval.realm_diagnostics").setLevel(logging.INFO)  # its progress lines

    from components.eval.realm_diagnostics import load_workspace, run_diagnostic
    from components.io import write_json_atomic

    if args.spans:
        return _spans(args, write_json_atomic)
    ws = load_workspace(args.workspace, arm=args.arm, device=args.device, params_file=args.params, at=args.at)
    result = {"arm": args.arm, "at": args.at, **run_diagnostic(ws, n_queries=args.queries, batch_size=args.batch_size, seed=args.seed)}
    suffix = ("" if args.arm == "refreshed" else f"_{args.arm}") + ("" if args.at == "final" else f"_{args.at}")
    out = args.out or args.workspace / "metrics" / f"realm_diagnostic{suffix}.json"
    write_json_atomic(out, result)
    print(format_report(result))
    print(f"wrote {out}")
    return result


def _spans(args, write_json_atomic) -> dict:
    """`--spans`: the corpus part alone, from params.yaml and data/tokens/blocks."""
    import datasets

    from components import paths
    from components.config import load_params
    from components.eval.realm_diagnostics import span_holders

    blocks_dir = args.workspace / paths.TOKENS / "blocks"
    if not blocks_dir.exists():
        raise FileNotFoundError(f"{blocks_dir} is missing: run `dvc repro tokenize` in {args.workspace} first")
    p = load_params(args.params or args.workspace / "params.yaml").realm
    result = {"workspace": str(args.workspace), "span_tagger": p.span_tagger,
              **span_holders(datasets.load_from_disk(str(blocks_dir)), p)}
    out = args.out or args.workspace / "metrics" / "realm_span_holders.json"
    write_json_atomic(out, result)
    print("\n".join(_section(f"salient spans by how many other blocks hold them ({result['workspace']})", result)))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError) as e:
        print(f"realm_diagnostic: {e}", file=sys.stderr)
        sys.exit(2)
