"""Span scores of an extractive reader: the (start, width) grid, its masks, the softmaxes and the
marginal over correct entries, and ORQA's MLP span scorer. `reader.py` builds the model on these.

Shapes: N sequences, L tokens, A = max_answer_tokens (span widths), S = the MLP's hidden size.
A span is (i, w): tokens i .. i + w.
"""

from __future__ import annotations

import torch
from torch import nn

NEG = -1e30  # finite "minus infinity": all-masked rows stay finite, their gradients 0 (not NaN)


def span_pairs(x: torch.Tensor, max_answer_tokens: int, fill: float | bool) -> torch.Tensor:
    """x (N, L, ...) -> (N, L, A, ...): [n, i, w] = x[n, i + w], `fill` past the end."""
    A = max_answer_tokens
    pad = [0, 0] * (x.dim() - 2) + [0, A - 1]
    out = torch.nn.functional.pad(x, pad, value=fill).unfold(1, A, 1)  # (N, L, ..., A)
    return out.movedim(-1, 2)


def span_valid(start_mask: torch.Tensor, end_mask: torch.Tensor, max_answer_tokens: int) -> torch.Tensor:
    """(N, L, A) bool: i may start a span and i + w may end one (N, L) -> (N, L, A)."""
    return start_mask[:, :, None] & span_pairs(end_mask, max_answer_tokens, False)


def masked_log_softmax(scores: torch.Tensor, valid: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """log_softmax over the valid entries of `dims`; invalid entries (and every entry of a group
    with none valid, e.g. the null document) come out as NEG, never NaN, with zero gradient."""
    scores = scores.masked_fill(~valid, NEG)
    return (scores - torch.logsumexp(scores, dim=dims, keepdim=True)).masked_fill(~valid, NEG)


def marginal_nll(log_p: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """-log sum_{correct} p per row: log_p, correct (B, ...) -> (B,); 0 where a row has no correct entry."""
    B = log_p.size(0)
    lp, ok = log_p.reshape(B, -1), correct.reshape(B, -1)
    nll = -torch.logsumexp(lp.masked_fill(~ok, NEG), dim=1)  # (B,) finite even with no correct entry
    return torch.where(ok.any(1), nll, torch.zeros_like(nll))


class SpanMLP(nn.Module):
    """ORQA's span scorer (orqa_model.py `read`): f(i, j) = w . LN(ReLU(W_s h_i + W_e h_j + b)), i.e.
    W [h_i; h_j] split into its start and end halves, so that start and end interact; truncated
    normal (0.02) kernels as there."""

    def __init__(self, hidden_size: int, span_hidden: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 2 * span_hidden)
        self.norm = nn.LayerNorm(span_hidden)
        self.out = nn.Linear(span_hidden, 1)
        for lin in (self.proj, self.out):
            nn.init.trunc_normal_(lin.weight, std=0.02, a=-0.04, b=0.04)
            nn.init.zeros_(lin.bias)

    def forward(self, hidden: torch.Tensor, max_answer_tokens: int) -> torch.Tensor:
        """hidden (N, L, H) -> span scores (N, L, A): [n, i, w] = f(i, i + w) (garbage past the end:
        the caller masks it)."""
        start, end = self.proj(hidden).chunk(2, dim=-1)  # (N, L, S) each
        end_w = span_pairs(end, max_answer_tokens, 0.0)  # (N, L, A, S) end[i + w]
        h = self.norm(torch.relu(start[:, :, None, :] + end_w))  # (N, L, A, S)
        return self.out(h).squeeze(-1).float()  # (N, L, A)
