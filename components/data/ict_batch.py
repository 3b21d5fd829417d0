"""Batches for the Inverse Cloze Task (ORQA, Lee et al. 2019): a sentence of a block is a
pseudo-query for the rest of that block. REALM warm-starts its retriever this way; the loss is
`components.models.ict.ICTModel`, the warm-up loop `components.training.warmups.ict_warmup`.

    rows = ict_eligible_rows(blocks)                               # blocks with >= 2 sentences
    batch = ICTCollator(blocks, p, special, mask_rate=0.9)(rows[:8], generator)
    # q_input_ids (B, Lq) `[CLS] sentence [SEP]`; d_input_ids (B, Ld) `[CLS] block [SEP]`
"""

from __future__ import annotations

import re

import numpy as np
import torch

from components.data.realm_batch import RealmQuery, collate_queries, iter_block_rows, passage_inputs
from components.data.special_tokens import IGNORE_INDEX, SpecialTokens

_SENTENCE = re.compile(r"[^.!?]+(?:[.!?]+|$)")


def sentence_token_spans(text: str, offsets) -> list[tuple[int, int]]:
    """[start, end) token ranges of the block's sentences (tokens assigned by their char start)."""
    starts = np.asarray([int(o[0]) for o in offsets], dtype=np.int64)
    spans = []
    for m in _SENTENCE.finditer(text or ""):
        idx = np.flatnonzero((starts >= m.start()) & (starts < m.end()))
        if idx.size:
            spans.append((int(idx[0]), int(idx[-1]) + 1))
    return spans


def ict_eligible_rows(blocks) -> list[int]:
    """Blocks with at least two sentences (one to ask, the rest as context)."""
    return [r for r, row in iter_block_rows(blocks, ["text", "offsets"]) if len(sentence_token_spans(row["text"], row["offsets"])) >= 2]


class ICTCollator:
    """rows (block row numbers) -> `{q_*, d_*}`: a random sentence of each block as the query, the
    block as the context, minus that sentence with probability `mask_rate` (ORQA keeps it 10% of
    the time so the retriever still learns lexical overlap)."""

    def __init__(self, blocks, p, special: SpecialTokens, mask_rate: float):  # p: RealmParams
        self.blocks, self.p, self.special, self.mask_rate = blocks, p, special, mask_rate

    def __call__(self, rows: list[int], generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng(generator.initial_seed() if generator is not None else 0)
        queries, contexts = [], []
        for r in rows:
            b = self.blocks[int(r)]
            ids = [int(t) for t in b["input_ids"]]
            spans = sentence_token_spans(b["text"], b["offsets"])
            s, e = spans[rng.integers(len(spans))]
            q = ids[s:e][: self.p.query_len - 2]
            queries.append(RealmQuery(q, [IGNORE_INDEX] * len(q), source_row=int(r)))
            contexts.append(ids[:s] + ids[e:] if rng.random() < self.mask_rate else ids)
        x = collate_queries(queries, self.p, self.special)
        d = passage_inputs(contexts, self.p, self.special)
        return {"q_input_ids": x["x_input_ids"], "q_attention_mask": x["x_attention_mask"],
                "d_input_ids": d["input_ids"], "d_attention_mask": d["attention_mask"]}
