"""Plain whole-word MLM on the same encoder: the baseline RetroMAE has to beat at equal compute.

    from components.data.masking import SpecialTokens, MLMCollator
    ids = SpecialTokens.from_tokenizer(tok)
    model = MLMModel.from_params(params.retromae.encoder, ids)
    out = model(MLMCollator(ids, params.mlm.mask_ratio, params.retromae.max_len)(rows))
    out["loss"].backward()

Same forward contract as `RetroMAE` (a dict of scalar tensors: loss, loss_enc, acc_enc, num_tokens),
same batch keys (encoder_input_ids, attention_mask, encoder_labels), same encoder and head code path
(`encode_for_losses`: last layer and MLM head at the masked positions only, the head fused with its
CE), so the two stages differ only by the decoder.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from components.data.special_tokens import SpecialTokens
from components.models.encoder import build_encoder, cls_pool, mlm_head
from components.models.ops.bert_last_layer import encode_for_losses, predicted_positions
from components.models.ops.fused_ce import head_token_losses, token_losses


class MLMModel(nn.Module):
    """A BertForMaskedLM trained with whole-word MLM; `forward(batch)` -> dict of scalars."""

    def __init__(self, encoder: PreTrainedModel):
        super().__init__()
        mlm_head(encoder)  # fail early on an unsupported encoder family
        self.encoder = encoder
        self.fast_path = True  # as RetroMAE.fast_path: False = the straightforward computation

    @classmethod
    def from_params(cls, enc: Any, ids: SpecialTokens, pretrained: str | None = None) -> "MLMModel":
        """enc: an EncoderParams (the MLM stage shares RetroMAE's encoder section); pretrained: a
        warm start (see `build_encoder`)."""
        return cls(build_encoder(enc, ids.vocab_size, ids.pad, cls_token_id=ids.cls, sep_token_id=ids.sep,
                                 mask_token_id=ids.mask, pretrained=pretrained))

    def encode_passage(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return cls_pool(self.encoder, input_ids, attention_mask)  # (B, H)

    encode_query = encode_passage

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids, attn, labels = batch["encoder_input_ids"], batch["attention_mask"], batch["encoder_labels"]  # (B, L)
        pos = predicted_positions(labels)  # (N,) masked positions
        # RetroMAE's encoder side exactly: last layer at the masked positions, head fused with the CE
        _, hidden = encode_for_losses(self.encoder, ids, attn, labels, self.fast_path)  # (N, H)
        head, y = mlm_head(self.encoder), labels.reshape(-1)[pos]  # (N,)
        if self.fast_path:
            loss, (mean,), (acc,) = head_token_losses(head, hidden, y, [pos.numel()])
        else:
            loss, (mean,), (acc,) = token_losses(head(hidden), y, [pos.numel()])  # (N, V) logits
        return {"loss": loss, "loss_enc": mean.detach(), "acc_enc": acc, "num_tokens": attn.sum()}
