"""REALM's stale-index ablation on the tiny synthetic world: refresh every `realm.refresh_every` steps
vs never (`refresh_every: 0`), same seed, steps and everything else. Method and what each number
means: docs/experiments/realm_refresh_ablation.md; the latest results: docs/results.md.

    .venv/bin/python -m flows.pipeline --preset tiny --upto pretrain_retromae   # once: data/tokens + models/retromae
    .venv/bin/python -m experiments.realm_refresh_ablation  # ~2 x the stage's time; writes experiments/results/realm_ablation.json
    .venv/bin/python -m experiments.realm_refresh_ablation --workspace /path/with/data_and_models --set realm.train.max_steps=80
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "realm_ablation.json"

# what the table reports per arm, from the stage summary
KEYS = ["step", "eval_mlm_acc_start", "eval_mlm_acc", "eval_mlm_acc_train_index", "mlm_acc",
        "heldout_n", "heldout_recall_at_k_start", "heldout_recall_at_k", "heldout_recall_at_k_train_index",
        "heldout_mean_rank_start", "heldout_mean_rank",
        "heldout_entity_n", "heldout_entity_recall_at_k_start", "heldout_entity_recall_at_k", "heldout_entity_recall_at_k_train_index",
        "heldout_entity_mean_rank_start", "heldout_entity_mean_rank",
        "probe_set", "probe_n", "recall_at_k_start", "recall_at_k", "recall_at_k_train_index", "mean_rank", "mean_rank_train_index",
        "refreshes", "mean_staleness", "staleness_curve", "heldout_recall_curve", "heldout_entity_recall_curve", "probe_recall_curve",
        "train_seconds"]
# per-refresh curves from plots/realm_refresh.csv: name -> column
CURVES = {"heldout_recall_curve": "heldout_recall_at_k", "heldout_entity_recall_curve": "heldout_entity_recall_at_k",
          "probe_recall_curve": "recall_at_k"}


def run_arm(params, workspace: Path) -> dict:
    """train_realm in a fresh temp folder linked to the workspace's inputs; returns its summary."""
    from components.stages.pretrain_realm import train_realm

    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="realm_ablation_") as tmp:
        tmp = Path(tmp)
        (tmp / "models").mkdir()
        os.symlink(workspace / "data", tmp / "data")
        os.symlink(workspace / "models" / "retromae", tmp / "models" / "retromae")
        os.chdir(tmp)
        try:
            t0 = time.perf_counter()
            summary = train_realm(params, None)
            summary["wall_s"] = round(time.perf_counter() - t0, 1)
            rows = [r for r in _csv_rows(tmp / "plots" / "realm_refresh.csv")]
            for name, column in CURVES.items():
                summary[name] = [(int(r["step"]), _num(r[column])) for r in rows]
            summary["staleness_curve"] = [(int(r["step"]), _num(r["staleness"])) for r in rows if r["staleness"]]
        finally:
            os.chdir(cwd)
    return summary


def _csv_rows(path: Path) -> list[dict]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(s: str) -> float | None:
    return round(float(s), 4) if s not in ("", None) else None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workspace", type=Path, default=Path.cwd(), help="folder with data/tokens, data/corpus, models/retromae")
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--preset", type=Path, default=ROOT / "params" / "tiny.yaml",
                    help="preset merged over --params (the tiny synthetic world); '' for none")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="param override (both arms)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--arm", choices=["both", "refreshed", "never"], default="both", help="run one arm only (exploring)")
    args = ap.parse_args(argv)

    import logging

    from components.config import load_params
    from components.config_file import parse_overrides
    from components.io import write_json_atomic

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ws = args.workspace.resolve()
    for need in ("data/tokens/blocks", "models/retromae/encoder"):
        if not (ws / need).exists():
            sys.exit(f"{ws / need} missing: run `.venv/bin/python -m flows.pipeline --preset tiny --upto pretrain_retromae` there first (or pass --workspace)")
    overrides = parse_overrides(args.set)
    presets = [args.preset] if str(args.preset) not in ("", ".") else []
    # sync: each refresh lands at its own step boundary, so the two arms differ only in the cadence
    base = {**overrides, "realm.refresh_mode": "sync"}
    cadence = load_params(args.params, presets=presets, overrides=base).realm.refresh_every
    if cadence == 0:
        sys.exit("realm.refresh_every is 0 in the params: nothing to compare against never refreshing")
    refreshed, never = (f"refresh_every_{cadence}", base), ("never_refresh", {**base, "realm.refresh_every": 0})
    arms = dict({"both": [refreshed, never], "refreshed": [refreshed], "never": [never]}[args.arm])
    results = {}
    for name, ov in arms.items():
        params = load_params(args.params, presets=presets, overrides=ov)
        s = run_arm(params, ws)
        results[name] = {"refresh_every": params.realm.refresh_every, **{k: s.get(k) for k in KEYS}, "wall_s": s["wall_s"]}
    p = load_params(args.params, presets=presets, overrides=base)
    out = {"k": p.realm.staleness_k, "seed": p.compute.seed, "max_steps": p.realm.train.max_steps,
           "retriever_init": p.realm.retriever_init, "lr": p.realm.train.lr, "overrides": overrides, "arms": results}
    write_json_atomic(args.out, out, sort_keys=False)
    from components.index.realm_refresh import format_metric as _fmt  # as the stage's own log lines

    k = out["k"]
    for name, r in results.items():
        print(f"{name} ({r['wall_s']} s): mean staleness {_fmt(r['mean_staleness'])}, masked-token acc {_fmt(r['mlm_acc'])} "
              f"(training), {_fmt(r['eval_mlm_acc_start'])} -> {_fmt(r['eval_mlm_acc'])} (held-out)")
        for label, key in (("held-out masked, same-entity gold", "heldout_entity_recall_at_k"),
                           ("held-out masked, any block with the answer", "heldout_recall_at_k"), (r["probe_set"], "recall_at_k")):
            print(f"  {label} recall@{k}: {_fmt(r[key + '_start'])} -> {_fmt(r[key])} (fresh index), "
                  f"{_fmt(r[key + '_train_index'])} (index in use)")
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
