"""REALM's pre-training queries: x, a piece of one retrieval block with one span masked
(`make_query`), and the queries over the retrieval-blocks dataset (`eligible_rows`, `fixed_queries`,
`span_block_counts`). `realm_batch` turns them into the batch REALM.forward takes.

Masking (`RealmParams.masking`), always ONE [MASK] per masked token (REALM does no 80/10/10):
* `salient_span` (paper, "salient span masking"): one named entity / date of the block, all its
  whole-word tokens; spans come from the block's `char_spans` (marked by the source), else from
  `find_salient_spans(text, span_tagger)`. Spans longer than `max_masks` are skipped; a block
  without a usable span gives None (the released code skips such sentences too). With
  `exclude_spans_in_query`, only spans whose tokens occur once in the block count (REALM's x is
  about a sentence; a multi-sentence window usually repeats the masked entity, which makes it
  answerable from x alone). With `span_min_other_blocks` / `span_max_other_blocks` only spans that
  that many OTHER blocks hold among their salient spans (`span_block_counts`, one pass over the
  corpus) and that x shows nowhere else count: an answer retrieval can supply and x cannot.
* `random_token` (BERT-style ablation): round(random_mask_ratio * len(x)) random tokens, at least 1
  and capped at `max_masks` (so every mode has the same worst-case label count per query; with the
  defaults, 0.15 * 46 = 7 < 10, the cap rarely binds).
* `random_span` (SpanBERT-style ablation): one random contiguous run of whole words, its length in
  tokens drawn from the block's salient spans (so it matches the salient mode), or 1-4 tokens when
  the block has none; <= max_masks.

What x is (`RealmParams.query_unit`): `window`, up to `query_len - 2` tokens of the block around the
span; `sentence` (REALM's x), the sentence(s) that contain the span, cut to `query_len - 2` tokens
around it (random modes: a random sentence). Spans are tagged by `span_tagger_for(params)`
(`realm.span_tagger`, `realm.span_types`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from components.data.salient_spans import TaggerLike, span_tagger_for
from components.data.special_tokens import IGNORE_INDEX, SpecialTokens
from components.data.token_spans import (as_list, block_spans, contains_span, occurs_once, salient_token_spans,
                                         sentence_token_spans, text_to_tag, whole_words, word_starts)

_FALLBACK_SPAN_LENS = (1, 2, 3, 4)  # random_span length when the block has no salient span


@dataclass
class RealmQuery:
    """One pre-training query x: a window of a retrieval block with one span masked."""

    input_ids: list[int]  # window tokens, no specials, masked positions = [MASK]
    labels: list[int]  # original id at masked positions, -100 elsewhere (same length)
    source_row: int  # row of the block x came from (excluded from its candidates); -1 unknown
    block_id: str = ""
    masked: tuple[int, int] | None = None  # [start, end) of the masked span in the window (span modes)
    masked_positions: list[int] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# masking
# ----------------------------------------------------------------------------------------------
def _sentence_bounds(block_row: dict, n: int, span: tuple[int, int] | None, rng: np.random.Generator) -> tuple[int, int]:
    """Token range of the sentence(s) that contain `span` (a split inside a name, "Dr. Smith",
    joins two); without a span, a random sentence. The whole block when it has no sentences."""
    sents = sentence_token_spans(block_row.get("text") or "", as_list(block_row["offsets"]))
    if span is not None:
        sents = [(s, e) for s, e in sents if s < span[1] and span[0] < e]
        return (min(s for s, _ in sents), max(e for _, e in sents)) if sents else (0, n)
    return sents[rng.integers(len(sents))] if sents else (0, n)


def _window_start(n: int, width: int, starts: np.ndarray, rng: np.random.Generator, cover: tuple[int, int] | None = None,
                  bounds: tuple[int, int] | None = None) -> int:
    """A random window start inside `bounds` (default the block); it begins on a word and, if
    given, contains `cover` entirely."""
    lo, hi = (0, n - width) if bounds is None else (bounds[0], bounds[1] - width)  # inclusive
    if cover is not None:
        lo, hi = max(lo, cover[1] - width), min(hi, cover[0])
    cand = [i for i in range(lo, hi + 1) if starts[i]] or list(range(lo, hi + 1))
    return int(cand[rng.integers(len(cand))])


def other_blocks_range(p) -> tuple[int, int | None]:
    """[realm.span_min_other_blocks, span_max_other_blocks], null read as 0 / no upper bound."""
    return p.span_min_other_blocks or 0, p.span_max_other_blocks


def in_range(k: int, lo: int, hi: int | None) -> bool:
    """lo <= k <= hi, where hi None is no upper bound."""
    return lo <= k and (hi is None or k <= hi)


def _held_by_other_blocks(salient: list[tuple[int, int]], ids: Sequence[int], params,
                          span_blocks: dict[tuple[int, ...], int] | None) -> list[tuple[int, int]]:
    """The spans that between span_min_other_blocks and span_max_other_blocks OTHER blocks hold."""
    if span_blocks is None:
        raise ValueError("realm.span_min_other_blocks / span_max_other_blocks need the corpus's span counts: "
                         "pass span_blocks=span_block_counts(blocks, params)")
    lo, hi = other_blocks_range(params)
    others = [span_blocks.get(tuple(ids[s:e]), 1) - 1 for s, e in salient]  # x's own block holds it too
    return [sp for sp, k in zip(salient, others) if in_range(k, lo, hi)]


def _random_word_span(lo: int, hi: int, target: int, max_masks: int, word_ids: Sequence[int], starts: np.ndarray,
                      rng: np.random.Generator) -> tuple[int, int] | None:
    """A run of whole words inside [lo, hi) with about `target` tokens (never more than max_masks)."""
    word_heads = [i for i in range(lo, hi) if starts[i]]
    rng.shuffle(word_heads)
    for s in word_heads:
        e = s
        while e < hi:
            _, nxt = whole_words(e, e + 1, word_ids)
            if nxt > hi or nxt - s > max_masks or (e > s and e - s >= target):
                break
            e = nxt
        if e > s:
            return s, e
    return None


def make_query(
    block_row: dict,
    params,  # components.config_stages.RealmParams
    rng: np.random.Generator,
    *,
    mask_token_id: int,
    row: int | None = None,
    span_blocks: dict[tuple[int, ...], int] | None = None,
) -> RealmQuery | None:
    """x for REALM pre-training from one retrieval-block row (see docs/contracts.md).

    Takes a window of at most `query_len - 2` tokens (room for [CLS]/[SEP]), inside the span's
    sentence with `query_unit: sentence`, and masks it per `params.masking` (module docstring).
    Returns None when the block offers nothing to mask.
    `row` (or `block_row["row"]`) is the block's row number, kept to exclude it from retrieval.
    `span_blocks` (`span_block_counts`) is needed with `realm.span_min/max_other_blocks`.
    """
    ids = [int(t) for t in as_list(block_row["input_ids"])]
    word_ids = [int(w) for w in as_list(block_row["word_ids"])]
    n = len(ids)
    if n == 0:
        return None
    width = base_width = min(n, params.query_len - 2)
    starts = word_starts(word_ids)
    source_row = int(row if row is not None else block_row.get("row", -1))
    sentence = params.query_unit == "sentence"

    span = None  # in block coordinates
    if params.masking in ("salient_span", "random_span"):
        salient = [s for s in salient_token_spans(block_row, span_tagger_for(params)) if s[1] - s[0] <= min(params.max_masks, width)]
    if params.masking == "salient_span":
        if not salient:
            return None
        if getattr(params, "exclude_spans_in_query", False):
            # In entity-centred text the masked name is usually written again a sentence later; x
            # then answers itself, p(y|x,z) does not depend on z and the retriever learns noise.
            salient = [sp for sp in salient if occurs_once(ids, sp)]
        if getattr(params, "filters_other_blocks", False):
            salient = _held_by_other_blocks(salient, ids, params, span_blocks)
        while salient:
            span = salient[rng.integers(len(salient))]
            bounds = _sentence_bounds(block_row, n, span, rng) if sentence else None
            width = base_width if bounds is None else min(bounds[1] - bounds[0], params.query_len - 2)
            w0 = _window_start(n, width, starts, rng, cover=span, bounds=bounds)
            # with span_min/max_other_blocks x must not show the answer elsewhere: try another span
            if span_blocks is None or occurs_once(ids[w0:w0 + width], (span[0] - w0, span[1] - w0)):
                break
            salient = [sp for sp in salient if sp != span]
        if not salient:
            return None
        positions = list(range(*span))
    else:
        bounds = _sentence_bounds(block_row, n, None, rng) if sentence else None
        if bounds is not None:
            width = min(bounds[1] - bounds[0], params.query_len - 2)
        w0 = _window_start(n, width, starts, rng, bounds=bounds)
        if params.masking == "random_span":
            lens = [e - s for s, e in salient] or list(_FALLBACK_SPAN_LENS)
            target = min(int(lens[rng.integers(len(lens))]), params.max_masks)
            span = _random_word_span(w0, w0 + width, target, params.max_masks, word_ids, starts, rng)
            if span is None:
                return None
            positions = list(range(*span))
        elif params.masking == "random_token":
            k = min(params.max_masks, max(1, round(params.random_mask_ratio * width)))
            positions = sorted(int(p) for p in w0 + rng.choice(width, size=k, replace=False))
        else:
            raise ValueError(f"unknown masking {params.masking!r}")

    window = ids[w0:w0 + width]
    labels = [IGNORE_INDEX] * width
    rel = [p - w0 for p in positions]
    for p in rel:
        labels[p] = window[p]
        window[p] = mask_token_id
    return RealmQuery(
        input_ids=window, labels=labels, source_row=source_row, block_id=str(block_row.get("block_id", "")),
        masked=(span[0] - w0, span[1] - w0) if span is not None else None, masked_positions=rel,
    )


def masked_answer(q: RealmQuery) -> tuple[int, ...]:
    """The token ids hidden in x, in order (a contiguous span in the span masking modes)."""
    return tuple(int(q.labels[i]) for i in q.masked_positions)


def unmasked_spans(q: RealmQuery, spans: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Of x's source-block `spans`, those x shows unmasked (its entities / dates other than the
    answer): what x is about."""
    answer = masked_answer(q)
    return sorted(sp for sp in spans if sp != answer and contains_span(q.input_ids, sp))


def context_spans(q: RealmQuery, block_row: dict, tagger: TaggerLike) -> list[tuple[int, ...]]:
    """`unmasked_spans` of x's source block `block_row`."""
    return unmasked_spans(q, block_spans(block_row, tagger))


# ----------------------------------------------------------------------------------------------
# queries over the retrieval-blocks dataset
# ----------------------------------------------------------------------------------------------
def iter_block_rows(blocks, columns: list[str], batch: int = 1000):
    """(row, {column: value}) over an HF dataset, read `batch` rows per Arrow slice."""
    sub = blocks.select_columns(columns)
    for start in range(0, len(sub), batch):
        cols = sub[start:start + batch]
        names = list(cols)
        for i, vals in enumerate(zip(*(cols[c] for c in names))):
            yield start + i, dict(zip(names, vals))


_SPAN_COLUMNS = ("input_ids", "word_ids", "offsets", "char_spans", "text")
_span_counts: dict[tuple, dict[tuple[int, ...], int]] = {}  # one corpus per process: the last one counted


def iter_block_spans(blocks, tagger: TaggerLike):
    """(row, the block's salient spans as token-id tuples, each once) over the retrieval blocks."""
    for r, row in iter_block_rows(blocks, [c for c in _SPAN_COLUMNS if c in blocks.column_names]):
        yield r, block_spans(row, tagger)


def span_block_counts(blocks, p) -> dict[tuple[int, ...], int] | None:
    """How many blocks hold each salient span (token ids) among their own salient spans: one pass
    over the corpus, kept for the process. None when `realm.span_min/max_other_blocks` are off."""
    if not getattr(p, "filters_other_blocks", False):
        return None
    tagger = span_tagger_for(p)
    key = (getattr(blocks, "_fingerprint", None) or id(blocks), len(blocks), tagger)
    if key not in _span_counts:
        counts: dict[tuple[int, ...], int] = {}
        for _, spans in iter_block_spans(blocks, tagger):
            for sp in spans:
                counts[sp] = counts.get(sp, 0) + 1
        _span_counts.clear()
        _span_counts[key] = counts
    return _span_counts[key]


def untagged_texts(blocks) -> list[str]:
    """The texts of the blocks without source-marked `char_spans`: those the salient-span tagger reads."""
    cols = [c for c in ("text", "char_spans") if c in blocks.column_names]
    if "text" not in cols:
        return []
    return [text for _, row in iter_block_rows(blocks, cols) if (text := text_to_tag(row))]


# Extra draws for a row whose first draw gives no query (`draw_query`). On small's shipped corpus 1.9% of
# the eligible rows ever draw none, the worst 70% of the time: 16 more draws leave it none 0.3% of the time.
QUERY_REDRAWS = 16


def draw_query(block_row: dict, params, rng: np.random.Generator, *, seed: int, mask_token_id: int, row: int,
               span_blocks: dict[tuple[int, ...], int] | None = None) -> RealmQuery | None:
    """`make_query` for a training batch. An eligible row can still draw no query: with
    span_min/max_other_blocks a window that shows the answer twice is refused, and which window is
    drawn is random. Such a row draws again, up to `QUERY_REDRAWS` times, each from its own stream
    (seed, row, attempt), so `rng` (and with it every other row's draw) is left as it was, and a
    resumed run draws the same."""
    q = make_query(block_row, params, rng, mask_token_id=mask_token_id, row=row, span_blocks=span_blocks)
    for attempt in range(QUERY_REDRAWS if q is None else 0):
        q = make_query(block_row, params, np.random.default_rng([seed, row, attempt]), mask_token_id=mask_token_id,
                       row=row, span_blocks=span_blocks)
        if q is not None:
            break
    return q


def empty_batch_error(rows: list[int], phase: str) -> RuntimeError:
    """What to do when no row of a micro-batch gave a query (`draw_query`)."""
    return RuntimeError(f"blocks {list(rows)} gave no masked query in {1 + QUERY_REDRAWS} draws each, so this micro-batch "
                        f"of {phase} is empty: give each micro-batch more queries (a lower realm.train.grad_accum), or "
                        f"relax realm.span_min_other_blocks / span_max_other_blocks")


def eligible_rows(blocks, p, mask_token_id: int, seed: int, ner_cache: Path | None = None) -> list[int]:
    """Rows for which `make_query` yields a query (salient-span mode: the block has a usable span).
    `ner_cache`: an entities file shared by runs over the same blocks (`SpanTagger.prefetch`)."""
    if p.masking == "salient_span":
        tagger = span_tagger_for(p)
        tagger.kind  # resolved once, before the pass over the corpus: a missing NER model errors or warns here
        tagger.prefetch(untagged_texts(blocks), cache=ner_cache)  # one batched NER pass: every pass below reads its cache
    cols = [c for c in (*_SPAN_COLUMNS, "block_id") if c in blocks.column_names]
    rng, counts = np.random.default_rng(seed), span_block_counts(blocks, p)
    return [r for r, row in iter_block_rows(blocks, cols) if make_query(row, p, rng, mask_token_id=mask_token_id, row=r, span_blocks=counts)]


def fixed_queries(blocks, rows: list[int], p, special: SpecialTokens, seed: int, draws: int = 1) -> list[RealmQuery]:
    """Masked queries per row, the same for a given seed (probes and held-out evaluation): `draws`
    masks drawn per row, of which the distinct answers are kept (one query per span)."""
    rng, counts = np.random.default_rng(seed), span_block_counts(blocks, p)
    out = []
    for r in rows:
        seen: set[tuple[int, ...]] = set()
        for _ in range(draws):
            q = make_query(blocks[int(r)], p, rng, mask_token_id=special.mask, row=int(r), span_blocks=counts)
            if q is not None and (answer := masked_answer(q)) not in seen:
                seen.add(answer)
                out.append(q)
    return out
