"""REALM pre-training batches: masked queries, retrieved candidates (+ the null document), tensors.

The flow of one training step (the index search stays outside the model so a fresh index can be
swapped in asynchronously, `refresh_index`):

    queries = [make_query(blocks[r], p, rng, mask_token_id=..., row=r) for r in rows]   # drop Nones
    x = collate_queries(queries, p, special)                      # [CLS] masked x [SEP]
    q = retriever.encode_query(x["x_input_ids"], x["x_attention_mask"])  # no grad, (B, d)
    cand = retrieve_candidates(q, index.search, [q.source_row for q in queries], p.top_k)  # (B, K)
    batch = collate(queries, cand, blocks, p, special)            # what REALM.forward takes
(`build_batch` does the last three lines; `RealmCollator` is the Trainer's collate_fn around it.)

Rows are row numbers of the retrieval-blocks dataset (what the FAISS index returns). In candidate
rows `NULL_ROW` (-1) is the null document (always slot 0) and `MISSING_ROW` (-2) a slot the index
could not fill (fewer blocks than K); the latter gets `candidate_mask = False`.

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

What the document tower reads (`RealmParams.doc_input`, `passage_inputs`): `[CLS] z [SEP]` (body),
or REALM's `[CLS] title [SEP] z [SEP]` with token types 0 / 1 (title_body; blocks carry `title_ids`).
The reader always reads the body: `[CLS] x [SEP] z [SEP]`, as REALM's featurizer does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from components.data.special_tokens import IGNORE_INDEX, MISSING_ROW, NULL_ROW, SpecialTokens
from components.data.salient_spans import TaggerLike, block_spans, contains_span, salient_token_spans, span_tagger_for, whole_words

_FALLBACK_SPAN_LENS = (1, 2, 3, 4)  # random_span length when the block has no salient span
_SENTENCE = re.compile(r"[^.!?]+(?:[.!?]+|$)")


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
def _as_list(x) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def _word_starts(word_ids: Sequence[int]) -> np.ndarray:
    w = np.asarray(word_ids)
    return np.concatenate([[True], w[1:] != w[:-1]]) if len(w) else np.zeros(0, dtype=bool)


def sentence_token_spans(text: str, offsets) -> list[tuple[int, int]]:
    """[start, end) token ranges of the block's sentences (tokens assigned by their char start)."""
    starts = np.asarray([int(o[0]) for o in offsets], dtype=np.int64)
    spans = []
    for m in _SENTENCE.finditer(text or ""):
        idx = np.flatnonzero((starts >= m.start()) & (starts < m.end()))
        if idx.size:
            spans.append((int(idx[0]), int(idx[-1]) + 1))
    return spans


def _sentence_bounds(block_row: dict, n: int, span: tuple[int, int] | None, rng: np.random.Generator) -> tuple[int, int]:
    """Token range of the sentence(s) that contain `span` (a split inside a name, "Dr. Smith",
    joins two); without a span, a random sentence. The whole block when it has no sentences."""
    sents = sentence_token_spans(block_row.get("text") or "", _as_list(block_row["offsets"]))
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


def _occurs_once(ids: Sequence[int], span: tuple[int, int]) -> bool:
    """Whether the tokens of `span` occur nowhere else in the block `ids`."""
    needle, n = tuple(ids[span[0]:span[1]]), span[1] - span[0]
    return not any(tuple(ids[i:i + n]) == needle for i in range(len(ids) - n + 1) if i != span[0])


def _held_by_other_blocks(salient: list[tuple[int, int]], ids: Sequence[int], params,
                          span_blocks: dict[tuple[int, ...], int] | None) -> list[tuple[int, int]]:
    """The spans that between span_min_other_blocks and span_max_other_blocks OTHER blocks hold."""
    if span_blocks is None:
        raise ValueError("realm.span_min_other_blocks / span_max_other_blocks need the corpus's span counts: "
                         "pass span_blocks=span_block_counts(blocks, params)")
    lo, hi = params.span_min_other_blocks or 0, params.span_max_other_blocks
    others = [span_blocks.get(tuple(ids[s:e]), 1) - 1 for s, e in salient]  # x's own block holds it too
    return [sp for sp, k in zip(salient, others) if lo <= k and (hi is None or k <= hi)]


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
    params,  # components.config.RealmParams
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
    ids = [int(t) for t in _as_list(block_row["input_ids"])]
    word_ids = [int(w) for w in _as_list(block_row["word_ids"])]
    n = len(ids)
    if n == 0:
        return None
    width = base_width = min(n, params.query_len - 2)
    starts = _word_starts(word_ids)
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
            salient = [sp for sp in salient if _occurs_once(ids, sp)]
        if getattr(params, "filters_other_blocks", False):
            salient = _held_by_other_blocks(salient, ids, params, span_blocks)
        while salient:
            span = salient[rng.integers(len(salient))]
            bounds = _sentence_bounds(block_row, n, span, rng) if sentence else None
            width = base_width if bounds is None else min(bounds[1] - bounds[0], params.query_len - 2)
            w0 = _window_start(n, width, starts, rng, cover=span, bounds=bounds)
            # with span_min/max_other_blocks x must not show the answer elsewhere: try another span
            if span_blocks is None or _occurs_once(ids[w0:w0 + width], (span[0] - w0, span[1] - w0)):
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


def span_block_counts(blocks, p) -> dict[tuple[int, ...], int] | None:
    """How many blocks hold each salient span (token ids) among their own salient spans: one pass
    over the corpus, kept for the process. None when `realm.span_min/max_other_blocks` are off."""
    if not getattr(p, "filters_other_blocks", False):
        return None
    tagger = span_tagger_for(p)
    key = (getattr(blocks, "_fingerprint", None) or id(blocks), len(blocks), tagger)
    if key not in _span_counts:
        counts: dict[tuple[int, ...], int] = {}
        for _, row in iter_block_rows(blocks, [c for c in _SPAN_COLUMNS if c in blocks.column_names]):
            for sp in block_spans(row, tagger):
                counts[sp] = counts.get(sp, 0) + 1
        _span_counts.clear()
        _span_counts[key] = counts
    return _span_counts[key]


def eligible_rows(blocks, p, mask_token_id: int, seed: int) -> list[int]:
    """Rows for which `make_query` yields a query (salient-span mode: the block has a usable span)."""
    if p.masking == "salient_span":
        span_tagger_for(p).kind  # resolved once, before the pass over the corpus: a missing NER model errors or warns here
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


# ----------------------------------------------------------------------------------------------
# retrieval
# ----------------------------------------------------------------------------------------------
def retrieve_candidates(
    query_vecs,  # (B, d) numpy or torch
    index_search_fn: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]],
    source_block_rows: Sequence[int],
    k: int,
) -> np.ndarray:
    """Candidate rows (B, k) int64: slot 0 = NULL_ROW, then the top k-1 blocks other than the source.

    Searches k-1+1 so that dropping the source block (REALM: "exclude trivial candidates", x is
    a piece of that very block) still leaves k-1. Slots the index cannot fill are MISSING_ROW.
    """
    if isinstance(query_vecs, torch.Tensor):
        query_vecs = query_vecs.detach().float().cpu().numpy()
    q = np.ascontiguousarray(query_vecs, dtype=np.float32)
    B = q.shape[0]
    out = np.full((B, k), MISSING_ROW, dtype=np.int64)
    out[:, 0] = NULL_ROW
    if k == 1:
        return out
    _, rows = index_search_fn(q, k)  # (B, k): (k - 1) wanted + 1 spare for the source block
    rows = np.asarray(rows, dtype=np.int64)
    for b in range(B):
        seen: set[int] = set()
        keep = []
        for r in rows[b]:
            r = int(r)
            if r < 0 or r == int(source_block_rows[b]) or r in seen:
                continue  # no result / the query's own block / a duplicate (would double its mass)
            seen.add(r)
            keep.append(r)
        keep = keep[: k - 1]
        out[b, 1:1 + len(keep)] = keep
    return out


# ----------------------------------------------------------------------------------------------
# tensors
# ----------------------------------------------------------------------------------------------
def _pad(seqs: list[list[int]], value: int) -> torch.Tensor:
    L = max((len(s) for s in seqs), default=0)
    return torch.tensor([s + [value] * (L - len(s)) for s in seqs], dtype=torch.long).view(len(seqs), L)


def collate_queries(queries: Sequence[RealmQuery], params, special: SpecialTokens) -> dict[str, torch.Tensor]:
    """x_input_ids / x_attention_mask / x_labels (B, Lx): `[CLS] x [SEP]`, padded to the longest."""
    body = [q.input_ids[: params.query_len - 2] for q in queries]
    ids = [[special.cls, *b, special.sep] for b in body]
    labels = [[IGNORE_INDEX, *q.labels[: params.query_len - 2], IGNORE_INDEX] for q in queries]
    x = _pad(ids, special.pad)
    return {"x_input_ids": x, "x_attention_mask": _pad([[1] * len(s) for s in ids], 0), "x_labels": _pad(labels, IGNORE_INDEX)}


def _lookup_tokens(block_token_lookup, row: int, column: str = "input_ids") -> list[int]:
    item = block_token_lookup(row) if callable(block_token_lookup) else block_token_lookup[row]
    if isinstance(item, dict):
        item = item[column]
    elif column != "input_ids":
        raise ValueError(f"the block lookup gives token lists; realm.doc_input=title_body needs rows with `{column}`")
    return [int(t) for t in _as_list(item)]


def _title_body(title: Sequence[int], body: Sequence[int], block_len: int, special: SpecialTokens) -> tuple[list[int], list[int]]:
    """`[CLS] title [SEP] body [SEP]` in block_len tokens, types 0 (title part) / 1 (body part): the
    title keeps at most block_len - 3 tokens, the body what is left (REALM's featurize_document_tf)."""
    title = list(title)[: block_len - 3]
    body = list(body)[: max(block_len - 3 - len(title), 0)]
    return [special.cls, *title, special.sep, *body, special.sep], [0] * (len(title) + 2) + [1] * (len(body) + 1)


def passage_inputs(token_lists: Sequence[Sequence[int]], params, special: SpecialTokens,
                   titles: Sequence[Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
    """The document tower's input (<= block_len) for `Retriever.encode_passage(**inputs)`: what the
    index must embed, so that index scores and REALM's recomputed scores see the same input.
    `doc_input: body`: `[CLS] z [SEP]`; `title_body`: `[CLS] title [SEP] z [SEP]` (`titles`, token
    ids without specials, one per block) plus `token_type_ids`."""
    if params.doc_input == "title_body":
        if titles is None or len(titles) != len(token_lists):
            raise ValueError("realm.doc_input=title_body needs one title per block (the blocks' `title_ids` column: rerun tokenize)")
        pairs = [_title_body(ti, t, params.block_len, special) for ti, t in zip(titles, token_lists)]
        ids = [i for i, _ in pairs]
        return {"input_ids": _pad(ids, special.pad), "attention_mask": _pad([[1] * len(s) for s in ids], 0),
                "token_type_ids": _pad([ty for _, ty in pairs], 0)}
    ids = [[special.cls, *list(t)[: params.block_len - 2], special.sep] for t in token_lists]
    return {"input_ids": _pad(ids, special.pad), "attention_mask": _pad([[1] * len(s) for s in ids], 0)}


def passage_columns(params) -> list[str]:
    """The block columns `passage_batch` reads."""
    return ["input_ids", "title_ids"] if params.doc_input == "title_body" else ["input_ids"]


def passage_batch(rows: Sequence[dict], params, special: SpecialTokens) -> dict[str, torch.Tensor]:
    """`passage_inputs` of block rows (dicts with `input_ids`, and `title_ids` for title_body): the
    refresh's and the evaluation's collate."""
    titles = [r["title_ids"] for r in rows] if params.doc_input == "title_body" else None
    return passage_inputs([r["input_ids"] for r in rows], params, special, titles)


def collate(
    queries: Sequence[RealmQuery],
    candidate_rows: np.ndarray,  # (B, K) from retrieve_candidates
    block_token_lookup: Callable[[int], Sequence[int]] | Any,  # row -> input_ids; or a list / Dataset
    params,  # RealmParams
    special: SpecialTokens,
) -> dict[str, torch.Tensor]:
    """The batch `REALM.forward` takes.

    x_*: see `collate_queries`. z_input_ids (B, K, Lz): `z [SEP]` (z <= block_len - 2 tokens, so
    `[CLS] z [SEP]` fits block_len), the null document `[SEP]`, pad after; z_attention_mask
    (B, K, Lz); candidate_mask (B, K) bool; candidate_rows (B, K) long (for logging).
    With `doc_input: title_body` also p_input_ids / p_attention_mask / p_token_type_ids (B, K, Lp):
    the document tower's `[CLS] title [SEP] z [SEP]` (`passage_inputs`; the null document has an
    empty title and body), which REALM's rescoring must embed as the index did.
    """
    cand = np.asarray(candidate_rows, dtype=np.int64)
    B, K = cand.shape
    if B != len(queries):
        raise ValueError(f"{len(queries)} queries but candidate_rows has {B} rows")
    if K and not (cand[:, 0] == NULL_ROW).all():
        raise ValueError("slot 0 of every candidate row must be the null document (NULL_ROW)")
    z: list[list[int]] = []
    for r in cand.reshape(-1):
        body = [] if r < 0 else _lookup_tokens(block_token_lookup, int(r))[: params.block_len - 2]
        z.append(body + [special.sep])
    Lz = max(len(s) for s in z)
    z_ids = _pad(z, special.pad).view(B, K, Lz)
    z_mask = _pad([[1] * len(s) for s in z], 0).view(B, K, Lz)
    out = {
        **collate_queries(queries, params, special),
        "z_input_ids": z_ids,
        "z_attention_mask": z_mask,
        "candidate_mask": torch.from_numpy(cand != MISSING_ROW),
        "candidate_rows": torch.from_numpy(cand),
    }
    if params.doc_input == "title_body":
        flat = cand.reshape(-1)
        bodies = [[] if r < 0 else _lookup_tokens(block_token_lookup, int(r)) for r in flat]
        titles = [[] if r < 0 else _lookup_tokens(block_token_lookup, int(r), "title_ids") for r in flat]
        p = passage_inputs(bodies, params, special, titles)
        out.update({f"p_{k}": v.view(B, K, -1) for k, v in p.items()})
    return out


@torch.no_grad()
def build_batch(
    queries: Sequence[RealmQuery],
    retriever,  # components.models.realm.Retriever
    index_search_fn: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]],
    block_token_lookup,
    params,
    special: SpecialTokens,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Embed the queries with the current retriever (eval mode, no grad), search, collate.

    Only the *selection* of the top k uses these vectors; REALM.forward rescores with gradients.
    """
    x = collate_queries(queries, params, special)
    was_training = retriever.training
    retriever.eval()
    try:
        q = retriever.encode_query(x["x_input_ids"].to(device), x["x_attention_mask"].to(device))
    finally:
        retriever.train(was_training)
    cand = retrieve_candidates(q, index_search_fn, [qq.source_row for qq in queries], params.top_k)
    return collate(queries, cand, block_token_lookup, params, special)


# ----------------------------------------------------------------------------------------------
# the Trainer's collate_fn
# ----------------------------------------------------------------------------------------------
class RealmCollator:
    """rows (block row numbers) -> the batch REALM.forward takes, retrieving from the CURRENT index.

    `retriever` (the live `Retriever`, any module with `encode_query`) and `search(q, k) -> (scores,
    rows)` (e.g. `IndexStore.search`, which reads whichever index was swapped in last) are passed
    in, so this data module depends on neither the models nor the index; `query_encoder()`, when
    given, returns the tower that embeds x for the search instead (`IndexRefresh.query_encoder`). Called by the Trainer in
    the training thread (`num_workers` must be 0: a worker process would search a copy of the
    index that never sees a swap). Masks are drawn from the Trainer's per-(step, micro-batch)
    generator, so a resumed run draws the same masks.
    """

    def __init__(self, blocks, p, special: SpecialTokens, retriever, search: Callable[[np.ndarray, int], tuple],
                 query_encoder: Callable[[], Any] | None = None):
        self.blocks = blocks
        missing = [c for c in passage_columns(p) if c not in blocks.column_names]
        if missing:
            raise ValueError(f"realm.doc_input={p.doc_input} needs the blocks' {missing} column(s): rerun the tokenize stage")
        self.lookup = blocks.select_columns(passage_columns(p))
        self.p, self.special, self.retriever, self.search = p, special, retriever, search
        self.query_encoder = query_encoder  # () -> the tower that embeds x for the search; None: `retriever`
        self.span_blocks = span_block_counts(blocks, p)

    def queries(self, rows: list[int], rng: np.random.Generator) -> list[RealmQuery]:
        out = []
        for r in rows:
            q = make_query(self.blocks[int(r)], self.p, rng, mask_token_id=self.special.mask, row=int(r), span_blocks=self.span_blocks)
            if q is not None:  # eligible rows give one in salient-span mode (span_max_other_blocks: almost always)
                out.append(q)
        return out

    def batch(self, queries: list[RealmQuery], search=None, retriever=None) -> dict[str, torch.Tensor]:
        """The batch for `queries`; `search` / `retriever` default to the current index and the
        query tower that searches it: the live one, or with `query_encoder` (realm.query_tower:
        index_export) the snapshot that built that index. An evaluation passes a fixed index's
        search and the model's retriever."""
        retriever = retriever or (self.query_encoder() if self.query_encoder is not None else None) or self.retriever
        device = next(retriever.parameters()).device
        return build_batch(queries, retriever, search or self.search, self.lookup, self.p, self.special, device)

    def __call__(self, rows: list[int], generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng(generator.initial_seed() if generator is not None else 0)
        return self.batch(self.queries(rows, rng))
