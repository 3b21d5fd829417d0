"""RetroMAE's claim as the paper frames it, label efficiency: each start's fine-tuned bi-encoder
against the number of training questions it saw (one `finetune_retriever@<start>-<size>` stage per
point), the off-the-shelf reference as a flat line, and the paired tests at every size.

    points = curve_points(rows, params.finetune, n_train)   # [{dataset, start, size, questions, kind, ndcg_at_10, recall_at_20}]
    tests = size_tests(comparisons, params.finetune, n_train)  # [{dataset, size, questions, a, b, metric, delta, p_value, n}]

`questions` is the x axis: a size's number of training (question, positive) rows, what
`size_subset` hands the trainer. `all` is `n_train`, and a size above `n_train` trains on all of
them, so it is plotted there too. The tests are the ones `run_comparisons` ran on the per-query
files (`paper_comparisons`): at the largest size they are the single-size rows' `ft:retromae` vs
`ft:mlm` / `ft:init`. One workspace is one seed; experiments/small_seeds.py pools the same tests over seeds.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from components.eval.comparisons import RETRIEVAL_METRICS, ft_row

REFERENCE_PREFIX = "warm-start:"  # the off-the-shelf reference row (`warm_start.path` zero-shot), one per pooling mode
SIZE_BASELINES = ("mlm", "init")  # ft:retromae@N is tested against these starts at every size


def questions_at(size: int | str, n_train: int) -> int:
    """The training rows a size fine-tunes on (`size_subset`): `all` and any size above n_train -> n_train."""
    return n_train if size == "all" else min(int(size), n_train)


def sizes_in_order(ft) -> list[int | str]:
    """`finetune.train_sizes` from the fewest questions to the most (`all` last)."""
    return sorted(ft.train_sizes, key=lambda s: (s == "all", 0 if s == "all" else s))


def curve_points(rows: Sequence[Mapping], ft, n_train: int) -> list[dict]:
    """One point per (set, start, size) whose `ft:*` row exists, then the reference row of each set
    repeated at every size (a flat line), ordered by set, start and questions."""
    by_name = {(r["dataset"], r["system"]): r for r in rows if "ndcg_at_10" in r}
    sets = list(dict.fromkeys(r["dataset"] for r in rows))
    largest = ft.largest_size()
    points = []
    for ds in sets:
        starts = list(dict.fromkeys(name.split("@")[0][len("ft:"):] for d, name in by_name if d == ds and name.startswith("ft:")))
        refs = [name for d, name in by_name if d == ds and name.startswith(REFERENCE_PREFIX)]
        for start, kind, row_of in [*((s, "fine-tuned", lambda n, s=s: ft_row(s, n, largest)) for s in starts),
                                    *((ref, "reference", lambda n, ref=ref: ref) for ref in refs)]:
            for size in sizes_in_order(ft):
                row = by_name.get((ds, row_of(size)))
                if row is not None:
                    points.append({"dataset": ds, "start": start, "size": str(size), "questions": questions_at(size, n_train),
                                   "kind": kind, **{m: row.get(m) for m in RETRIEVAL_METRICS}})
    return points


def size_tests(comparisons: Sequence[Mapping], ft, n_train: int) -> list[dict]:
    """The paired tests `ft:retromae@N` vs `ft:<baseline>@N` at every size, from the fewest questions up."""
    largest = ft.largest_size()
    found = {(c["dataset"], c["a"], c["b"], c["metric"]): c for c in comparisons}
    sets = list(dict.fromkeys(c["dataset"] for c in comparisons))
    out = []
    for ds in sets:
        for size in sizes_in_order(ft):
            for base in SIZE_BASELINES:
                a, b = ft_row("retromae", size, largest), ft_row(base, size, largest)
                for metric in RETRIEVAL_METRICS:
                    c = found.get((ds, a, b, metric))
                    if c is not None:
                        out.append({"dataset": ds, "size": str(size), "questions": questions_at(size, n_train), "a": a, "b": b,
                                    "metric": metric, "delta": c["delta"], "p_value": c["p_value"], "n": c["n"]})
    return out
