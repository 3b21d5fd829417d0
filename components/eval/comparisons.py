"""The comparisons the papers make, each a paired randomisation test over per-query scores.

    comps = paper_comparisons(realm_start="retromae")
    results = run_comparisons(METRICS / "eval", "main", comps)    # reads metrics/eval/main/<system>.jsonl
    results[0]  # {"dataset", "a", "b", "metric", "delta", "p_value", "n", "question"}

Every number comes from the per-query files evaluate writes (`per_query_path`): a row's mean and
its comparison's p-value are computed from the same scores. `delta` = mean(A - B) over the queries
both systems scored; `p_value` two-sided (`significance.paired_test`). A comparison whose system
did not run (its model is missing) or whose file lacks the metric is left out, never faked.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from components.eval.significance import paired_test, per_query_metric

RETRIEVAL_METRICS = ("ndcg_at_10", "recall_at_20")
QA_METRICS = ("em", "f1")


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    metrics: tuple[str, ...]
    question: str  # what the comparison asks, in the papers' terms


def ft_row(start: str, size: int | str, largest: int | str) -> str:
    """The eval row of `finetune_retriever@<start>-<size>`: `ft:<start>` at the largest size, else `ft:<start>@<size>`."""
    return f"ft:{start}" if str(size) == str(largest) else f"ft:{start}@{size}"


def paper_comparisons(realm_start: str | None = "retromae", smaller_sizes: Sequence[int | str] = ()) -> list[Comparison]:
    """RetroMAE's and REALM's claims as (A, B) pairs. `realm_start`: the zero-shot row REALM's
    retriever started from (its `realm.retriever_init`; None when it started from random towers,
    which no row holds). `smaller_sizes`: the `finetune.train_sizes` below the largest, whose
    `ft:<start>@<size>` rows RetroMAE's label-efficiency claim compares (against `ft:mlm@<size>` and `ft:init@<size>`)."""
    r = RETRIEVAL_METRICS
    comps = [
        Comparison("ft:retromae", "ft:mlm", r, "RetroMAE: a better retriever than MLM after the same fine-tuning"),
        *(c for n in smaller_sizes for c in (
            Comparison(f"ft:retromae@{n}", f"ft:mlm@{n}", r, f"RetroMAE vs MLM after fine-tuning on {n} questions"),
            Comparison(f"ft:retromae@{n}", f"ft:init@{n}", r, f"RetroMAE vs no pre-training after fine-tuning on {n} questions"))),
        Comparison("ft:retromae", "ft:init", r, "RetroMAE: pre-training helps the fine-tuned retriever"),
        Comparison("retromae", "mlm", r, "RetroMAE's mechanism: the [CLS] bottleneck, zero-shot"),
        Comparison("retromae", "init", r, "RetroMAE zero-shot against its starting point"),
        Comparison("realm", "realm-stale", r, "REALM: refreshing the index matters (two runs, each with its own index)"),
    ]
    if realm_start is not None:
        comps.append(Comparison("realm", realm_start, r, f"REALM's retriever after pre-training vs its start ({realm_start})"))
        comps.append(Comparison("ict", realm_start, r, f"ICT, REALM's warm start of its retriever, vs the towers it trained ({realm_start})"))  # when ICT ran
    comps.append(Comparison("realm", "ict", r, "REALM's own increment: vs the ICT-only retriever it started from"))  # when ICT ran
    comps += [
        Comparison("qa:realm", "qa:closed-book", QA_METRICS, "REALM: retrieval helps open QA"),
        Comparison("qa:realm", "qa:realm-stale", QA_METRICS, "REALM: the refreshed index helps open QA"),
        Comparison("qa:realm", "qa:bm25", QA_METRICS, "REALM's retriever vs BM25, same reader recipe"),
    ]
    return comps


def per_query_path(out_dir: str | os.PathLike, dataset: str, system: str) -> Path:
    """metrics/eval/<set>/<system>.jsonl; `:` (ft:init, qa:bm25) becomes `_`, a portable file name."""
    return Path(out_dir) / dataset / f"{system.replace(':', '_')}.jsonl"


def read_per_query(path: str | os.PathLike) -> dict[str, dict[str, float]]:
    """A per-query file -> {qid: {metric: value}} (numeric fields only; `qid` or `id` names the query)."""
    out: dict[str, dict[str, float]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            qid = str(row.get("qid", row.get("id")))
            out[qid] = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return out


def run_comparisons(out_dir: str | os.PathLike, dataset: str, comparisons: Sequence[Comparison]) -> list[dict]:
    results = []
    for c in comparisons:
        pa, pb = per_query_path(out_dir, dataset, c.a), per_query_path(out_dir, dataset, c.b)
        if not (pa.exists() and pb.exists()):
            continue
        qa, qb = read_per_query(pa), read_per_query(pb)
        for metric in c.metrics:
            a, b = per_query_metric(qa, metric), per_query_metric(qb, metric)
            if not a or not b:
                continue
            r = paired_test(a, b)
            results.append({"dataset": dataset, "a": c.a, "b": c.b, "metric": metric, **r.as_dict(), "question": c.question})
    return results
