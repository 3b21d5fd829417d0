"""The words and spans of a tokenized block: the one home of the token-level span helpers that
REALM's queries, the ICT batches, the probes and the reader warm-up share.

A block row carries `input_ids`, `word_ids` (the word index of each token; continuation pieces share
their word's id), the tokenizer's `offsets` (`[char_start, char_end)` of each token), `text`, and
optionally `char_spans` (salient spans the source marked). Spans here are half-open token ranges.

* `char_spans_to_token_spans(char_spans, offsets)`: character spans -> token spans.
* `salient_token_spans(block_row, tagger)`: a block's salient spans (source-marked, else tagged by
  `salient_spans.find_salient_spans`), grown to whole words (`whole_words`); `block_spans` gives
  their token sequences, `contains_span` finds one in a token list, `occurs_once` says whether a
  span's tokens occur nowhere else in the block.
* `word_starts`, `sentence_token_spans`: where the block's words and sentences begin and end.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from components.data.salient_spans import TaggerLike, find_salient_spans

_SENTENCE = re.compile(r"[^.!?]+(?:[.!?]+|$)")


def as_list(x) -> list:
    """A column value as a list, whether the dataset handed a list, an array or a tensor."""
    return x.tolist() if hasattr(x, "tolist") else list(x)


def word_starts(word_ids: Sequence[int]) -> np.ndarray:
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


def char_spans_to_token_spans(
    char_spans: Sequence[Sequence[int]], offsets: Sequence[Sequence[int]]
) -> list[tuple[int, int]]:
    """Map `[char_start, char_end)` spans to half-open token spans `[tok_start, tok_end)`.

    A token belongs to a span when their character ranges overlap. (The released REALM code
    keeps only tokens *inside* the span; for spans on word boundaries, as both taggers produce,
    the two agree, and on a boundary inside a word overlapping masks the whole piece instead of
    leaking half of it.) Zero-width tokens (specials, offsets (0, 0)) are ignored. Spans
    that cover no token (e.g. text beyond the block) are dropped; duplicates are removed.
    `char_spans` entries may carry a third element (the label); it is ignored.
    """
    starts = [int(o[0]) for o in offsets]
    ends = [int(o[1]) for o in offsets]
    out: list[tuple[int, int]] = []
    for span in char_spans:
        cs, ce = int(span[0]), int(span[1])
        hit = [i for i, (s, e) in enumerate(zip(starts, ends)) if e > s and s < ce and cs < e]
        if hit:
            ts = (hit[0], hit[-1] + 1)
            if ts not in out:
                out.append(ts)
    return out


def whole_words(s: int, e: int, word_ids: Sequence[int]) -> tuple[int, int]:
    """Grow [s, e) to whole words: masking half a word lets the reader read the answer off the rest."""
    while s > 0 and word_ids[s - 1] == word_ids[s]:
        s -= 1
    while e < len(word_ids) and word_ids[e] == word_ids[e - 1]:
        e += 1
    return s, e


def text_to_tag(block_row: dict) -> str:
    """The text the salient-span tagger reads for this block: "" when its source marked the spans
    (`char_spans`), which are used as they are."""
    return "" if len(as_list(block_row.get("char_spans") or [])) else (block_row.get("text") or "")


def salient_token_spans(block_row: dict, tagger: TaggerLike) -> list[tuple[int, int]]:
    """Whole-word token spans of the block's salient spans (source-marked `char_spans`, else tagged)."""
    text = text_to_tag(block_row)
    char_spans = ([(s, e) for s, e, _ in find_salient_spans(text, tagger)] if text
                  else as_list(block_row.get("char_spans") or []))
    word_ids = as_list(block_row["word_ids"])
    spans = char_spans_to_token_spans(char_spans, as_list(block_row["offsets"]))
    return sorted({whole_words(s, e, word_ids) for s, e in spans})


def block_spans(block_row: dict, tagger: TaggerLike) -> set[tuple[int, ...]]:
    """The token sequences of a block's salient spans."""
    ids = [int(t) for t in block_row["input_ids"]]
    return {tuple(ids[s:e]) for s, e in salient_token_spans(block_row, tagger) if e > s}


def contains_span(hay: Sequence[int], needle: tuple[int, ...]) -> bool:
    """Whether the token sequence `needle` occurs in `hay`, in order."""
    n = len(needle)
    return any(tuple(hay[i:i + n]) == needle for i in range(len(hay) - n + 1))


def occurs_once(ids: Sequence[int], span: tuple[int, int]) -> bool:
    """Whether the tokens of `span` occur nowhere else in the block `ids`."""
    needle, n = tuple(ids[span[0]:span[1]]), span[1] - span[0]
    return not any(tuple(ids[i:i + n]) == needle for i in range(len(ids) - n + 1) if i != span[0])
