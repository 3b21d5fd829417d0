"""The paired test is computed from per-query scores: exact enumeration against its definition,
the Monte-Carlo path against the exact one, and pairing by query id."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from components.eval.significance import paired_test, per_query_metric


def _reference_p(d: list[float]) -> float:
    """Slow reference: loop over every sign assignment."""
    obs = abs(sum(d) / len(d))
    hits = 0
    for signs in itertools.product((1, -1), repeat=len(d)):
        if abs(sum(s * x for s, x in zip(signs, d)) / len(d)) >= obs - 1e-12:
            hits += 1
    return hits / 2 ** len(d)


def test_exact_path_matches_the_definition():
    rng = np.random.default_rng(3)
    for _ in range(5):
        a = {f"q{i}": float(x) for i, x in enumerate(rng.random(9))}
        b = {f"q{i}": float(x) for i, x in enumerate(rng.random(9))}
        r = paired_test(a, b)
        d = [a[q] - b[q] for q in sorted(a)]
        assert r.n == 9
        assert r.delta == pytest.approx(np.mean(d))
        assert r.p_value == pytest.approx(_reference_p(d))


def test_monte_carlo_path_agrees_with_exact_enumeration():
    rng = np.random.default_rng(4)
    a = {f"q{i}": float(x) for i, x in enumerate(rng.random(14))}
    b = {f"q{i}": float(x) + 0.15 for i, x in enumerate(rng.random(14))}
    exact = paired_test(a, b, exact_max_n=14).p_value
    mc = paired_test(a, b, exact_max_n=0, n_resamples=20_000, seed=1).p_value
    assert mc == pytest.approx(exact, abs=0.01)
    assert paired_test(a, b, exact_max_n=0, seed=1).p_value == paired_test(a, b, exact_max_n=0, seed=1).p_value


def test_identical_systems_are_not_different_and_a_consistent_gain_is():
    a = {f"q{i}": i / 40 for i in range(40)}
    assert paired_test(a, dict(a)).p_value == 1.0
    better = {q: v + 0.05 for q, v in a.items()}
    r = paired_test(better, a)
    assert r.delta == pytest.approx(0.05)
    assert r.p_value < 1e-3
    assert paired_test(a, better).delta == pytest.approx(-0.05)


def test_pairs_by_query_id_and_ignores_unshared_queries():
    a = {"q1": 1.0, "q2": 0.0, "q3": 1.0}
    b = {"q3": 0.0, "q2": 0.0, "q9": 1.0}
    r = paired_test(a, b)
    assert r.n == 2 and r.delta == pytest.approx(0.5)
    assert np.isnan(paired_test({"a": 1.0}, {"b": 1.0}).p_value)


def test_per_query_metric_reads_the_metrics_layout():
    pq = {"q1": {"ndcg_at_10": 0.5, "recall_at_5": 1.0}, "q2": {"ndcg_at_10": 0.0}}
    assert per_query_metric(pq, "recall_at_5") == {"q1": 1.0}
    assert per_query_metric(pq, "ndcg_at_10") == {"q1": 0.5, "q2": 0.0}


def test_pooled_by_run_keeps_the_same_question_of_two_runs_apart():
    from components.eval.significance import pooled_by_run

    a = pooled_by_run({0: {"q1": 1.0, "q2": 0.0}, 1: {"q1": 0.0}})
    b = pooled_by_run({0: {"q1": 0.0, "q2": 0.0}, 1: {"q1": 0.0}})
    assert a == {"0/q1": 1.0, "0/q2": 0.0, "1/q1": 0.0}
    r = paired_test(a, b)
    assert r.n == 3 and r.delta == pytest.approx(1 / 3)
