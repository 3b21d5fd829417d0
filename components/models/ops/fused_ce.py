"""The MLM head's vocabulary projection fused with its cross-entropy, and the plain reference.

    loss, (mean_enc, mean_dec), (acc_enc, acc_dec) = head_token_losses(head, hidden, labels, [Ne, Nd])
    loss, means, accs = token_losses(head(hidden), labels, sizes)     # the same, through (N, V) logits

The (N, V) logits are the largest tensor of a pre-training step; `LinearCrossEntropy` never keeps
them (see its docstring). tests/test_retromae.py holds it to `token_losses` (values and gradients).

Shapes: N predicted positions (rows of several groups, `sizes`), H hidden, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def token_losses(logits: torch.Tensor, labels: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Mean CE and accuracy per group of consecutive rows of already-selected logits (N, V), labels
    (N,): (sum of the group mean CEs, [mean CE], [acc]), one entry per group of `sizes` rows. An
    empty group gives a zero loss that is still attached to the graph (the step stays valid).
    One CE over all rows, then per-group means of the (N,) row losses: splitting the (N, V) logits
    instead would make autograd concatenate (N, V) gradients back.
    hit: max(), ~4x faster than argmax on CPU."""
    ce = F.cross_entropy(logits.float(), labels, reduction="none")  # (N,)
    hit = (logits.detach().max(-1).indices == labels).float()  # (N,)
    means = [c.sum() / max(n, 1) for c, n in zip(ce.split(sizes), sizes)]
    accs = [h.sum() / max(n, 1) for h, n in zip(hit.split(sizes), sizes)]
    return sum(means), means, accs


class LinearCrossEntropy(torch.autograd.Function):
    """loss = sum_i w_i * CE(x_i W^T + b, y_i), with per-row CE and hits as by-products.

    The (N, V) logits are the largest tensor of a step, and the plain route (linear, log_softmax,
    NLL, then autograd's NLL/log_softmax/bias backward) streams them through memory a dozen times.
    Here the gradient is formed in the forward, chunk of rows by chunk, from the softmax made in
    place of the log-probabilities; the row weights and the onehot part are applied on the
    (c, H) / (V, H) sides, never on the (c, V) block. Backward only scales the stored gradients
    by the incoming one (the loss is linear in them). Same GEMMs as the plain route; same values
    to float rounding (tests/test_retromae.py compares the two).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, labels, row_weight, need_grad: bool, chunk: int):
        N, V = x.size(0), weight.size(0)
        dev = x.device
        # the dtype HF's Linear would compute the logits in (bf16 under autocast), CE math in fp32
        cdt = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else x.dtype
        w, b = weight.to(cdt), None if bias is None else bias.to(cdt)
        xc_all = x.to(cdt)  # (N, H)
        wrow = row_weight.view(N, 1)  # (N, 1)
        # A frozen output layer (the head-only warm-up freezes the word embeddings it is tied to)
        # skips the (V, H) gradient, the largest GEMM of the backward.
        need_gw = need_grad and ctx.needs_input_grad[1]
        if need_grad:
            xw = (x.float() * wrow).to(cdt)  # (N, H) rows scaled by their loss weight
            gx = torch.empty(N, w.size(1), dtype=cdt, device=dev)  # (N, H), unscaled softmax @ W
            gw = torch.zeros(weight.shape if need_gw else (0,), dtype=torch.float32, device=dev)  # (V, H)
            gb = torch.zeros(V, dtype=torch.float32, device=dev)  # (V,)
        # Few kernels per chunk (each is a parallel region: on a box shared with other jobs every
        # region can wait for a descheduled thread); all (c, H)-sized work is done once, below.
        nll, arg = [], []
        for s in range(0, max(N, 1), chunk):  # N = 0 still runs once, on empty tensors
            e = min(s + chunk, N)
            z = F.linear(xc_all[s:e], w, b).float()  # (c, V)
            arg.append(z.max(-1).indices)  # max(): ~4x faster than argmax on CPU
            logp = torch.log_softmax(z, -1)  # row by row (a row of V floats stays in L1)
            del z
            nll.append(logp.gather(1, labels[s:e, None]))  # (c, 1) log p(y)
            if need_grad:
                # dCE/dz = softmax - onehot(y); the onehot part is added after the loop on the
                # (N, H) / (V, H) sides (one weight row per token), so the (c, V) block is only exp'ed.
                p = logp.exp_().to(cdt)  # (c, V) softmax, in place
                torch.mm(p, w, out=gx[s:e])  # (c, H)
                # (V, H) += (V, c) @ (c, H) with no (V, H) temporary; the out= form, not addmm_,
                # because torch's FlopCounterMode (bench_step) does not see addmm_
                if need_gw and gw.dtype == cdt:
                    torch.addmm(gw, p.t(), xw[s:e], out=gw)
                elif need_gw:
                    gw += p.t() @ xw[s:e]
                gb += row_weight[s:e].to(p.dtype) @ p  # (V,)
        ce = -torch.cat(nll).squeeze(1)  # (N,)
        hit = torch.cat(arg) == labels  # (N,)
        if need_grad:
            gx = (gx.float() - w[labels].float()) * wrow  # (N, H) = w_i (softmax_i - onehot_i) W
            if need_gw:
                gw.index_add_(0, labels, xw.float(), alpha=-1.0)
            gb.index_add_(0, labels, row_weight.float(), alpha=-1.0)
        ctx.save_for_backward(*((gx, gw, gb) if need_grad else ()))
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.need_gw = need_gw
        ctx.mark_non_differentiable(ce, hit)
        return (ce * row_weight).sum(), ce, hit

    @staticmethod
    def backward(ctx, grad, _ce, _hit):
        gx, gw, gb = ctx.saved_tensors
        dx, dw, db = ctx.dtypes
        return ((gx * grad).to(dx), (gw * grad).to(dw) if ctx.need_gw else None, None if db is None else (gb * grad).to(db),
                None, None, None, None)


def head_token_losses(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """`token_losses(head(hidden), labels, sizes)` by `LinearCrossEntropy`: the head's transform
    (dense, act, LayerNorm) runs under autograd, its vocabulary projection and the CE fused.
    (differentiable sum of the group mean CEs, [mean CE] (detached), [acc]); hidden (N, H)."""
    pred = head.predictions
    x = pred.transform(hidden)  # (N, H)
    out = pred.decoder
    V, H = out.weight.shape
    w = torch.cat([torch.full((n,), 1.0 / max(n, 1), device=x.device) for n in sizes])  # (N,) 1/n per group
    need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, out.weight, out.bias))
    # Rows per chunk. Chunks pay when the passes over the (c, V) logits they keep in cache (~4 MiB)
    # save more than re-reading the (V, H) weight and its gradient per chunk costs (c > H), and only
    # single-threaded: with more intra-op threads every kernel is a fork/join of the pool, and on a
    # box shared with other jobs a join waits for a descheduled thread (bench_step, tiny, 2 threads
    # at load ~5: 10 chunks made the step ~15% slower than one; 1 thread: ~30% faster).
    chunk = max(x.size(0), 1)
    if x.device.type == "cpu" and torch.get_num_threads() == 1:
        chunk = max(2 * H, (4 << 20) // (4 * V))
    total, ce, hit = LinearCrossEntropy.apply(x, out.weight, out.bias, labels, w, need_grad, chunk)
    means = [c.sum() / max(n, 1) for c, n in zip(ce.split(sizes), sizes)]  # detached values
    accs = [h.float().sum() / max(n, 1) for h, n in zip(hit.split(sizes), sizes)]
    return total, means, accs
