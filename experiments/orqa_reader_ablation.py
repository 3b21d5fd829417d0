r"""ORQA's reader choices on the DEV split (issue 18): one set of pre-trained models, the open-QA
readers fine-tuned and evaluated once per variant, paired tests over the dev questions.

A variant is a name and dotted overrides of `finetune.*`, `warm_start.head_lr` (the span head's rate) or
`compute.seed` (the fresh span head and the batch order); the first is the baseline the others are
compared with. Each variant runs the `finetune_reader@<system>` stage body for every
`finetune.qa_systems` entry (the own-paragraph phase, then the reader over its own retrieval) and
the evaluate stage's open-QA rows (`components.eval.rows.qa_rows`), in the workspace, exactly as
the pipeline runs them.

    # a workspace with the pre-trained models, dev split (the test split is never read here);
    # the small preset's corpus ships in the clone (corpora/squad-v1.1-dev-a0-11):
    git clone -q . ../orqa && cd ../orqa && make setup
    .venv/bin/python -m flows.pipeline --preset small --set evaluate.split=dev --upto pretrain_realm
    cd - && .venv/bin/python -m experiments.orqa_reader_ablation --workspace ../orqa \
        --variant linear+per_block: --variant mlp+joint:finetune.span_scorer=mlp,finetune.span_softmax=joint

Each finished variant is kept in `--cache` (default <workspace>/bench_orqa_readers/<name>.result.json,
per-query scores included) and reused by a later call that names it with the same overrides, so a
killed run loses at most one variant, and variants run in different workspaces or calls (a param
that the workspace's params.yaml must hold first) join one table: point `--cache` at one folder.
Delete a variant's file to run it again.

Writes experiments/results/orqa_readers.json (EM/F1 per variant and system, the reader fine-tuning
seconds, the paired randomisation tests) and orqa_readers_per_query.json.gz beside it. `--pool` pools
the per-query files of calls in several workspaces (pre-training seeds) into one set of tests:

    .venv/bin/python -m experiments.orqa_reader_ablation --out experiments/results/default_readers_k3_dev.json \
        --pool experiments/results/default_readers_k3_dev_s1234_per_query.json.gz experiments/results/default_readers_k3_dev_s2_per_query.json.gz
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.io import write_bytes_atomic, write_json_atomic, write_text_atomic  # noqa: E402
from experiments import variants  # noqa: E402

OUT = ROOT / "experiments" / "results" / "orqa_readers.json"
SPLIT = "dev"  # settings are chosen on dev: this script never reads the test split
# what a variant may change: the readers' own section, their span head's lr, and the seed of their fresh head and batches
VARIED = ("finetune.", "warm_start.head_lr", "compute.seed")


def parse_variant(spec: str) -> tuple[str, dict]:
    """'name:finetune.key=value,...' -> (name, {key: value}): only the readers are retrained (keys: VARIED)."""
    try:
        return variants.parse_variant(spec, prefix=VARIED)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def run_variant(name: str, overrides: dict, systems: list[str], scratch: Path) -> dict:
    """Fine-tune and evaluate the readers of one variant in the current directory (the workspace)."""
    from components.config import load_params
    from components.data.tokenize import load_tokenizer
    from components.eval.comparisons import per_query_path, read_per_query
    from components.paths import FINETUNE_OPEN_QA, TOKENS
    from components.eval.rows import eval_sets, qa_rows
    from components.stages.finetune_reader import finetune_reader
    from components.training.precision import autocast_for

    params = load_params("params.yaml", overrides={**overrides, "finetune.qa_systems": systems, "evaluate.split": SPLIT})
    tokenizer = load_tokenizer(TOKENS / "tokenizer")
    shutil.rmtree(FINETUNE_OPEN_QA, ignore_errors=True)  # no reader of an earlier variant is evaluated
    t0 = time.perf_counter()
    summary = {f"{s}.{k}": v for s in systems if s != "closed-book" for k, v in finetune_reader(params, None, s).items()}
    train_s = time.perf_counter() - t0
    main_set = eval_sets(params, tokenizer)[0]
    out_dir = scratch / name
    t0 = time.perf_counter()
    with torch.inference_mode(), autocast_for(params.compute.precision, "cpu"):  # as the evaluate stage reads
        rows = qa_rows(params, main_set, tokenizer, out_dir)
    eval_s = time.perf_counter() - t0
    per_query = {r["system"]: read_per_query(per_query_path(out_dir, main_set.name, r["system"])) for r in rows}
    return {"name": name, "overrides": overrides, "train_s": round(train_s, 1), "eval_s": round(eval_s, 1),
            "rows": {r["system"]: {"em": r["em"], "f1": r["f1"], "n": r["n_questions"]} for r in rows},
            "summary": {k: v for k, v in summary.items() if isinstance(v, (int, float, str))},
            "workspace": str(Path.cwd()), "commit": _commit(), "per_query": per_query}


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def cached_variant(cache: Path, name: str, overrides: dict, run) -> dict:
    """The variant's record from `cache`, or `run()`'s, written there atomically first."""
    path = cache / (re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".result.json")
    if path.is_file():
        v = json.loads(path.read_text())
        if v["overrides"] == overrides:
            print(f"[orqa_readers] variant {name}: reused {path}", flush=True)
            return v
        raise SystemExit(f"{path} holds variant {name} with overrides {v['overrides']}, not {overrides}: "
                         "name the variant differently, or delete the file to run it again")
    v = run()
    write_json_atomic(path, v)
    return v


PAIRS = [("qa:realm", "qa:closed-book"), ("qa:realm", "qa:bm25"), ("qa:realm", "qa:realm-stale")]  # within a variant
METRICS = ("em", "f1")


def tested_pairs(systems: dict[str, list[str]]) -> list[tuple[str, str, str, str]]:
    """(variant A, system A, variant B, system B) of every test, from {variant: its systems} (the first
    variant is the baseline): each later variant against the first per system (closed-book, which never
    answers, excepted), then the systems of PAIRS within each variant."""
    names = list(systems)
    base = names[0]
    return ([(v, s, base, s) for v in names[1:] for s in systems[base] if s in systems[v] and s != "qa:closed-book"]
            + [(v, x, v, y) for v in names for x, y in PAIRS if x in systems[v] and y in systems[v]])


def compare(variants: list[dict]) -> list[dict]:
    """One call's paired randomisation tests (`tested_pairs`). A variant-against-base row names the variants
    in `a` / `b` and the system in `system`; a within-variant row names `<variant> <system>` in both."""
    from components.eval.significance import paired_test, per_query_metric

    pq = {v["name"]: v["per_query"] for v in variants}
    out = []
    for va, sa, vb, sb in tested_pairs({name: list(systems) for name, systems in pq.items()}):
        names = {"a": va, "b": vb, "system": sa} if va != vb else {"a": f"{va} {sa}", "b": f"{vb} {sb}", "system": ""}
        for metric in METRICS:
            r = paired_test(per_query_metric(pq[va][sa], metric), per_query_metric(pq[vb][sb], metric))
            out.append({**names, "metric": metric, "delta": round(r.delta, 4), "p": round(r.p_value, 4), "n": r.n})
    return out


def pool(files: list[Path]) -> dict:
    """Several calls' `*_per_query.json.gz` (one workspace each: a pre-training seed) pooled: the tests of
    `tested_pairs`, per file and over every (file, question) pair."""
    from components.eval.significance import paired_test, per_query_metric, pooled_by_run

    runs = [json.loads(gzip.decompress(f.read_bytes())) for f in files]
    names = list(runs[0])
    if any(list(r) != names for r in runs):
        raise SystemExit(f"--pool: the files hold different variants: {[list(r) for r in runs]}")

    def scores(variant: str, system: str, metric: str) -> list[dict]:
        return [per_query_metric(r[variant][system], metric) for r in runs]

    def test(a: list[dict], b: list[dict]) -> dict:
        per = [paired_test(x, y) for x, y in zip(a, b)]
        both = paired_test(pooled_by_run(dict(enumerate(a))), pooled_by_run(dict(enumerate(b))))
        return {"per_file": [[round(r.delta, 4), round(r.p_value, 4)] for r in per],
                "delta": round(both.delta, 4), "p": round(both.p_value, 4), "n": both.n}

    out = []
    for va, sa, vb, sb in tested_pairs({v: list(runs[0][v]) for v in names}):
        for metric in METRICS:
            out.append({"a": f"{va} {sa}", "b": f"{vb} {sb}", "metric": metric,
                        **test(scores(va, sa, metric), scores(vb, sb, metric))})
    return {"split": SPLIT, "pooled_from": [f.name for f in files], "variants": names, "comparisons": out}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workspace", type=Path, help="a checkout with data/ and the pre-trained models/")
    ap.add_argument("--variant", action="append", metavar="NAME:KEY=VALUE,...")
    ap.add_argument("--pool", nargs="+", type=Path, metavar="PER_QUERY_GZ",
                    help="instead of running: pool earlier calls' *_per_query.json.gz (the same variants, one "
                         "workspace each), per file and over every (file, question) pair -> --out")
    ap.add_argument("--systems", nargs="+", default=["closed-book", "bm25", "realm"])
    ap.add_argument("--cache", type=Path, help="finished variants (default: <workspace>/bench_orqa_readers)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    if a.pool:
        res = pool(a.pool)
        write_text_atomic(a.out, json.dumps(res, indent=2))
        for c in res["comparisons"]:
            per = "; ".join(f"{d:+.4f} (p {p:.4f})" for d, p in c["per_file"])
            print(f"{c['a']} - {c['b']} {c['metric']}: {per}; pooled {c['delta']:+.4f} (p {c['p']:.4f}, n {c['n']})")
        return res
    if a.workspace is None or not a.variant:
        ap.error("--workspace and at least one --variant are required (or --pool)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s - %(message)s")
    specs = [parse_variant(s) for s in a.variant]
    ws = a.workspace.resolve()
    cache = (a.cache or ws / "bench_orqa_readers").resolve()
    variants = []
    with contextlib.chdir(ws):
        for name, overrides in specs:
            print(f"[orqa_readers] variant {name} {overrides}", flush=True)
            v = cached_variant(cache, name, overrides,
                               lambda: run_variant(name, overrides, a.systems, cache / "per_query"))
            print(f"[orqa_readers] {name}: {json.dumps(v['rows'])} train {v['train_s']}s eval {v['eval_s']}s", flush=True)
            variants.append(v)
        realm_params = yaml.safe_load(Path("params.yaml").read_text())["realm"]
    res = {"commit": _commit(), "split": SPLIT, "cpus": os.cpu_count(), "workspace_realm_params": realm_params,
           "variants": [{k: v for k, v in x.items() if k != "per_query"} for x in variants],
           "comparisons": compare(variants)}
    write_text_atomic(a.out, json.dumps(res, indent=2))
    write_bytes_atomic(a.out.with_name(a.out.stem + "_per_query.json.gz"),
                       gzip.compress(json.dumps({x["name"]: x["per_query"] for x in variants}).encode()))
    for c in res["comparisons"]:
        system = f"  {c['system']:<16}" if c["system"] else ""  # a within-variant row names its systems in a and b
        print(f"{c['a']} - {c['b']}{system} {c['metric']}: {c['delta']:+.4f} (p {c['p']:.4f}, n {c['n']})")
    return res


if __name__ == "__main__":
    main()
