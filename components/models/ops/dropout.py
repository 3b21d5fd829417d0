"""Dropout whose masks are cheap to draw on a CPU: the same inverted dropout as `F.dropout`
(drop each element with probability p, scale the kept ones by 1 / (1 - p)), with masks cut from
16 random bits per element of torch's generator instead of one `bernoulli_` draw per element.

    n = use_fast_dropout(model)          # every dropout of `model` draws its masks here from now on
    y = dropout(x, p, training=True)     # (any shape), the functional form
    ctx = attention(q, k, v, mask, dropout_p, fast=True)   # SDPA, with these masks when dropout is on

Why: on a CPU, `F.dropout`'s per-element Bernoulli draw costs ~20x a softmax over the same tensor,
and MiniLM's attention-probability dropout is applied to (rows, heads, L, L) tensors, so the masks
were 28-32% of a REALM or DPR training step (bench/bench_dropout.py, bench/README.md). 64-bit
`randint` words split into four 16-bit fields give every element its own uniform draw at a
quarter of the generator calls. p is rounded to a multiple of 1/65536 (0.1 -> 0.100006) and the
kept elements are scaled by the exact inverse of the realised keep rate, so E[y] = x still holds.

With dropout on, SDPA takes its math path on a CPU (its fused kernel has no dropout); `attention`
computes that path itself so that its mask comes from here, and calls SDPA otherwise, so
evaluation and dropout-free training are untouched. On CUDA torch's fused Philox dropout is
already cheap: `compute.dropout_masks: auto` uses these masks on a CPU only.

Shapes: B batch, nh heads, Lq / Lk query / key length, hd head size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from components.models.encoder import attention_layers

_BITS = 16
_LEVELS = 1 << _BITS
_FLAG = "_rr_fast_dropout"  # set on attention modules whose dropout draws its masks here


def keep_threshold(p: float) -> tuple[int, float]:
    """(t, q): an int16 draw u keeps its element iff u >= t, which happens with probability q,
    the keep rate 1 - p rounded to a multiple of 2**-16."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p={p}: must be in [0, 1)")
    dropped = round(p * _LEVELS)  # how many of the 65536 values drop
    return dropped - _LEVELS // 2, (_LEVELS - dropped) / _LEVELS


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """A bool mask of `shape` (True: keep), each element kept independently with probability
    `keep_threshold(p)[1]`, from torch's default generator of `device` (so `torch.manual_seed` makes
    it reproducible)."""
    n = math.prod(shape)
    # full-range int64 words: all 64 bits uniform (high is exclusive, so one value of 2**64 never
    # occurs), then read as four int16 draws each
    words = torch.randint(-(2 ** 63), 2 ** 63 - 1, ((n + 3) // 4,), dtype=torch.int64, device=device)
    draws = words.view(torch.int16)[:n].view(shape)
    return draws >= keep_threshold(p)[0]


class _MaskedScale(torch.autograd.Function):
    """y = x * keep / q; the backward reuses the saved bool mask (1 byte per element, like
    `F.dropout`'s)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        keep = keep_mask(x.shape, p, x.device)
        scale = 1.0 / keep_threshold(p)[1]
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return (x * keep.to(x.dtype)).mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (keep,) = ctx.saved_tensors
        return (grad * keep.to(grad.dtype)).mul_(ctx.scale), None


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """`F.dropout(x, p, training)` with this module's masks."""
    if not training or p == 0.0:
        return x
    return _MaskedScale.apply(x, p)


class FastDropout(nn.Dropout):
    """An `nn.Dropout` that draws its masks with `dropout` (same p, same state dict: none)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, scale: float | None = None, fast: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention` (no causal flag): q (B, nh, Lq, hd), k / v (B, nh, Lk, hd),
    attn_mask None, bool (True: may attend) or additive, broadcastable to (B, nh, Lq, Lk).

    fast and dropout_p > 0: SDPA's CPU math path written out (scores, softmax, dropout, weighted
    sum), with the probabilities' mask from `dropout`. It computes what that path computes: the
    inputs in autocast's dtype when autocast is on, then on a CPU everything in fp32 (no rounding of
    scores or probabilities to bf16), the output in the inputs' dtype; a query row that may attend
    to nothing gets a zero output."""
    if not (fast and dropout_p > 0.0):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)
    device = q.device.type
    if torch.is_autocast_enabled(device):  # SDPA is on autocast's lower-precision list
        dtype = torch.get_autocast_dtype(device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out_dtype = v.dtype
    with torch.autocast(device, enabled=False):
        if device == "cpu" and out_dtype in (torch.bfloat16, torch.float16):
            q, k, v = q.float(), k.float(), v.float()
        scale = q.size(-1) ** -0.5 if scale is None else scale
        scores = torch.matmul(q * scale, k.transpose(-2, -1))  # (B, nh, Lq, Lk)
        empty_rows = None
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
            empty_rows = ~attn_mask.any(-1, keepdim=True)  # (.., Lq, 1): softmax over nothing
        elif attn_mask is not None:
            scores = scores + attn_mask.to(scores.dtype)
        probs = torch.softmax(scores, dim=-1)
        if empty_rows is not None and bool(empty_rows.any()):
            probs = probs.masked_fill(empty_rows, 0.0)
        probs = dropout(probs, dropout_p, True)
        return torch.matmul(probs, v).to(out_dtype)  # (B, nh, Lq, hd)


def _hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' "sdpa" attention function, routed through `attention` for the modules that
    `use_fast_dropout` flagged while they train with dropout; any other call goes to HF's own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # transformers only where used

    plain = (is_causal or getattr(module, "is_causal", False) or kwargs.get("position_bias") is not None
             or key.size(1) != query.size(1))  # a decoder, a position bias or grouped keys: HF's own handling
    if plain or not (getattr(module, _FLAG, False) and dropout > 0.0):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = attention(query, key, value, attention_mask, dropout, scaling, fast=True)  # (B, nh, L, hd)
    return out.transpose(1, 2).contiguous(), None  # (B, L, nh, hd), as HF's attention functions return


def _register_hf_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa", _hf_attention)


def use_fast_dropout(model: nn.Module) -> int:
    """Make every dropout of `model` draw its masks with `dropout`: each `nn.Dropout` becomes a
    `FastDropout` (same p), and every attention layer's probability dropout (HF's SDPA attention,
    RetroMAE's decoder, `bert_last_layer`) is flagged for `attention`'s math path. Evaluation is
    untouched. Returns how many modules changed."""
    _register_hf_attention()
    layers = list(attention_layers(model))
    for m in layers:
        setattr(m, _FLAG, True)
    dropouts = [m for m in model.modules() if type(m) is nn.Dropout]
    for m in dropouts:
        m.__class__ = FastDropout
    return len(layers) + len(dropouts)


def fast_dropout_masks(setting: str, device: torch.device) -> bool:
    """Whether `compute.dropout_masks` (auto | torch | fast) draws this module's masks on `device`."""
    return setting == "fast" or (setting == "auto" and device.type == "cpu")


def is_fast(module: nn.Module) -> bool:
    """Whether `use_fast_dropout` flagged this attention module."""
    return getattr(module, _FLAG, False)
