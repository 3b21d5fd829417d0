"""Dense retrieval for evaluation: encode queries and blocks, search FAISS, aggregate to documents.

    enc = HFEncoder.load("models/retromae/encoder")      # components.models.encoder.load_encoder
    run, stats = dense_run(enc, enc, blocks, queries, tokenizer, k=100, query_len=32, passage_len=128, batch_size=64)

Blocks are the tokenize stage's retrieval blocks (no special tokens; see docs/contracts.md).
A document's score is the best score of its blocks (MaxP), so block packing never decides which
document wins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

from components.index.faiss_index import BlockIndex
from components.index.embed import embed_blocks
from components.models.encoder import load_encoder

EncodeFn = Callable[..., torch.Tensor]  # (ids (B, L), mask (B, L)[, token types (B, L)]) -> (B, d)


def add_specials(seqs: list[list[int]], cls_id: int, sep_id: int, pad_id: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[CLS] seq [SEP] + right padding, truncated to max_len. Returns ids (B, L), mask (B, L)."""
    body = max_len - 2
    rows = [[cls_id, *list(s)[:body], sep_id] for s in seqs]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def add_specials_title_body(pairs: list[tuple[list[int], list[int]]], cls_id: int, sep_id: int, pad_id: int,
                            max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """REALM's document input: [CLS] title [SEP] body [SEP] in max_len tokens (the title keeps at most
    max_len - 3, the body what is left), token types 0 on `[CLS] title [SEP]`, 1 on `body [SEP]`.
    Returns ids, mask, types (B, L)."""
    rows, types = [], []
    for title, body in pairs:
        title = list(title)[: max_len - 3]
        body = list(body)[: max(max_len - 3 - len(title), 0)]
        rows.append([cls_id, *title, sep_id, *body, sep_id])
        types.append([0] * (len(title) + 2) + [1] * (len(body) + 1))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    tt = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, t) in enumerate(zip(rows, types)):
        ids[i, : len(r)], mask[i, : len(r)], tt[i, : len(t)] = torch.tensor(r), 1, torch.tensor(t)
    return ids, mask, tt


class HFEncoder:
    """An HF encoder folder used as a retriever tower: last-layer [CLS] vector (RetroMAE's pooling),
    or, `pooling="mean"`, the mean of the last layer over real tokens (a sentence-transformers
    model's own mode), L2-normalised when `normalize` (cosine scores)."""

    def __init__(self, model, device: str = "cpu", pooling: str = "cls", normalize: bool = False):
        if pooling not in ("cls", "mean"):
            raise ValueError(f"pooling must be cls or mean, got {pooling!r}")
        self.model = model.to(device).eval()
        self.device, self.pooling, self.normalize = device, pooling, normalize

    @classmethod
    def load(cls, folder: str | Path, device: str = "cpu", pooling: str = "cls", normalize: bool = False) -> "HFEncoder":
        # The shared loader: encoder weights missing from the folder raise instead of scoring a
        # randomly initialised tower. An MLM checkpoint's head shows as UNEXPECTED in HF's load
        # report; that is expected ([CLS] pooling never reads the head) and left visible.
        return cls(load_encoder(folder), device, pooling, normalize)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ids, mask = ids.to(self.device), mask.to(self.device)
        return self.pool(last_hidden(self.model, ids, mask), mask)

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """This tower's vectors (B, H), float32, from a last layer `hidden` (B, L, H) and its `mask` (B, L)."""
        out = (hidden[:, 0] if self.pooling == "cls" else mean_pool(hidden, mask)).float()
        return torch.nn.functional.normalize(out, dim=-1) if self.normalize else out


def last_hidden(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The last layer (B, L, H) of a bare encoder or a *ForMaskedLM's body; one segment (types 0)."""
    body = getattr(model, "base_model", model)
    return body(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)).last_hidden_state


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of `hidden` (B, L, H) over the real tokens of `mask` (B, L) -> (B, H)."""
    m = mask[:, :, None].to(hidden.dtype)  # (B, L, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


# Config fields that change what a BERT-like encoder computes, beside its weights and class.
_FORWARD_CONFIG = ("hidden_act", "layer_norm_eps", "position_embedding_type", "num_attention_heads", "hidden_size",
                   "num_hidden_layers", "is_decoder", "add_cross_attention", "chunk_size_feed_forward", "_attn_implementation")


def same_function(a: HFEncoder, b: HFEncoder) -> bool:
    """Whether two loaded towers compute the same last layer: one class, the fields of `_FORWARD_CONFIG`,
    and bit-equal weights (the `init` row and the warm start it copies, read from two folders)."""
    ma, mb = (getattr(e.model, "base_model", e.model) for e in (a, b))
    if type(ma) is not type(mb) or a.device != b.device:
        return False
    if any(getattr(ma.config, f, None) != getattr(mb.config, f, None) for f in _FORWARD_CONFIG):
        return False
    sa, sb = ma.state_dict(), mb.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


class PoolingViews:
    """Several towers that compute the same last layer (`same_function`) and differ only in pooling,
    read in one forward: each batch returns every tower's vectors side by side, (B, V * H) in
    `towers` order, and `split` takes an (N, V * H) stack apart. Each view is the exact vector its
    own tower gives (the same forward, then its own pooling and normalisation)."""

    def __init__(self, towers: list[HFEncoder]):
        self.towers = towers

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        first = self.towers[0]
        ids, mask = ids.to(first.device), mask.to(first.device)
        hidden = last_hidden(first.model, ids, mask)  # (B, L, H)
        return torch.cat([t.pool(hidden, mask) for t in self.towers], dim=-1)  # (B, V * H)

    def split(self, emb: np.ndarray) -> list[np.ndarray]:
        return [np.ascontiguousarray(v) for v in np.split(emb, len(self.towers), axis=1)]


def sentence_transformers_mode(folder: str | Path) -> tuple[str, bool]:
    """(pooling, normalize) a sentence-transformers folder declares (modules.json, 1_Pooling): how
    the model was trained to be used. A plain HF folder: mean pooling, unnormalised."""
    import json

    folder = Path(folder)
    modules = json.loads((folder / "modules.json").read_text()) if (folder / "modules.json").exists() else []
    pooling, normalize = "mean", False
    for m in modules:
        kind = str(m.get("type", ""))
        if kind.endswith("Pooling") and (folder / m.get("path", "") / "config.json").exists():
            cfg = json.loads((folder / m["path"] / "config.json").read_text())
            pooling = "cls" if cfg.get("pooling_mode_cls_token") else "mean"
        normalize = normalize or kind.endswith("Normalize")
    return pooling, normalize


def encode_token_rows(encode: EncodeFn, rows: list[list[int]], tokenizer, max_len: int, batch_size: int, desc: str,
                      titles: list[list[int]] | None = None) -> tuple[np.ndarray, dict]:
    """Embed token rows as `[CLS] row [SEP]`; with `titles`, as `[CLS] title [SEP] row [SEP]` and
    `encode(ids, mask, token_types)` (REALM's document tower with realm.doc_input=title_body)."""
    specials = (tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id, max_len)
    if titles is not None:
        pairs = list(zip(titles, rows))
        return embed_blocks(lambda b: encode(*b), pairs, batch_size, lambda rs: add_specials_title_body(rs, *specials),
                            progress=False, desc=desc)
    return embed_blocks(lambda b: encode(*b), rows, batch_size, lambda rs: add_specials(rs, *specials), progress=False, desc=desc)


def tokenize_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False)["input_ids"]


def block_index(encode_passage: EncodeFn, blocks, tokenizer, passage_len: int, batch_size: int,
                passage_titles: bool = False) -> tuple[BlockIndex, dict]:
    """Embed every retrieval block and build a flat inner-product index over them. `passage_titles`:
    the blocks' `title_ids` go first, in segment 0 (REALM's retriever with realm.doc_input=title_body)."""
    titles = list(blocks["title_ids"]) if passage_titles else None
    emb, stats = encode_token_rows(encode_passage, list(blocks["input_ids"]), tokenizer, passage_len, batch_size, "embed blocks", titles)
    return BlockIndex.build(emb, list(blocks["block_id"]), "flat", use_gpu="auto"), stats


def search_docs(index: BlockIndex, query_vecs: np.ndarray, qids: list[str], block_doc: dict[str, str], k: int) -> dict[str, dict[str, float]]:
    """Top blocks per query -> {qid: {doc_id: best block score}} with up to k documents."""
    scores, rows = index.search(query_vecs, min(len(index), 4 * k))  # (Q, k'), blocks of one doc collapse below
    ids = index.ids_for(rows)
    run: dict[str, dict[str, float]] = {}
    for qi, qid in enumerate(qids):
        docs: dict[str, float] = {}
        for bid, s in zip(ids[qi], scores[qi]):
            if not bid or not np.isfinite(s):
                continue
            d = block_doc[str(bid)]
            if d not in docs:  # results are sorted: the first block of a doc is its best
                docs[d] = float(s)
                if len(docs) == k:
                    break
        run[qid] = docs
    return run


def dense_run(encode_query: EncodeFn, encode_passage: EncodeFn, blocks, queries: dict[str, str], tokenizer, *,
              k: int, query_len: int, passage_len: int, batch_size: int, index: BlockIndex | None = None,
              passage_titles: bool = False) -> tuple[dict, dict]:
    """Retrieve for every query. Pass `index` to search a prebuilt (e.g. stale REALM) index;
    `passage_titles`: see `block_index`."""
    stats: dict = {}
    if index is None:
        index, stats = block_index(encode_passage, blocks, tokenizer, passage_len, batch_size, passage_titles)
    qids = list(queries)
    q_vecs = embed_queries(encode_query, queries, qids, tokenizer, query_len, batch_size)
    return search_docs(index, q_vecs, qids, dict(zip(blocks["block_id"], blocks["doc_id"])), k), stats


def embed_queries(encode: EncodeFn, queries: dict[str, str], qids: list[str], tokenizer, query_len: int,
                  batch_size: int) -> np.ndarray:
    return encode_token_rows(encode, tokenize_texts(tokenizer, [queries[q] for q in qids]), tokenizer, query_len, batch_size,
                             "embed queries")[0]


def shared_dense_runs(views: PoolingViews, blocks, queries: dict[str, str], tokenizer, *, k: int, query_len: int,
                      passage_len: int, batch_size: int) -> list[dict]:
    """`dense_run` for every tower of `views` from one pass over the blocks and one over the queries:
    one run per tower, in `views.towers` order, each the run its tower alone retrieves."""
    qids = list(queries)
    block_vecs, _ = encode_token_rows(views, list(blocks["input_ids"]), tokenizer, passage_len, batch_size, "embed blocks")
    q_vecs = embed_queries(views, queries, qids, tokenizer, query_len, batch_size)
    block_doc = dict(zip(blocks["block_id"], blocks["doc_id"]))
    return [search_docs(BlockIndex.build(b, list(blocks["block_id"]), "flat", use_gpu="auto"), q, qids, block_doc, k)
            for b, q in zip(views.split(block_vecs), views.split(q_vecs))]
