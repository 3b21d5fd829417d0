"""One way to build, load, pool and save the BERT-like encoders every stage shares.

    from components.models.encoder import load_encoder, cls_pool, unwrap
    enc = load_encoder("models/retromae/encoder")          # bare encoder, no pooler; missing weights raise
    vec = cls_pool(enc, input_ids, attention_mask)          # (B, H) last-layer [CLS]
"""

from __future__ import annotations

import os

import torch
from torch import nn


def unwrap(module: nn.Module) -> nn.Module:
    """The bare module under DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while True:
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            module = module.module
        elif isinstance(getattr(module, "_orig_mod", None), nn.Module):
            module = module._orig_mod
        else:
            return module


def load_encoder(path: str | os.PathLike, dropout: float | None = None) -> nn.Module:
    """A bare BERT-like encoder (AutoModel, no pooler) from an HF folder: a RetroMAE/MLM output
    (a *ForMaskedLM: its head is ignored), a sentence-transformers folder (e.g. MiniLM), ...

    The pooler is dropped: [CLS] pooling reads the raw last-layer state, and an unused pooler would
    give DDP parameters without gradients. Missing encoder weights (HF would random-init them
    silently) are an error.
    """
    from transformers import AutoModel

    overrides = {} if dropout is None else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    try:
        model, info = AutoModel.from_pretrained(str(path), add_pooling_layer=False, output_loading_info=True,
                                                attn_implementation="sdpa", **overrides)
    except TypeError:  # an architecture without the pooler switch
        model, info = AutoModel.from_pretrained(str(path), output_loading_info=True, **overrides)
        if getattr(model, "pooler", None) is not None:
            model.pooler = None
    missing = [k for k in info["missing_keys"] if "pooler" not in k]
    if missing:
        raise ValueError(f"{path}: encoder weights missing from the checkpoint (would be random): {sorted(missing)[:8]}")
    return model


def cls_pool(encoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last-layer [CLS] state (B, H) of a bare encoder or a *ForMaskedLM (its body). Token types are
    all 0: every input here is one segment."""
    body = getattr(encoder, "base_model", encoder)
    out = body(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=torch.zeros_like(input_ids))
    return out.last_hidden_state[:, 0]  # (B, H)
