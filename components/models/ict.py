"""The Inverse Cloze Task loss (ORQA, Lee et al. 2019): each sentence must pick its own block out
of the batch. REALM warm-starts its retriever with it before the marginal likelihood takes over;
batches come from `components.data.ict_batch.ICTCollator`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from components.models.retriever import Retriever


class ICTModel(nn.Module):
    """Softmax over the in-batch contexts: loss = CE(q . d^T, diagonal).

    It trains every parameter of the retriever, its projection included: REALM starts from ORQA's
    ICT retriever, whose 128-d projection is trained by ICT (orqa/models/ict_model.py), not random."""

    def __init__(self, retriever: Retriever):
        super().__init__()
        self.retriever = retriever

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        q = self.retriever.encode_query(batch["q_input_ids"], batch["q_attention_mask"])  # (B, d)
        d = self.retriever.encode_passage(batch["d_input_ids"], batch["d_attention_mask"],
                                          batch.get("d_token_type_ids"))  # (B, d)
        with torch.autocast(device_type=q.device.type, enabled=False):
            scores = q.float() @ d.float().T  # (B, B)
        target = torch.arange(scores.shape[0], device=scores.device)
        loss = F.cross_entropy(scores, target)
        return {"loss": loss, "ict_acc": (scores.argmax(-1) == target).float().mean().detach(),
                "num_tokens": (batch["q_attention_mask"].sum() + batch["d_attention_mask"].sum()).detach()}  # tokens/s
