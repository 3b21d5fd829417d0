"""BERT's last layer computed only where a loss reads it, and which positions those are.

    pos = predicted_positions(labels)                                  # (N,) flat labelled positions
    cls, hidden = encode_for_losses(encoder, input_ids, attention_mask, labels)   # (B, 1, H), (N, H)

The MLM head reads the labelled positions and RetroMAE's decoder reads [CLS]; nothing reads the
last layer anywhere else, so its queries, attention output and FFN run on those positions only.
`fast=False` is the full HF forward, the reference tests/test_retromae.py holds this to.

Shapes: B batch, L sequence length, H hidden, K outputs per row ([CLS] + the row's labels).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import BertModel, PreTrainedModel
from transformers.masking_utils import create_bidirectional_mask

from components.data.special_tokens import IGNORE_INDEX
from components.models.ops.dropout import attention, is_fast


def predicted_positions(labels: torch.Tensor) -> torch.Tensor:
    # Flat indices (N,) of positions that carry a label. This is a host sync (the count decides
    # the shape); it is done before the encoder runs, so it costs no idle time mid-step, and it
    # lets the (V x H) head run on ~30% (encoder) of the positions instead of all of them.
    return (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


def _last_layer_slots(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which positions of each row the encoder's last layer must output, for `encode_for_losses`.

    labels (B, L) -> slots (B, K) positions: slot 0 is [CLS] (the sentence embedding), slots 1..
    the row's labelled positions in increasing order, filled up with 0 (a repeat of [CLS], computed
    and dropped); K = 1 + the most labels in a row (a host sync, taken before the encoder runs).
    rows (Ne,): flat indices into slots[:, 1:] of the real labelled slots, in the row-major order
    of `predicted_positions(labels)`.
    """
    B, L = labels.shape
    labelled = labels != IGNORE_INDEX  # (B, L)
    counts = labelled.sum(1)  # (B,)
    K = 1 + int(counts.max()) if B else 1
    pos = torch.arange(L, device=labels.device).expand(B, L)
    # labelled positions first, each group in position order (the keys are distinct: a plain sort is exact)
    first = torch.where(labelled, pos, pos + L).sort(1).values[:, : K - 1]  # (B, K-1)
    real = torch.arange(K - 1, device=labels.device).view(1, -1) < counts.view(B, 1)  # (B, K-1)
    slots = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=labels.device), first.masked_fill(~real, 0)], 1)
    return slots, real.reshape(-1).nonzero().squeeze(1)


def _bert_layer_at(layer: nn.Module, x: torch.Tensor, slots: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """One HF BertLayer whose outputs are needed at `slots` (B, K) only: keys and values still come
    from every position of x (B, L, H), but queries, the attention output, the FFN and both
    LayerNorms run on K positions per row. Position-wise, so exactly the layer's outputs there.
    key_mask: None or (B, 1, 1, L) bool (True = may attend), as HF's SDPA mask per query row."""
    B, L, H = x.shape
    K = slots.size(1)
    att = layer.attention.self
    nh, hd = att.num_attention_heads, att.attention_head_size
    xs = x.gather(1, slots.unsqueeze(-1).expand(B, K, H))  # (B, K, H)
    q = att.query(xs).view(B, K, nh, hd).transpose(1, 2)  # (B, nh, K, hd)
    k = att.key(x).view(B, L, nh, hd).transpose(1, 2)  # (B, nh, L, hd)
    v = att.value(x).view(B, L, nh, hd).transpose(1, 2)
    ctx = attention(q, k, v, key_mask, dropout_p=att.dropout.p if att.training else 0.0, scale=att.scaling,
                    fast=is_fast(att))  # (B, nh, K, hd)
    a = layer.attention.output(ctx.transpose(1, 2).reshape(B, K, H), xs)  # dense, dropout, LayerNorm(+ xs)
    return layer.output(layer.intermediate(a), a)  # (B, K, H)


def _can_restrict_last_layer(encoder: PreTrainedModel) -> bool:
    # `_bert_layer_at` re-implements BertLayer's self-attention call for a 4-D (or no) mask;
    # anything else (a decoder config, cross-attention, flash-attention's 2-D masks, another
    # family) takes the full forward.
    base = encoder.base_model
    cfg = base.config
    return (type(base) is BertModel and not cfg.is_decoder and not cfg.add_cross_attention
            and cfg._attn_implementation in ("sdpa", "eager"))


def encode_for_losses(encoder: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      labels: torch.Tensor, fast: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder's outputs that feed a loss: the sentence embedding (B, 1, H) and the last-layer
    states (Ne, H) at the labelled positions, in `predicted_positions(labels)` order.

    fast: nothing reads the last layer at any other position (the MLM head reads labelled
    positions, RetroMAE's decoder reads [CLS]), so that layer computes its queries, attention
    output and FFN at [CLS] + the labelled ~30% only; its keys and values still cover every
    position, and every earlier layer runs in full. Same outputs as the full forward, to rounding.
    """
    bert = encoder.base_model
    if not (fast and _can_restrict_last_layer(encoder)):
        hidden = bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, L, H)
        return hidden[:, :1], hidden.reshape(-1, hidden.size(-1))[predicted_positions(labels)]
    slots, rows = _last_layer_slots(labels)  # (B, K), (Ne,)
    x = bert.embeddings(input_ids=input_ids)  # (B, L, H)
    # the mask BertModel would build: None without padding, else (B, 1, L, L) bool, the same for every query row
    mask = create_bidirectional_mask(config=bert.config, inputs_embeds=x, attention_mask=attention_mask)
    *body, last = bert.encoder.layer
    for layer in body:
        x = layer(x, mask)  # (B, L, H)
    out = _bert_layer_at(last, x, slots, None if mask is None else mask[:, :, :1])  # (B, K, H)
    return out[:, :1], out[:, 1:].reshape(-1, out.size(-1))[rows]
