"""The headline numbers that `dvc metrics show` / `dvc exp show` print: one small JSON per row.

    metrics/headline/<system>.json      {set: {"nDCG@10", "R@100"}} or {set: {"EM"}} (qa:* rows)
    metrics/headline/<stage>.json       a few training figures: final loss, REALM's held-out recall
                                        and index staleness

DVC prints one row per metrics file and one column per key, so a file per system keeps the table
a few columns wide (it fits a 120-column terminal) where one file of every system's numbers would be
one row of hundreds of columns. The detailed numbers stay in metrics/eval.json, metrics/eval/ and
MLflow.
"""

from __future__ import annotations

import json
from pathlib import Path

from components.io import atomic_dir, write_json_atomic

# stage summary (metrics/<stage>.json) key -> headline column
TRAINING = {
    "pretrain_retromae": {"final_loss": "loss"},
    "pretrain_mlm": {"final_loss": "loss"},
    "pretrain_realm": {"final_loss": "loss", "heldout_entity_recall_at_k": "recall", "mean_staleness": "stale"},
}
DIGITS = 3


def _r(v: float) -> float:
    return round(float(v), DIGITS)


def headline_rows(table: dict[str, dict[str, dict]], recall_k: int) -> dict[str, dict]:
    """{file stem: {set: {column: value}}} from eval.json's {set: {system: metrics}}."""
    out: dict[str, dict] = {}
    for set_name, systems in table.items():
        if not isinstance(systems, dict):
            continue
        for system, m in systems.items():
            if not isinstance(m, dict):
                continue
            if "em" in m:
                cols = {"EM": _r(m["em"])}
            elif "ndcg_at_10" in m:
                cols = {"nDCG@10": _r(m["ndcg_at_10"])}
                if f"recall_at_{recall_k}" in m:
                    cols[f"R@{recall_k}"] = _r(m[f"recall_at_{recall_k}"])
            else:
                continue
            out.setdefault(system.replace(":", "_"), {})[set_name] = cols
    return out


def training_rows(metrics_dir: Path) -> dict[str, dict]:
    out = {}
    for stage, keys in TRAINING.items():
        f = metrics_dir / f"{stage}.json"
        if not f.is_file():
            continue
        summary = json.loads(f.read_text())
        row = {col: _r(summary[k]) for k, col in keys.items() if isinstance(summary.get(k), (int, float))}
        if row:
            out[stage] = row
    return out


def write_headline(out_dir: str | Path, table: dict, recall_at: list[int], metrics_dir: str | Path) -> list[Path]:
    """Write metrics/headline/ afresh (a system dropped from the run leaves no stale row)."""
    out_dir = Path(out_dir)
    k = 100 if 100 in recall_at else max(recall_at)
    rows = {**headline_rows(table, k), **training_rows(Path(metrics_dir))}
    with atomic_dir(out_dir) as tmp:  # swapped in whole: a crash keeps the previous headline, never half of one
        for name, row in rows.items():
            write_json_atomic(tmp / f"{name}.json", row)
    return [out_dir / f"{name}.json" for name in rows]
