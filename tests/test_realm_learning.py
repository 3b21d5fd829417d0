"""REALM learns to retrieve through the marginal likelihood alone, and only with a fresh index.

`bench/realm_toy.py`'s key -> value world (the answer to a masked query is in exactly one document),
run with the real `REALM` model and FAISS `BlockIndex`: a briefly ICT-warmed retriever, a reader
that already reads (warm-up with the gold document among its candidates; the retriever untouched),
then REALM steps. Refreshing the index every 10 steps must take the retriever near perfect recall;
never refreshing must leave the stale index useless (the paper's stale-index ablation direction).
"""

import pytest

from bench.realm_toy import build_parser, run_arm

pytestmark = pytest.mark.slow  # reason: ~400 tiny REALM steps per arm, ~30-60 s on 2 cores


def test_refreshed_retriever_learns_to_find_the_answer_document_and_a_stale_index_does_not():
    args = build_parser().parse_args(["--steps", "100", "--eval-every", "50"])
    refreshed, never = run_arm(args, refresh_every=10), run_arm(args, refresh_every=0)
    start = refreshed["curve"][0]["recall_index_in_use"]
    assert 0.1 < start < 0.8  # the ICT warm-up leaves room to learn (chance is 7/512 = 0.014)
    assert never["curve"][0]["recall_index_in_use"] == start  # same seed, same start
    end_fresh, end_stale = refreshed["curve"][-1], never["curve"][-1]
    assert end_fresh["recall_index_in_use"] > 0.9 and end_fresh["p_null"] < 0.1, refreshed["curve"]
    assert end_stale["recall_index_in_use"] < start / 2, never["curve"]  # the stale index drifts out of step
    # without useful candidates the model falls back to the null document: closed-book memorisation
    assert end_stale["p_null"] > 0.5, never["curve"]
