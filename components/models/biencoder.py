"""Dense passage retrieval fine-tuning: a DPR-style bi-encoder (the RetroMAE fine-tuning recipe).

    E_q(q) = BERT_[CLS](q)        E_p(p) = BERT_[CLS](p)        (ONE shared encoder, [CLS] pooling)
    s(q, p) = E_q(q) . E_p(p) / temperature                        (dot product, no normalisation)
    loss    = cross-entropy of each query's positive against every passage of the batch:
              its own hard negatives, and the positives + hard negatives of every other query
              (in-batch negatives), gathered from all ranks under DDP (`negatives_cross_device`).

Passage layout (what `finetune_data.BiEncoderCollator` emits), G = 1 + hard_negatives per query:

    passages = [p_0, n_0,1 .. n_0,H,  p_1, n_1,1 .. n_1,H,  ...]      (B*G, Lp)
    scores   = q @ passages.T / temperature                           (B, B*G)
    label(i) = i * G    (+ rank * B * G once the passages of all ranks are gathered)

False negatives: a passage that is a known positive of query i (the same document in another row
of the batch: two questions about one entity, or a query with two gold docs) is masked out of
row i, except in its label column (Tevatron/FlagEmbedding leave these in; on the synthetic corpus
they are common enough to matter).

Under DDP the passage embeddings are all-gathered with an autograd function whose backward
all-reduces (sums) the gradient of the gathered tensor and keeps this rank's slice: every rank's
queries scored this rank's passages, so the local passages get the gradient of ALL those scores.
DDP then averages parameter gradients over ranks, which makes the update exactly the gradient
of the mean loss over the global batch (the test checks it against one process on the
concatenated batch).

Usage (the shared trainer calls `out = model(batch)` and back-props `out["loss"]`):
    model = BiEncoder.from_pretrained("models/retromae/encoder", temperature=p.finetune.temperature)
    model.save_pretrained("models/biencoder", tokenizer)      # AutoModel- and sentence-transformers-loadable

Shapes: B queries, G passages per query, N = B*G passages, Lq/Lp lengths, H hidden, W world size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from components.models.encoder import cls_pool, load_encoder, save_encoder

_NEG = -1e30  # a "minus infinity" that stays finite (no inf - inf = NaN in the softmax or its gradient)


# ----------------------------------------------------------------------------------------------
# cross-device negatives
# ----------------------------------------------------------------------------------------------
def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _GatherWithGrad(torch.autograd.Function):
    """all_gather along dim 0 whose backward hands each rank the summed gradient of its own slice.

    (Same maths as `torch.distributed.nn.functional.all_gather`, which is deprecated and emulates
    reduce-scatter with all-to-all on gloo; an all-reduce of the (W*N, H) gradient is as cheap
    for embedding-sized tensors and works on every backend.) Every rank must pass the same shape.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        world, ctx.rank, ctx.n = dist.get_world_size(), dist.get_rank(), x.size(0)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)  # (W*N, ...)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()  # all_reduce is in place; never write into autograd's buffer
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)  # every rank's loss scored this rank's slice
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n]


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """(N, ...) on each rank -> (W*N, ...) in rank order; gradients flow back to each rank's slice."""
    return _GatherWithGrad.apply(x) if _is_dist() else x


@torch.no_grad()
def gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """(N, ...) -> (W*N, ...) in rank order, for tensors that need no gradient (ids, keys)."""
    if not _is_dist():
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


# ----------------------------------------------------------------------------------------------
# the loss (a pure function, tested against a hand computation)
# ----------------------------------------------------------------------------------------------
def contrastive_scores(
    q: torch.Tensor,
    p: torch.Tensor,
    group_size: int,
    temperature: float = 1.0,
    label_offset: int = 0,
    false_negatives: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores (B, N) and labels (B,) for the in-batch + hard-negative softmax.

    q (B, H) local queries; p (N, H) all passages (gathered ones included), grouped G per query;
    query i's positive is column label_offset + i * G. `false_negatives` (B, N) bool: columns to
    drop from row i (known positives of query i other than its label). Computed in fp32 at least
    (bf16/fp16 embeddings are upcast; fp64 stays fp64).
    """
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = q.to(dtype) @ p.to(dtype).T / temperature  # (B, N)
    labels = label_offset + torch.arange(q.size(0), device=q.device) * group_size  # (B,)
    if false_negatives is not None:
        keep_label = F.one_hot(labels, scores.size(1)).bool()  # (B, N)
        scores = scores.masked_fill(false_negatives & ~keep_label, _NEG)
    return scores, labels


def false_negative_mask(query_positive_keys: torch.Tensor, passage_keys: torch.Tensor) -> torch.Tensor:
    """(B, N) bool: passage j is one of query i's known positives. Keys are int64 doc hashes,
    -1 = padding (never matches: passage keys are >= 0)."""
    return (passage_keys[None, None, :] == query_positive_keys[:, :, None]).any(1)  # (B, N)


# ----------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------
class BiEncoder(nn.Module):
    """One shared encoder for queries and passages; `forward(batch)` -> {"loss", "acc", "num_tokens"}.

    batch (from `BiEncoderCollator`): query_input_ids / query_attention_mask (B, Lq),
    passage_input_ids / passage_attention_mask (B*G, Lp) grouped per query (positive first),
    optional passage_keys (B*G,) and query_positive_keys (B, P) for false-negative masking.
    """

    def __init__(self, encoder: nn.Module, *, temperature: float = 1.0, negatives_cross_device: bool = True):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.encoder = encoder
        self.temperature = float(temperature)
        self.negatives_cross_device = negatives_cross_device
        self.length_chunk_tokens = 0  # compute.length_chunk_tokens (set by the Trainer): how the towers run, not what they are

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, temperature: float = 1.0,
                        negatives_cross_device: bool = True, dropout: float | None = None) -> "BiEncoder":
        """From any HF encoder folder (RetroMAE/MLM output, a saved BiEncoder, MiniLM, ...)."""
        return cls(load_encoder(path, dropout), temperature=temperature, negatives_cross_device=negatives_cross_device)

    @classmethod
    def from_config(cls, config: Any, **kwargs) -> "BiEncoder":
        """A randomly initialised BERT (tests)."""
        from transformers import BertModel

        return cls(BertModel(config, add_pooling_layer=False), **kwargs)

    @classmethod
    def from_params(cls, path: str | os.PathLike, p: Any) -> "BiEncoder":
        """`p`: a FinetuneParams (temperature, negatives_cross_device)."""
        return cls.from_pretrained(path, temperature=p.temperature, negatives_cross_device=p.negatives_cross_device)

    # -- towers ----------------------------------------------------------------------------------
    def encode_query(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """E_q: (B, Lq) -> (B, H) [CLS] vectors."""
        return cls_pool(self.encoder, input_ids, attention_mask, self.length_chunk_tokens)

    def encode_passage(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """E_p: (N, Lp) -> (N, H) [CLS] vectors (same encoder as the queries). With `length_chunk_tokens`
        the rows run in length chunks (`encoder.run_length_chunks`): a batch's passages vary ~2x in length."""
        return cls_pool(self.encoder, input_ids, attention_mask, self.length_chunk_tokens)

    # -- training --------------------------------------------------------------------------------
    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        q = self.encode_query(batch["query_input_ids"], batch["query_attention_mask"])  # (B, H)
        p = self.encode_passage(batch["passage_input_ids"], batch["passage_attention_mask"])  # (B*G, H)
        B, N = q.size(0), p.size(0)
        if N % B:
            raise ValueError(f"{N} passages for {B} queries: expected the same number (1 + hard_negatives) per query")
        G = N // B
        keys, pos_keys = batch.get("passage_keys"), batch.get("query_positive_keys")

        offset = 0
        if self.negatives_cross_device and _is_dist():
            # Every rank must send the same (B*G, H): the trainer gives equal micro-batches and the
            # collator always emits exactly G passages per query.
            offset = dist.get_rank() * N
            p = gather_with_grad(p)  # (W*B*G, H)
            keys = gather_no_grad(keys) if keys is not None else None

        fn = false_negative_mask(pos_keys, keys) if keys is not None and pos_keys is not None else None
        scores, labels = contrastive_scores(q, p, G, self.temperature, offset, fn)  # (B, W*B*G), (B,)
        loss = F.cross_entropy(scores, labels)
        acc = (scores.detach().argmax(1) == labels).float().mean()
        num_tokens = batch["query_attention_mask"].sum() + batch["passage_attention_mask"].sum()
        return {"loss": loss, "acc": acc, "num_tokens": num_tokens}

    # -- export ----------------------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | os.PathLike, tokenizer: Any = None, max_seq_length: int | None = None) -> Path:
        """Write an HF folder (safetensors; + tokenizer) loadable with `AutoModel.from_pretrained`,
        and with `SentenceTransformer(out_dir)` as [CLS] pooling + dot product (no Normalize
        module: the model was trained on raw inner products). Atomic (`encoder.save_encoder`)."""
        return save_encoder(self, tokenizer, out_dir, sentence_transformers=True, max_seq_length=max_seq_length)


def weights_digest(module: nn.Module) -> str:
    """sha256 over a module's state dict (names, dtypes, shapes, bytes) in name order: the identity
    of a set of weights, e.g. to record which encoder a fine-tuning run started from."""
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# inference helper: texts -> vectors (for dense negative mining and the eval index)
# ----------------------------------------------------------------------------------------------
def make_encode_fn(
    model: BiEncoder, tokenizer: Any, query_len: int, passage_len: int, batch_size: int = 64,
    device: str | torch.device = "cpu",
) -> Callable[[Sequence[str], str], np.ndarray]:
    """`encode_fn(texts, side)` -> (N, H) float32, side "query" or "passage" (eval mode, no grad),
    the interface `components.retrieval.negatives.mine_dense_negatives` takes."""

    @torch.no_grad()
    def encode_fn(texts: Sequence[str], side: str) -> np.ndarray:
        if side not in ("query", "passage"):
            raise ValueError(f"side must be query|passage, got {side!r}")
        was_training = model.training
        model.eval()
        try:
            enc = model.encode_query if side == "query" else model.encode_passage
            max_len = query_len if side == "query" else passage_len
            out = []
            for i in range(0, len(texts), batch_size):
                t = tokenizer(list(texts[i : i + batch_size]), max_length=max_len, truncation=True,
                              padding=True, return_tensors="pt", return_token_type_ids=False)
                out.append(enc(t["input_ids"].to(device), t["attention_mask"].to(device)).float().cpu())
            hidden = model.encoder.config.hidden_size
            return (torch.cat(out) if out else torch.zeros(0, hidden)).numpy().astype(np.float32)
        finally:
            model.train(was_training)

    return encode_fn
