"""Salient spans (regex tagger, char -> token mapping) and REALM query masking (make_query)."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer

from components.config_stages import RealmParams
from components.data.realm_query import make_query
from components.data.salient_spans import find_salient_spans
from components.data.token_spans import char_spans_to_token_spans, salient_token_spans
from components.data.special_tokens import IGNORE_INDEX
from components.data.tokenize import train_wordpiece

TEXTS = [
    "On 12 March 1875 Zorvan Teluk crossed the New Ardel River with 1,200 soldiers.",
    "The expedition lasted 3.5 years and ended in 1879 near the village of Kessa.",
    "Zorvan Teluk later founded the Ardel Trading Company, which employed 42 clerks.",
    "the quick brown fox jumps over the lazy dog while nobody watches the river.",
    "In March 1880 the company built a bridge across the river at Kessa.",
]


@pytest.fixture(scope="module")
def wordpiece() -> Tokenizer:
    """The tokenize stage's tiny WordPiece trainer, as a bare `tokenizers.Tokenizer` with no
    [CLS]/[SEP] template (blocks are stored without specials)."""
    tok = train_wordpiece(TEXTS * 3, vocab_size=150, min_frequency=1).backend_tokenizer
    tok.post_processor = None
    return tok


def block_row(tok: Tokenizer, text: str, char_spans=None, row: int = 7) -> dict:
    enc = tok.encode(text)
    return {"block_id": f"b{row}", "row": row, "text": text, "input_ids": enc.ids,
            "word_ids": enc.word_ids, "offsets": [list(o) for o in enc.offsets],
            "char_spans": [] if char_spans is None else char_spans}


def surface(text: str, spans) -> list[tuple[str, str]]:
    return [(text[s:e], label) for s, e, label in spans]


# ----------------------------------------------------------------------------------------------
# regex tagger
# ----------------------------------------------------------------------------------------------
def test_regex_tagger_dates_numbers_names():
    text = TEXTS[0]
    got = surface(text, find_salient_spans(text, "regex"))
    assert got == [("12 March 1875", "DATE"), ("Zorvan Teluk", "ENTITY"),
                   ("New Ardel River", "ENTITY"), ("1,200", "NUMBER")]


@pytest.mark.parametrize("text, expected", [
    ("The expedition lasted 3.5 years and ended in 1879 near Kessa.",
     [("3.5", "NUMBER"), ("1879", "DATE"), ("Kessa", "ENTITY")]),
    ("He signed it on March 4, 1881 in the Bank of England.",
     [("March 4, 1881", "DATE"), ("Bank of England", "ENTITY")]),
    ("In March 1880 the company moved.", [("March 1880", "DATE")]),
    # a multi-word name may open a sentence; a single capitalised word there is just the sentence start
    ("Zorvan Teluk was born in 2001.", [("Zorvan Teluk", "ENTITY"), ("2001", "DATE")]),
    ("Zorvan founded it. Later Kessa grew.", [("Kessa", "ENTITY")]),
    ("The New Ardel River floods.", [("New Ardel River", "ENTITY")]),
    ("It cost 12,500.75 coins, or 7%.", [("12,500.75", "NUMBER"), ("7%", "NUMBER")]),
])
def test_regex_tagger_examples(text, expected):
    assert surface(text, find_salient_spans(text, "regex")) == expected


def test_regex_tagger_ignores_lowercase_words():
    assert find_salient_spans(TEXTS[3], "regex") == []
    assert find_salient_spans("", "regex") == []


def test_spans_are_sorted_and_disjoint():
    spans = find_salient_spans(" ".join(TEXTS), "regex")
    assert spans == sorted(spans)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


# ----------------------------------------------------------------------------------------------
# char -> token spans
# ----------------------------------------------------------------------------------------------
def test_char_to_token_spans_hand_made_offsets():
    # "zorvan teluk crossed": zor ##van tel ##uk cross ##ed
    offsets = [(0, 3), (3, 6), (7, 10), (10, 12), (13, 18), (18, 20)]
    assert char_spans_to_token_spans([(0, 12)], offsets) == [(0, 4)]
    assert char_spans_to_token_spans([(7, 12, "ENTITY")], offsets) == [(2, 4)]
    assert char_spans_to_token_spans([(4, 5)], offsets) == [(1, 2)]  # inside a piece: that piece
    assert char_spans_to_token_spans([(30, 40)], offsets) == []  # beyond the block: dropped
    assert char_spans_to_token_spans([(0, 6), (0, 6)], [(0, 0)] + offsets) == [(1, 3)]  # zero-width special skipped


def test_char_to_token_spans_on_wordpiece(wordpiece):
    text = TEXTS[0]
    enc = wordpiece.encode(text)
    spans = find_salient_spans(text, "regex")
    tok_spans = char_spans_to_token_spans(spans, enc.offsets)
    assert len(tok_spans) == len(spans)
    for (cs, ce, _), (ts, te) in zip(spans, tok_spans):
        assert enc.offsets[ts][0] == cs and enc.offsets[te - 1][1] == ce  # covers exactly the span
        assert ts == 0 or enc.offsets[ts - 1][1] <= cs  # and nothing before it
        assert te == len(enc.offsets) or enc.offsets[te][0] >= ce  # or after it
    # decoding the tokens gives the lower-cased surface back
    ts, te = tok_spans[1]
    assert wordpiece.decode(enc.ids[ts:te]) == "zorvan teluk"


# ----------------------------------------------------------------------------------------------
# make_query: salient span masking and the ablations
# ----------------------------------------------------------------------------------------------
def params(**kw) -> RealmParams:
    return RealmParams(**{"query_len": 16, "max_masks": 4, "span_tagger": "regex", "exclude_spans_in_query": True, **kw})


def test_salient_span_mask_masks_exactly_one_salient_span(wordpiece):
    mask_id = wordpiece.token_to_id("[MASK]")
    p = params()
    for i, text in enumerate(TEXTS[:3]):
        row = block_row(wordpiece, text, row=i)
        spans = salient_token_spans(row, "regex")
        assert spans
        for seed in range(20):
            q = make_query(row, p, np.random.default_rng(seed), mask_token_id=mask_id)
            assert q is not None and q.source_row == i and q.block_id == f"b{i}"
            assert len(q.input_ids) == len(q.labels) <= p.query_len - 2
            masked = [j for j, t in enumerate(q.input_ids) if t == mask_id]
            labelled = [j for j, y in enumerate(q.labels) if y != IGNORE_INDEX]
            assert masked == labelled and 1 <= len(masked) <= p.max_masks
            assert masked == list(range(masked[0], masked[-1] + 1))  # one contiguous span
            assert q.masked == (masked[0], masked[-1] + 1)
            # the window is a slice of the block; the masked tokens are one of its salient spans
            ids = row["input_ids"]
            w0 = next(s for s in range(len(ids)) if
                      all(t == mask_id or t == ids[s + j] for j, t in enumerate(q.input_ids)) and s + len(q.input_ids) <= len(ids))
            assert (w0 + masked[0], w0 + masked[-1] + 1) in spans
            assert [q.labels[j] for j in masked] == ids[w0 + masked[0]: w0 + masked[-1] + 1]


def test_salient_span_prefers_source_marked_spans_and_skips_blocks_without_spans(wordpiece):
    mask_id = wordpiece.token_to_id("[MASK]")
    text = TEXTS[0]
    s = text.index("soldiers")
    row = block_row(wordpiece, text, char_spans=[[s, s + len("soldiers")]])
    q = make_query(row, params(max_masks=10), np.random.default_rng(0), mask_token_id=mask_id)
    assert wordpiece.decode([y for y in q.labels if y != IGNORE_INDEX]) == "soldiers"
    assert make_query(block_row(wordpiece, TEXTS[3]), params(), np.random.default_rng(0), mask_token_id=mask_id) is None


def test_exclude_spans_in_query_never_masks_a_span_the_block_repeats(wordpiece):
    # "Kessa" is written twice, so x would still show it; "1879" occurs once and is the only choice
    mask_id = wordpiece.token_to_id("[MASK]")
    text = "The expedition ended in 1879 near the village of Kessa. kessa is small."
    k1, k2 = text.index("Kessa"), text.index("kessa")
    y = text.index("1879")
    row = block_row(wordpiece, text, char_spans=[[y, y + 4], [k1, k1 + 5], [k2, k2 + 5]])
    answers = lambda p: {wordpiece.decode([t for t in make_query(row, p, np.random.default_rng(s), mask_token_id=mask_id).labels  # noqa: E731
                                           if t != IGNORE_INDEX]) for s in range(30)}
    assert answers(params(exclude_spans_in_query=True)) == {"1879"}
    assert answers(params(exclude_spans_in_query=False)) == {"1879", "kessa"}  # the paper's masking picks either
    only_repeated = block_row(wordpiece, text, char_spans=[[k1, k1 + 5], [k2, k2 + 5]])
    assert make_query(only_repeated, params(exclude_spans_in_query=True), np.random.default_rng(0), mask_token_id=mask_id) is None


def test_spans_longer_than_max_masks_are_not_used(wordpiece):
    mask_id = wordpiece.token_to_id("[MASK]")
    row = block_row(wordpiece, TEXTS[0])
    spans = salient_token_spans(row, "regex")
    longest = max(e - s for s, e in spans)
    p = params(max_masks=longest - 1)
    for seed in range(10):
        q = make_query(row, p, np.random.default_rng(seed), mask_token_id=mask_id)
        assert sum(y != IGNORE_INDEX for y in q.labels) <= longest - 1


def test_random_token_mask(wordpiece):
    mask_id = wordpiece.token_to_id("[MASK]")
    row = block_row(wordpiece, TEXTS[3])  # no salient span needed
    p = params(masking="random_token", random_mask_ratio=0.5, max_masks=3)
    q = make_query(row, p, np.random.default_rng(1), mask_token_id=mask_id)
    n = sum(y != IGNORE_INDEX for y in q.labels)
    assert n == 3  # round(0.5 * 14) = 7, capped at max_masks
    assert [j for j, t in enumerate(q.input_ids) if t == mask_id] == q.masked_positions


def test_random_span_mask_is_whole_words(wordpiece):
    mask_id = wordpiece.token_to_id("[MASK]")
    row = block_row(wordpiece, TEXTS[0])
    p = params(masking="random_span")
    for seed in range(10):
        q = make_query(row, p, np.random.default_rng(seed), mask_token_id=mask_id)
        s, e = q.masked
        assert 1 <= e - s <= p.max_masks
        assert [j for j, t in enumerate(q.input_ids) if t == mask_id] == list(range(s, e))
