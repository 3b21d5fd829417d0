"""REALM pre-training batches: masked queries, retrieved candidates (+ the null document), tensors.

The flow of one training step (the index search stays outside the model so a fresh index can be
swapped in asynchronously, `refresh_index`):

    queries = [draw_query(blocks[r], p, rng, seed=..., mask_token_id=..., row=r) for r in rows]  # none: drawn again
    x = collate_queries(queries, p, special)                      # [CLS] masked x [SEP]
    q = retriever.encode_query(x["x_input_ids"], x["x_attention_mask"])  # no grad, (B, d)
    cand = retrieve_candidates(q, index.search, [q.source_row for q in queries], p.top_k)  # (B, K)
    batch = collate(queries, cand, blocks, p, special)            # what REALM.forward takes
(`build_batch` does the last three lines; `RealmCollator` is the Trainer's collate_fn around it.)
The queries, how x is cut and which span is masked, are `realm_query.py`.

Rows are row numbers of the retrieval-blocks dataset (what the FAISS index returns). In candidate
rows `NULL_ROW` (-1) is the null document (always slot 0) and `MISSING_ROW` (-2) a slot the index
could not fill (fewer blocks than K); the latter gets `candidate_mask = False`.

What the document tower reads (`RealmParams.doc_input`, `passage_inputs`): `[CLS] z [SEP]` (body),
or REALM's `[CLS] title [SEP] z [SEP]` with token types 0 / 1 (title_body; blocks carry `title_ids`).
The reader always reads the body: `[CLS] x [SEP] z [SEP]`, as REALM's featurizer does.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from components.data.realm_query import RealmQuery, draw_query, empty_batch_error, span_block_counts
from components.data.special_tokens import IGNORE_INDEX, MISSING_ROW, NULL_ROW, SpecialTokens
from components.data.token_spans import as_list


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
    return [int(t) for t in as_list(item)]


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

    def queries(self, rows: list[int], rng: np.random.Generator, seed: int = 0) -> list[RealmQuery]:
        """One masked query per row (`draw_query`: a row that draws none draws again)."""
        drawn = (draw_query(self.blocks[int(r)], self.p, rng, seed=seed, mask_token_id=self.special.mask, row=int(r),
                            span_blocks=self.span_blocks) for r in rows)
        return [q for q in drawn if q is not None]

    def batch(self, queries: list[RealmQuery], search=None, retriever=None) -> dict[str, torch.Tensor]:
        """The batch for `queries`; `search` / `retriever` default to the current index and the
        query tower that searches it: the live one, or with `query_encoder` (realm.query_tower:
        index_export) the snapshot that built that index. An evaluation passes a fixed index's
        search and the model's retriever."""
        retriever = retriever or (self.query_encoder() if self.query_encoder is not None else None) or self.retriever
        device = next(retriever.parameters()).device
        return build_batch(queries, retriever, search or self.search, self.lookup, self.p, self.special, device)

    def __call__(self, rows: list[int], generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        seed = generator.initial_seed() if generator is not None else 0
        queries = self.queries(rows, np.random.default_rng(seed), seed)
        if not queries:
            raise empty_batch_error(rows, "realm.train")
        return self.batch(queries)
