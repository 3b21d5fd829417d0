"""Paired significance over queries: is system A's mean per-query score really different from B's?

    from components.eval.significance import paired_test
    r = paired_test(per_query_a, per_query_b)       # {qid: score} each, e.g. nDCG@10 per query
    r.delta, r.p_value, r.n                          # mean(A - B) over the shared queries, two-sided p

The test is a paired randomisation (sign-flip) test, the one `ranx.compare` and TREC practice use
for IR metrics: under the null hypothesis A and B are exchangeable on every query, so each per-query
difference keeps its size but its sign is a coin flip. The p-value is the share of flips whose mean
difference is at least as extreme as the observed one (two-sided, with the observed assignment
counted, so p is never 0). With n <= `exact_max_n` queries every one of the 2^n flips is enumerated;
above, `n_resamples` random flips from a fixed seed, so the same scores always give the same p.
Only queries that both systems scored are compared: a paired test of unpaired queries is not one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping

import numpy as np


@dataclass(frozen=True)
class PairedResult:
    delta: float     # mean over shared queries of (A - B)
    p_value: float   # two-sided
    n: int           # queries compared

    def as_dict(self) -> dict:
        return {"delta": self.delta, "p_value": self.p_value, "n": self.n}


def _differences(a: Mapping[str, float], b: Mapping[str, float]) -> np.ndarray:
    shared = sorted(set(a) & set(b))
    return np.array([float(a[q]) - float(b[q]) for q in shared], dtype=np.float64)  # (n,)


def paired_test(a: Mapping[str, float], b: Mapping[str, float], *, n_resamples: int = 10_000,
                seed: int = 0, exact_max_n: int = 16) -> PairedResult:
    """Two-sided paired randomisation test of mean(A - B) = 0 over the queries both score."""
    d = _differences(a, b)
    n = len(d)
    if n == 0:
        return PairedResult(delta=float("nan"), p_value=float("nan"), n=0)
    observed = abs(d.mean())
    tol = 1e-12 * max(1.0, float(np.abs(d).max()))  # flips equal to the observed one count as extreme
    if n <= exact_max_n:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))      # (2^n, n)
        means = np.abs(signs @ d) / n                                          # (2^n,)
        p = float(np.mean(means >= observed - tol))
    else:
        rng = np.random.default_rng(seed)
        signs = rng.choice((1.0, -1.0), size=(n_resamples, n))                 # (R, n)
        means = np.abs(signs @ d) / n                                          # (R,)
        p = float((np.sum(means >= observed - tol) + 1) / (n_resamples + 1))
    return PairedResult(delta=float(d.mean()), p_value=min(1.0, p), n=n)


def pooled_by_run(runs: Mapping[object, Mapping[str, float]]) -> dict[str, float]:
    """Per-run `{qid: value}` maps (one per seed or workspace) as one map over (run, qid) pairs, keyed
    `<run>/<qid>`: a query id is unique within one run only, so the same question in two runs is two pairs.
    Pool both sides of a paired test with the same run labels."""
    return {f"{r}/{q}": v for r, scores in runs.items() for q, v in scores.items()}


def per_query_metric(per_query: Mapping[str, Mapping[str, float]], metric: str) -> dict[str, float]:
    """`{qid: {metric: value}}` (as `retrieval_metrics`/`qa_metrics` return) -> `{qid: value}`."""
    return {q: float(v[metric]) for q, v in per_query.items() if metric in v}
