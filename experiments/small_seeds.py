r"""A real-text preset's claims over seeds (`small`, or `--preset default`: params.yaml as committed):
the whole pipeline once per seed, then every paper comparison per seed and pooled over (seed, query) pairs.

    python -m experiments.small_seeds --seeds 0 1 --split test         # one fresh clone of HEAD per seed (~30 min to ~2 h each)
    python -m experiments.small_seeds --preset default --seeds 0 1 --split dev   # the default (~15 min per seed in bf16)
    python -m experiments.small_seeds --collect experiments/results/small_seeds/seed0.json.gz /tmp/small_seeds/seed1   # tables only
    python -m experiments.small_seeds --name small_curve --set 'finetune.retrieval_inits=[init,mlm,retromae]' ...  # a variant, archived apart
    python -m experiments.small_seeds --name small_curve_realm --upto finetune_retriever --set ...  # part of the DAG, then evaluate
    python -m experiments.small_seeds --name small_curve --take 'ft:realm*' --merge BASE0 EXTRA0 --merge BASE1 EXTRA1  # one seed, two runs
    python -m experiments.small_seeds --preset default --name default_ad0_dev --seeds 1 2 --split dev --set compute.attention_dropout=0 \
        --against experiments/results/default_dev_xeon_seeds/seed{1,2}.json.gz   # a recipe against a baseline's archives

Each seed runs in its own clone of this commit (`git clone`, the venv linked), so the checkout is
never touched and every run is the committed code: `python -m flows.pipeline --preset small --set
compute.seed=<N> --set evaluate.split=<split>` and any `--set` given here (the preset and the overrides
written into the clone's params.yaml, so its dvc.lock records them). `--name` files a variant's
archives and tables apart from the preset's own (default: the preset's name).
The corpus split (`data.split.seed`) stays fixed, so every seed answers the same questions.
`--upto STAGE [STAGE ...]` runs those stages and what they need (`flows.pipeline --upto`, once per stage,
in order), then the evaluate stage's own command outside DVC, which scores the models that exist (a curve
line without the rest of the DAG; `--upto pretrain_retromae pretrain_mlm`: the zero-shot rows alone).

`--merge BASE EXTRA` makes one seed's archive from two runs of it: BASE (an archive) plus the systems
of EXTRA that match a `--take` glob. It refuses unless both ran the same seed on the same split and
the systems both scored that every fine-tune start descends from (`ANCHORS`) agree on every query, so
the added rows start from the same models as BASE's. The archive records what was added from where
(`merged`: commit, CPU, systems, times).

Each finished seed is archived as experiments/results/<name>_seeds/seed<N>.json.gz: its rows, its per-query
scores (what every p-value is computed from), the stage wall times (from each stage's MLflow run),
the commit and the CPU. `--collect` takes archives or workspaces, so seeds run in different sessions
or on different machines pool into one table; a seed without per-query scores (an archive written
by hand from a run whose workspace was lost: `"per_query": null`, its own `comparisons`) gives its
per-seed tests, and the pooled test is left out.

`--against BASELINE...` compares this recipe with another one's archives (same seeds, same split), which
is how a shorter recipe is chosen: every system both scored, this minus the baseline per metric, paired
over the (seed, query) pairs, and each stage's time against the baseline's.

Writes experiments/results/<name>_seeds.json, the curve averaged over seeds as
experiments/results/<name>_seeds/label_efficiency.{png,csv} (when the seeds recorded their curve points), and prints Markdown for docs/results.md: per-seed rows,
stage wall times, the label-efficiency curve's per-size tests (ft:retromae@N vs ft:mlm@N and
ft:init@N, for every size the seeds ran), and each comparison with its delta and two-sided p per seed and pooled (the
paired randomisation test over every (seed, query) pair).
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.eval.comparisons import RETRIEVAL_METRICS, Comparison, paper_comparisons, per_query_path, read_per_query  # noqa: E402
from components.eval.significance import paired_test, per_query_metric, pooled_by_run  # noqa: E402
from bench.workspace import fresh_clone  # noqa: E402
from components.cpuinfo import cpu_label  # noqa: E402
from components.eval.report import write_plots  # noqa: E402
from components.io import write_bytes_atomic, write_text_atomic  # noqa: E402
from components.progress import format_duration  # noqa: E402

RESULTS = ROOT / "experiments/results/{name}_seeds.json"
ARCHIVE = ROOT / "experiments/results/{name}_seeds"
# dvc.yaml's stages; a foreach / matrix group's time is the sum over its `<group>@<item>` stages
STAGES = ("prepare_corpus", "tokenize", "pretrain_retromae", "pretrain_mlm", "pretrain_realm", "finetune_retriever",
          "finetune_reader", "evaluate")
GROUPS = {"pretrain_realm", "finetune_retriever", "finetune_reader"}
ROW_METRICS = ("ndcg_at_10", "recall_at_20", "em", "f1")
ROW_ORDER = ("bm25", "warm-start:mean", "init", "retromae", "mlm", "realm", "realm-stale", "ft:init", "ft:mlm", "ft:retromae",
             "ft:realm", "qa:closed-book", "qa:bm25", "qa:realm", "qa:realm-stale")


def _row_key(name: str) -> tuple:
    """Tables list systems in ROW_ORDER, then the rest (curve points, extra rows) by name."""
    return (ROW_ORDER.index(name) if name in ROW_ORDER else len(ROW_ORDER), name)


def run_seed(seed: int, split: str, workdir: Path, preset: str = "small", overrides: tuple[str, ...] = (),
             upto: tuple[str, ...] = ()) -> Path:
    """Clone HEAD into workdir/seed<N> and run the preset there (`default`: params.yaml as it is) with
    the `KEY=VALUE` overrides (`upto`: each of these stages and what it needs, one pipeline run per stage
    in order, then evaluate what exists); returns the clone."""
    dest = workdir / f"seed{seed}"
    if (dest / "metrics/eval.json").exists():
        print(f"seed {seed}: {dest} already has metrics/eval.json; collecting it", flush=True)
        return dest
    fresh_clone(dest)
    cmd = [".venv/bin/python", "-m", "flows.pipeline", *([] if preset == "default" else ["--preset", preset]),
           "--set", f"compute.seed={seed}", "--set", f"evaluate.split={split}", *(a for o in overrides for a in ("--set", o))]
    t0 = time.time()
    with open(dest / "pipeline.log", "w") as log:
        for stage in upto or [None]:  # a later run reuses what an earlier one built (DVC's cache)
            subprocess.run([*cmd, *(["--upto", stage] if stage else [])], cwd=dest, stdout=log, stderr=subprocess.STDOUT,
                           check=True)
        if upto:  # evaluate's own command, outside DVC (whose evaluate needs every model): rows for what exists
            subprocess.run(["scripts/py", "-m", "flows.evaluate"], cwd=dest, stdout=log, stderr=subprocess.STDOUT, check=True)
    write_text_atomic(dest / "wall_seconds.txt", f"{time.time() - t0:.0f}\n")
    return dest


def stage_seconds(ws: Path) -> dict[str, float]:
    """Wall time of each stage's newest finished MLflow run in a workspace's embedded store (a
    group's: summed over the newest run of each of its stages)."""
    from mlflow.tracking import MlflowClient

    from components.tracking import latest_stage_run

    client = MlflowClient(tracking_uri=f"sqlite:///{ws / 'mlflow.db'}")
    exps = [e.experiment_id for e in client.search_experiments()]
    out: dict[str, float] = {}
    for stage in STAGES:
        if stage in GROUPS:
            newest: dict = {}
            for r in client.search_runs(exps, f"tags.`dvc.stage` LIKE '{stage}@%' and tags.`rr.kind` IS NULL "
                                        "and attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"]):
                newest.setdefault(r.data.tags["dvc.stage"], r)
            runs = list(newest.values())
        else:
            runs = [r for r in [latest_stage_run(client, exps, stage)] if r is not None]
        if runs:
            out[stage] = round(sum(r.info.end_time - r.info.start_time for r in runs) / 1000, 1)
    return out


def archive(ws: Path, seed: int, name: str = "small") -> Path:
    """A finished workspace -> experiments/results/<name>_seeds/seed<N>.json.gz (written atomically): its
    record as `load_seed` reads it, with the seed, commit and CPU, and only the table's metrics."""
    rec = load_seed(ws)
    rec.pop("workspace")
    rec["per_query"] = {system: {q: {m: round(v, 6) for m, v in scores.items() if m in ROW_METRICS} for q, scores in pq.items()}
                        for system, pq in rec["per_query"].items()}
    commit = subprocess.run(["git", "-C", str(ws), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rec.update(seed=seed, commit=commit, cpu=cpu_label())
    return write_archive(rec, name)


def write_archive(rec: dict, name: str) -> Path:
    """A seed's record -> experiments/results/<name>_seeds/seed<N>.json.gz, atomically."""
    dest = Path(str(ARCHIVE).format(name=name)) / f"seed{rec['seed']}.json.gz"
    return write_bytes_atomic(dest, gzip.compress(json.dumps(rec).encode("utf-8")))


def load_seed(src: Path) -> dict:
    """An archive (seed<N>.json[.gz]) or a finished workspace, as one record."""
    if src.is_file():
        opener = gzip.open if src.suffix == ".gz" else open
        with opener(src, "rt", encoding="utf-8") as f:
            return json.load(f)
    table = json.loads((src / "metrics/eval.json").read_text())
    wall = src / "wall_seconds.txt"
    per_query = {system: read_per_query(p) for system in table["main"]
                 if (p := per_query_path(src / "metrics/eval", "main", system)).exists()}
    return {"seed": None, "commit": None, "cpu": None, "split": table.get("split"), "rows": table["main"],
            "wall_seconds": float(wall.read_text()) if wall.exists() else None, "stage_seconds": stage_seconds(src),
            "per_query": per_query, "label_efficiency": table.get("label_efficiency") or [], "workspace": str(src)}


ANCHORS = ("bm25", "init", "retromae")  # what every fine-tune start descends from


def merge_seed(base: dict, extra: dict, take: list[str], anchors: tuple[str, ...] = ANCHORS, tol: float = 1e-6) -> dict:
    """One seed's record from two runs of it: `base` plus the systems of `extra` whose names match a
    `take` glob (rows, per-query scores, curve points). Both must be the same seed on the same split,
    with per-query scores, and every anchor both scored must agree on every query within `tol`:
    otherwise the taken rows would not descend from the models of the base's rows."""
    def fail(why: str):
        raise ValueError(f"cannot merge seed {extra.get('seed')} ({extra.get('commit')}) into seed {base.get('seed')} "
                         f"({base.get('commit')}): {why}")

    if (base.get("seed"), base.get("split")) != (extra.get("seed"), extra.get("split")):
        fail(f"seed/split {base.get('seed')}/{base.get('split')} against {extra.get('seed')}/{extra.get('split')}")
    if base.get("per_query") is None or extra.get("per_query") is None:
        fail("both need per-query scores")
    shared = [a for a in anchors if a in base["per_query"] and a in extra["per_query"]]
    if not shared:
        fail(f"no anchor system ({', '.join(anchors)}) in both, so nothing shows they start from the same models")
    for a in shared:
        pa, pb = base["per_query"][a], extra["per_query"][a]
        if set(pa) != set(pb):
            fail(f"{a} scored different queries")
        worst = max((abs(v - pb[q].get(m, float("inf"))) for q, ms in pa.items() for m, v in ms.items()), default=0.0)
        if worst > tol:
            fail(f"{a} differs by up to {worst:.4g} on a query (tolerance {tol}): the runs do not share their models")
    taken = sorted(s for s in extra["rows"] if any(fnmatch.fnmatchcase(s, g) for g in take))
    if not taken:
        fail(f"no system of it matches {take}")
    if clash := [s for s in taken if s in base["rows"]]:
        fail(f"the base already has {', '.join(clash)}")
    starts = {t[len("ft:"):].partition("@")[0] for t in taken if t.startswith("ft:")}
    out = {**base, "rows": {**base["rows"], **{s: extra["rows"][s] for s in taken}},
           "per_query": {**base["per_query"], **{s: extra["per_query"][s] for s in taken if s in extra["per_query"]}}}
    out["label_efficiency"] = [*(base.get("label_efficiency") or []),
                               *(p for p in extra.get("label_efficiency") or [] if p["kind"] == "fine-tuned" and p["start"] in starts)]
    out["merged"] = [*(base.get("merged") or []),
                     {"systems": taken, "anchors": shared, **{k: extra.get(k) for k in ("commit", "cpu", "wall_seconds", "stage_seconds")}}]
    return out


def merge_archives(pairs: list[tuple[Path, Path]], take: list[str], name: str) -> list[Path]:
    """`merge_seed` for each (base, extra) pair -> experiments/results/<name>_seeds/seed<N>.json.gz."""
    return [write_archive(merge_seed(load_seed(base), load_seed(extra), take), name) for base, extra in pairs]


def _commit_cell(s: dict) -> str:
    """The seed's commit, and where merged rows came from (`+ 1a2b3c4 (ft:realm, ...)`)."""
    added = "".join(f" + {m.get('commit') or '-'} ({', '.join(m['systems'])})" for m in s.get("merged") or [])
    return f"{s.get('commit') or '-'}{added}"


def _stored_test(rec: dict, a: str, b: str, metric: str) -> dict | None:
    """A hand-written archive's own test result for (a, b, metric), when it has no per-query scores."""
    for c in rec.get("comparisons") or []:
        if (c["a"], c["b"], c["metric"]) == (a, b, metric):
            return {"delta": c["delta"], "p": c["p"], "n": c.get("n")}
    return None


def _seed_label(rec: dict, i: int):
    """The seed number an archive records, else the source's position (a workspace knows no seed)."""
    return i if rec.get("seed") is None else rec["seed"]


def curve_sizes(seeds: list[dict]) -> list[int]:
    """The smaller training sizes of the label-efficiency curve the seeds ran (`ft:retromae@<size>` rows)."""
    return sorted({int(name.rpartition("@")[2]) for rec in seeds for name in rec["rows"]
                   if name.startswith("ft:retromae@") and name.rpartition("@")[2].isdigit()})


def size_table(res: dict) -> list[str]:
    """RetroMAE's label-efficiency claim: ft:retromae vs ft:mlm / ft:init at every size, per seed and pooled."""
    def size(c: dict) -> float:
        return float(c["a"].rpartition("@")[2]) if "@" in c["a"] else float("inf")  # ft:retromae: the largest size

    tests = sorted((c for c in res["comparisons"] if (c["a"].startswith("ft:retromae") and c["b"].startswith(("ft:mlm", "ft:init")))
                    or c["a"].startswith("ft:realm")), key=size)
    lines = ["", "Label efficiency, per training size (`ft:<start>` is the largest; delta (p) per seed, and pooled):", "",
             "| A | B | Metric | Per seed | Pooled delta (p) |", "|---|---|---|---|---:|"]
    for c in tests:
        per = "; ".join(f"{s['delta']:+.3f} ({s['p']:.4f})" for s in c["per_seed"])
        pooled = "-" if c["pooled"] is None else f"{c['pooled']['delta']:+.3f} ({c['pooled']['p']:.4f})"
        lines.append(f"| {c['a']} | {c['b']} | {c['metric']} | {per} | {pooled} |")
    return lines if tests else []


def mean_curve(seeds: list[dict]) -> list[dict]:
    """The label-efficiency points (`curve.curve_points`) averaged over the seeds that recorded them:
    one point per (set, start, size), with `seeds` = how many it averages."""
    groups: dict[tuple, list[dict]] = {}
    for rec in seeds:
        for p in rec.get("label_efficiency") or []:
            groups.setdefault((p["dataset"], p["start"], str(p["size"]), p["kind"]), []).append(p)
    out = []
    for points in groups.values():
        means = {m: sum(vals) / len(vals) for m in ("ndcg_at_10", "recall_at_20")
                 if (vals := [p[m] for p in points if p.get(m) is not None])}
        out.append({**points[0], "seeds": len(points), **means})
    return out


def realm_line_comparisons(seeds: list[dict]) -> list[Comparison]:
    """The curve's `ft:realm` line against `ft:retromae` (REALM's retriever starts from RetroMAE's encoder:
    does REALM's pre-training add to it after fine-tuning?) at every size where both lines have a point."""
    names = {n for rec in seeds for n in rec["rows"]}
    return [Comparison(f"ft:realm{tail}", f"ft:retromae{tail}", RETRIEVAL_METRICS, "REALM's pre-training on top of RetroMAE's, "
                       f"after fine-tuning on {tail[1:] or 'all'} questions")
            for tail in ("", *(f"@{n}" for n in curve_sizes(seeds))) if {f"ft:realm{tail}", f"ft:retromae{tail}"} <= names]


def collect(sources: list[Path | dict]) -> dict:
    """Every paper comparison per seed, and pooled over the (seed, query) pairs of the seeds whose
    per-query scores were kept (at least two; a summary without them gives its own test only).
    `sources`: archives or workspaces, or records `load_seed` already read."""
    seeds = [src if isinstance(src, dict) else load_seed(src) for src in sources]
    comparisons = []
    for c in [*paper_comparisons("retromae", curve_sizes(seeds)), *realm_line_comparisons(seeds)]:
        for metric in c.metrics:
            per_seed, pooled_a, pooled_b, pooled_seeds = [], {}, {}, []
            for i, rec in enumerate(seeds):
                pq = rec.get("per_query")
                if pq is None:
                    got = _stored_test(rec, c.a, c.b, metric)
                    if got is not None:
                        per_seed.append(got)
                    continue
                if c.a not in pq or c.b not in pq:
                    continue
                a, b = per_query_metric(pq[c.a], metric), per_query_metric(pq[c.b], metric)
                r = paired_test(a, b)
                per_seed.append({"delta": r.delta, "p": r.p_value, "n": r.n})
                pooled_a[i], pooled_b[i] = a, b
                pooled_seeds.append(_seed_label(rec, i))
            if not per_seed:
                continue
            pooled = None
            if len(pooled_seeds) >= 2:
                r = paired_test(pooled_by_run(pooled_a), pooled_by_run(pooled_b))
                pooled = {"delta": r.delta, "p": r.p_value, "n": r.n, "seeds": pooled_seeds}
            comparisons.append({"a": c.a, "b": c.b, "metric": metric, "question": c.question, "per_seed": per_seed,
                                "pooled": pooled})
    return {"seeds": [{k: v for k, v in rec.items() if k not in ("per_query", "comparisons", "label_efficiency")} for rec in seeds],
            "comparisons": comparisons, "label_efficiency": mean_curve(seeds)}


def against(sources: list[dict], baselines: list[dict]) -> dict:
    """This recipe's seeds against a baseline recipe's: per system both scored and per metric, the delta
    (this - baseline) and the paired test over the (seed, query) pairs of the seeds both ran; per stage,
    the mean seconds of each. Seeds are matched by number and must be on the same split with per-query
    scores (a ValueError that names the seed otherwise)."""
    base = {rec.get("seed"): rec for rec in baselines}
    pairs = []
    for rec in sources:
        other = base.get(rec.get("seed"))
        where = f"seed {rec.get('seed')} ({rec.get('commit') or rec.get('workspace')})"
        if other is None:
            raise ValueError(f"--against: no baseline archive for {where}; the baseline has seeds {sorted(base, key=str)}")
        if rec.get("split") != other.get("split"):
            raise ValueError(f"--against: {where} is on the {rec.get('split')} split, its baseline on {other.get('split')}")
        if rec.get("per_query") is None or other.get("per_query") is None:
            raise ValueError(f"--against: {where} and its baseline both need per-query scores")
        pairs.append((rec, other))
    if not pairs:
        raise ValueError("--against: no seeds to compare")
    systems = [n for n in pairs[0][0]["per_query"] if all(n in r["per_query"] and n in o["per_query"] for r, o in pairs)]
    rows = []
    for system in sorted(systems, key=_row_key):
        for metric in ROW_METRICS:
            a, b = {}, {}
            for rec, other in pairs:
                mine, theirs = (per_query_metric(r["per_query"][system], metric) for r in (rec, other))
                if not mine or not theirs:
                    continue
                a.update({f"{rec['seed']}/{q}": v for q, v in mine.items()})
                b.update({f"{rec['seed']}/{q}": v for q, v in theirs.items()})
            if a and b:
                r = paired_test(a, b)
                rows.append({"system": system, "metric": metric, "this": sum(a.values()) / len(a),
                             "baseline": sum(b.values()) / len(b), "delta": r.delta, "p": r.p_value, "n": r.n})

    def mean_seconds(recs: list[dict], stage: str | None) -> float | None:
        vals = [r.get("wall_seconds") if stage is None else (r.get("stage_seconds") or {}).get(stage) for r in recs]
        vals = [v for v in vals if v is not None]
        return sum(vals) / len(vals) if vals else None

    times = [{"stage": st, "this": mean_seconds([r for r, _ in pairs], st), "baseline": mean_seconds([o for _, o in pairs], st)}
             for st in (*STAGES, None)]
    return {"seeds": [r["seed"] for r, _ in pairs], "baseline_commits": sorted({o.get("commit") or "-" for _, o in pairs}),
            "rows": rows, "seconds": times}


def against_markdown(res: dict) -> list[str]:
    """The --against section: this recipe minus the baseline per system, and the stage times side by side."""
    lines = ["", f"Against the baseline ({', '.join(res['baseline_commits'])}; seeds {', '.join(map(str, res['seeds']))}): "
             "this - baseline, paired over every (seed, query) pair:", "",
             "| System | Metric | This | Baseline | Delta | p | n |", "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['system']} | {r['metric']} | {r['this']:.3f} | {r['baseline']:.3f} | {r['delta']:+.3f} | {r['p']:.4f} | {r['n']} |"
              for r in res["rows"]]
    lines += ["", "| Stage (mean seconds) | This | Baseline | This / baseline |", "|---|---:|---:|---:|"]
    for t in res["seconds"]:
        this, base = t["this"], t["baseline"]
        ratio = f"{this / base:.2f}" if this is not None and base else "-"
        lines.append(f"| {t['stage'] or '**pipeline (wall)**'} | {'-' if this is None else f'{this:.1f}'} | "
                     f"{'-' if base is None else f'{base:.1f}'} | {ratio} |")
    return lines


def markdown(res: dict) -> str:
    seeds = res["seeds"]
    names = sorted(seeds[0]["rows"], key=_row_key)
    lines = [f"Split: {seeds[0]['split']}; {len(seeds)} seeds. Mean over seeds (per-seed values in brackets).", "",
             "| Seed | Commit | CPU | Wall |", "|---|---|---|---:|",
             *(f"| {_seed_label(s, i)} | {_commit_cell(s)} | {s.get('cpu') or '-'} | {'-' if s.get('wall_seconds') is None else format_duration(s['wall_seconds'])} |" for i, s in enumerate(seeds)),
             "",
             "| System | nDCG@10 | R@20 | EM | F1 |", "|---|---:|---:|---:|---:|"]
    for name in names:
        cells = []
        for m in ROW_METRICS:
            vals = [s["rows"].get(name, {}).get(m) for s in seeds]
            vals = [v for v in vals if v is not None]
            cells.append(f"{sum(vals) / len(vals):.3f} ({', '.join(f'{v:.3f}' for v in vals)})" if vals else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    pooled_over = next((c["pooled"]["seeds"] for c in res["comparisons"] if c["pooled"]), None)
    over = (f"pooled over every (seed, query) pair of seeds {', '.join(map(str, pooled_over))}" if pooled_over else
            "no pooled test (fewer than two seeds kept their per-query scores)")
    lines += ["", f"Paired randomisation tests (delta = mean(A - B); two-sided p per seed, and {over}):", "",
              "| A | B | Metric | Delta per seed (p) | Pooled delta | Pooled p | n |", "|---|---|---|---|---:|---:|---:|"]
    for c in res["comparisons"]:
        per = "; ".join(f"{s['delta']:+.3f} ({s['p']:.4f})" for s in c["per_seed"])
        pooled = c["pooled"]
        tail = f"{pooled['delta']:+.3f} | {pooled['p']:.4f} | {pooled['n']}" if pooled else "- | - | -"
        lines.append(f"| {c['a']} | {c['b']} | {c['metric']} | {per} | {tail} |")
    lines += size_table(res)
    lines += ["", "Stage wall times (seconds; MLflow run start to end):", "",
              "| Stage | " + " | ".join(f"seed {_seed_label(s, i)}" for i, s in enumerate(seeds)) + " |", "|---|" + "---:|" * len(seeds)]
    for st in STAGES:
        lines.append(f"| {st} | " + " | ".join(str(s["stage_seconds"].get(st, "-")) for s in seeds) + " |")
    lines.append("| **pipeline (wall)** | " + " | ".join("-" if s["wall_seconds"] is None else str(s["wall_seconds"]) for s in seeds) + " |")
    if res.get("against"):
        lines += against_markdown(res["against"])
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--split", choices=["test", "dev"], default="test")
    ap.add_argument("--preset", default="small", help="small, or default (params.yaml as committed)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a param override for every seed's run (repeatable), as flows.pipeline --set")
    ap.add_argument("--name", help="the results' name: experiments/results/<name>_seeds[.json] (default: the preset)")
    ap.add_argument("--workdir", type=Path, help="where the clones go (default: /tmp/<name>_seeds)")
    ap.add_argument("--collect", type=Path, nargs="*", help="archives (seed<N>.json.gz) or finished workspaces: only build the tables")
    ap.add_argument("--upto", nargs="+", default=[], metavar="STAGE",
                    help="run only these stages and what they need (flows.pipeline --upto, once per stage), then evaluate what exists")
    ap.add_argument("--merge", type=Path, nargs=2, action="append", metavar=("BASE", "EXTRA"),
                    help="one seed's archive from two runs: BASE plus EXTRA's --take systems (repeatable, one per seed)")
    ap.add_argument("--take", nargs="+", default=["ft:realm*"], help="the systems --merge adds (globs)")
    ap.add_argument("--against", type=Path, nargs="+", metavar="BASELINE",
                    help="another recipe's archives (the same seeds and split): this minus it per system, paired, and the stage times")
    args = ap.parse_args()
    name = args.name or args.preset
    workdir = args.workdir or Path(f"/tmp/{name}_seeds")
    baselines = [load_seed(b) for b in args.against or []]
    if baselines and not (args.merge or args.collect):  # refuse before hours of runs, not after
        have = {(b.get("seed"), b.get("split")) for b in baselines}
        if missing := [s for s in args.seeds if (s, args.split) not in have]:
            ap.error(f"--against: the baseline archives have no {args.split}-split run of seed(s) {missing} (they have {sorted(have, key=str)})")
    if args.merge:
        sources = merge_archives([tuple(p) for p in args.merge], args.take, name)
    else:
        sources = args.collect or [archive(run_seed(s, args.split, workdir, args.preset, tuple(args.overrides), tuple(args.upto)), s, name)
                                   for s in args.seeds]
    records = [load_seed(src) for src in sources]  # once: a workspace's stage times come from its MLflow store
    res = collect(records)
    if baselines:
        res["against"] = against(records, baselines)
    write_text_atomic(str(RESULTS).format(name=name), json.dumps(res, indent=1))
    if any(p["kind"] == "fine-tuned" for p in res["label_efficiency"]):  # the curve over seeds (not a run without fine-tunes)
        write_plots(Path(str(ARCHIVE).format(name=name)), label_efficiency=res["label_efficiency"])
    print(markdown(res))


if __name__ == "__main__":
    main()
