"""realm.span_min_other_blocks / span_max_other_blocks (issue 28 item 3): mask only the salient spans
that 1..N other blocks of the corpus hold and that x does not show elsewhere, on a hand-built corpus
whose span counts are known; off (null, null) masks any span, as before."""

from __future__ import annotations

import re

import numpy as np
import pytest

from components.config import load_params
from components.config_file import ParamsError
from components.config_stages import RealmParams
from components.data import realm_query as rq
from components.data.special_tokens import SpecialTokens
from tests.conftest import ROOT

MASK = 1
# Each block's salient spans are marked by the source (char_spans), as the synthetic world marks its
# own, so the counts below do not depend on a tagger: Alpha is in b0 only, Gamma in b0 and b2, Beta in
# b0, b1 and b2, Delta in b3 only, and b4 / b5 write Gamma twice.
CORPUS = {
    "b0": ("Alpha met Beta in Gamma .", ["Alpha", "Beta", "Gamma"]),
    "b1": ("Beta lives here .", ["Beta"]),
    "b2": ("Gamma and Beta talk .", ["Gamma", "Beta"]),
    "b3": ("Delta is alone .", ["Delta"]),
    "b4": ("Gamma saw Gamma .", ["Gamma", "Gamma"]),
    "b5": ("Gamma ran far . Then Gamma slept .", ["Gamma", "Gamma"]),
}
VOCAB: dict[str, int] = {}


def _row(block_id: str) -> dict:
    text, names = CORPUS[block_id]
    words = list(re.finditer(r"\S+", text))
    spans, at = [], 0
    for name in names:
        s = text.index(name, at)
        spans.append([s, s + len(name)])
        at = s + len(name)
    return {"input_ids": [VOCAB.setdefault(m.group(), 10 + len(VOCAB)) for m in words], "word_ids": list(range(len(words))),
            "offsets": [[m.start(), m.end()] for m in words], "char_spans": spans, "text": text, "block_id": block_id}


@pytest.fixture(scope="module")
def blocks():
    import datasets

    rows = [_row(b) for b in CORPUS]
    return datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in rows[0]})


def _params(lo=None, hi=None, **kw) -> RealmParams:
    return RealmParams(query_len=32, max_masks=4, exclude_spans_in_query=False, span_min_other_blocks=lo,
                       span_max_other_blocks=hi, **{"span_tagger": "regex", **kw})  # the corpus marks its own spans


def _masked(row: dict, p: RealmParams, counts, seeds: int = 40) -> set[str]:
    """The words masked over `seeds` draws ("" when make_query gives None)."""
    out = set()
    for seed in range(seeds):
        q = rq.make_query(row, p, np.random.default_rng(seed), mask_token_id=MASK, row=0, span_blocks=counts)
        out.add("" if q is None else " ".join(_words(rq.masked_answer(q))))
    return out


def _words(ids) -> list[str]:
    word = {v: k for k, v in VOCAB.items()}
    return [word[t] for t in ids]


def test_span_counts_are_the_blocks_that_hold_each_span(blocks):
    counts = rq.span_block_counts(blocks, _params(lo=1))
    assert {" ".join(_words(sp)): n for sp, n in counts.items()} == {"Alpha": 1, "Beta": 3, "Gamma": 4, "Delta": 1}
    assert rq.span_block_counts(blocks, _params()) is None  # off: no pass over the corpus


def test_only_spans_in_1_to_n_other_blocks_are_masked(blocks):
    row = blocks[0]  # Alpha is in 0 other blocks, Beta in 2, Gamma in 3
    off = _params()
    assert _masked(row, off, None) == {"Alpha", "Beta", "Gamma"}  # the paper's: any span
    assert _masked(row, _params(lo=1), rq.span_block_counts(blocks, _params(lo=1))) == {"Beta", "Gamma"}
    assert _masked(row, _params(lo=1, hi=2), rq.span_block_counts(blocks, _params(lo=1, hi=2))) == {"Beta"}
    assert _masked(row, _params(hi=0), rq.span_block_counts(blocks, _params(hi=0))) == {"Alpha"}
    assert _masked(blocks[3], _params(lo=1), rq.span_block_counts(blocks, _params(lo=1))) == {""}  # Delta: nowhere else


def test_a_span_x_shows_elsewhere_is_not_masked(blocks):
    p = _params(lo=1)
    counts = rq.span_block_counts(blocks, p)
    assert _masked(blocks[4], p, counts) == {""}  # x = "Gamma saw Gamma": the answer stands in x
    assert _masked(blocks[4], _params(), None) == {"Gamma"}  # off: masked all the same
    # x = the span's sentence: each Gamma is alone in its sentence, so it may be masked there
    assert _masked(blocks[5], p, counts) == {""}
    assert _masked(blocks[5], _params(lo=1, query_unit="sentence"), counts) == {"Gamma"}


def test_eligible_rows_and_fixed_queries_apply_the_filter(blocks):
    p = _params(lo=1, hi=2)
    assert rq.eligible_rows(blocks, p, MASK, seed=0) == [0, 1, 2]  # Beta; Delta (0 others) and Gamma (3 others) drop
    assert rq.eligible_rows(blocks, _params(), MASK, seed=0) == [0, 1, 2, 3, 4, 5]
    answers = {" ".join(_words(rq.masked_answer(q)))
               for q in rq.fixed_queries(blocks, [0, 1, 2], p, SpecialTokens(pad=0, cls=2, sep=3, mask=MASK), 0, draws=8)}
    assert answers == {"Beta"}


def test_the_filter_needs_the_counts_and_a_sane_range():
    with pytest.raises(ValueError, match="span_block_counts"):
        rq.make_query(_row("b0"), _params(lo=1), np.random.default_rng(0), mask_token_id=MASK)
    with pytest.raises(ParamsError, match="span_min_other_blocks=3"):
        load_params(ROOT / "params.yaml", overrides={"realm.span_min_other_blocks": 3, "realm.span_max_other_blocks": 1})


def test_the_collator_redraws_a_row_that_drew_no_query_and_keeps_every_other_draw(blocks):
    """With the filter, whether x shows the answer twice depends on the window drawn: b5 ("Gamma ran far .
    Then Gamma slept .") in 6-token windows draws no query 28% of the time. The collator draws such a row
    again from its own stream, so a micro-batch of one such row is never empty, and the rows whose first
    draw gave a query keep exactly that query (the committed recipe's draws are unchanged)."""
    import torch

    from components.data.realm_batch import RealmCollator
    from components.data.realm_query import QUERY_REDRAWS
    from components.training.warmups import ReaderWarmupCollator

    p = _params(lo=1).model_copy(update={"query_len": 8})
    special = SpecialTokens(pad=0, cls=2, sep=3, mask=MASK)
    collator = RealmCollator(blocks, p, special, retriever=None, search=None)
    rows, first_none = [0, 5, 2], 0
    for seed in range(60):
        rng = np.random.default_rng(seed)
        direct = [rq.make_query(blocks[r], p, rng, mask_token_id=MASK, row=r, span_blocks=collator.span_blocks) for r in rows]
        got = collator.queries(rows, np.random.default_rng(seed), seed)
        assert [q.source_row for q in got] == rows  # every row gives one
        for d, g in zip(direct, got):
            first_none += d is None
            assert d is None or (d.input_ids, d.labels, d.masked) == (g.input_ids, g.labels, g.masked)
        again = collator.queries(rows, np.random.default_rng(seed), seed)
        assert [(q.input_ids, q.labels) for q in again] == [(q.input_ids, q.labels) for q in got]  # a resume draws the same
    assert first_none > 5  # the redraw was exercised, not only the first draws

    # the reader warm-up draws its queries the same way
    warmup = ReaderWarmupCollator(blocks, p.model_copy(update={"reader_warmup_doc_len": 0}), special)
    for seed in range(20):
        assert [q.source_row for q, _ in warmup.examples([5, 5], np.random.default_rng(seed), seed)] == [5, 5]

    # a block that can never give a query (Delta: no other block holds it) leaves the micro-batch empty:
    # a clear error naming the knobs, not a reshape error deep in the model
    for collate, phase in ((collator, "realm.train"), (warmup, "realm.reader_warmup")):
        with pytest.raises(RuntimeError, match=rf"blocks \[3\] gave no masked query in {1 + QUERY_REDRAWS} draws each, so "
                                               rf"this micro-batch of {re.escape(phase)} is empty.*realm\.train\.grad_accum"):
            collate([3], torch.Generator().manual_seed(0))


def test_span_holders_counts_the_other_blocks_of_every_block_span_pair(blocks):
    """The diagnostic's corpus part (`--spans`), on the hand-built counts: 9 (block, span) pairs, Alpha and
    Delta held nowhere else, each Beta by 2 other blocks, each Gamma by 3; with titles, the share of those
    holders in the block's own article."""
    from components.eval.realm_diagnostics import span_holders

    got = span_holders(blocks, _params(lo=1, hi=2), bins=((0, 0), (1, 2), (3, None)))
    assert (got["blocks"], got["blocks_with_a_span"], got["pairs"], got["distinct_spans"]) == (6, 6, 9, 4)
    assert got["other_blocks"] == pytest.approx({"0": 2 / 9, "1-2": 3 / 9, "3+": 4 / 9})
    assert "same_article_share_of_holders" not in got  # no titles
    assert got["admitted"] == {"filter": "1-2 other blocks", "pairs": pytest.approx(3 / 9), "blocks_with_an_admitted_span": 3}
    assert span_holders(blocks, _params(), bins=((0, 0),))["admitted"]["filter"] == "0+ other blocks"  # off: every pair
    titled = blocks.add_column("title", ["A", "A", "A", "B", "B", "B"])
    same = span_holders(titled, _params(lo=1), bins=((0, 0), (1, 2), (3, None)))["same_article_share_of_holders"]
    assert same == pytest.approx({"1-2": 1.0, "3+": 1 / 3})  # Beta: b0-b2 all A; each Gamma: one of its 3 others shares its title
