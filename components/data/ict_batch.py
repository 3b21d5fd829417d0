"""Batches for the Inverse Cloze Task (ORQA, Lee et al. 2019): a sentence of a block is a
pseudo-query for the rest of that block. REALM warm-starts its retriever this way; the loss is
`components.models.ict.ICTModel`, the warm-up loop `components.training.warmups.ict_warmup`.

    rows = ict_eligible_rows(blocks)                               # blocks with >= 2 sentences
    batch = ICTCollator(blocks, p, special, mask_rate=0.9)(rows[:8], generator)
    # q_input_ids (B, Lq) `[CLS] sentence [SEP]` (<= realm.ict_query_len); d_input_ids (B, Ld) the
    # document tower's input (`passage_inputs`: `[CLS] block [SEP]`, or with realm.doc_input=title_body
    # `[CLS] title [SEP] block [SEP]` + d_token_type_ids, as ORQA's ICT blocks)
"""

from __future__ import annotations

import numpy as np
import torch

from components.data.realm_batch import collate_queries, passage_inputs
from components.data.realm_query import RealmQuery, iter_block_rows
from components.data.special_tokens import IGNORE_INDEX, SpecialTokens
from components.data.token_spans import sentence_token_spans

__all__ = ["ICTCollator", "ict_eligible_rows"]


def ict_eligible_rows(blocks) -> list[int]:
    """Blocks with at least two sentences (one to ask, the rest as context)."""
    return [r for r, row in iter_block_rows(blocks, ["text", "offsets"]) if len(sentence_token_spans(row["text"], row["offsets"])) >= 2]


class ICTCollator:
    """rows (block row numbers) -> `{q_*, d_*}`: a random sentence of each block as the query, the
    block as the context, minus that sentence with probability `mask_rate` (ORQA keeps it 10% of
    the time so the retriever still learns lexical overlap)."""

    def __init__(self, blocks, p, special: SpecialTokens, mask_rate: float):  # p: RealmParams
        self.blocks, self.p, self.special, self.mask_rate = blocks, p, special, mask_rate
        self.q_params = p.model_copy(update={"query_len": p.ict_query_len or p.query_len})  # the pseudo-query's own length

    def __call__(self, rows: list[int], generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng(generator.initial_seed() if generator is not None else 0)
        queries, contexts, titles = [], [], []
        for r in rows:
            b = self.blocks[int(r)]
            ids = [int(t) for t in b["input_ids"]]
            spans = sentence_token_spans(b["text"], b["offsets"])
            s, e = spans[rng.integers(len(spans))]
            q = ids[s:e][: self.q_params.query_len - 2]
            queries.append(RealmQuery(q, [IGNORE_INDEX] * len(q), source_row=int(r)))
            contexts.append(ids[:s] + ids[e:] if rng.random() < self.mask_rate else ids)
            titles.append(b.get("title_ids"))
        x = collate_queries(queries, self.q_params, self.special)
        d = passage_inputs(contexts, self.p, self.special, titles if self.p.doc_input == "title_body" else None)
        return {"q_input_ids": x["x_input_ids"], "q_attention_mask": x["x_attention_mask"],
                **{f"d_{k}": v for k, v in d.items()}}
