"""RetroMAE: retrieval-oriented pre-training with a masked auto-encoder (Xiao et al., 2022).

    encoder:  a BERT (BertForMaskedLM) reads the sequence masked at ~30% (whole words, 80/10/10) and
              is trained with MLM; its last-layer [CLS] state is the sentence embedding.
    decoder:  ONE post-LN transformer layer that must rebuild the *unmasked* sequence from that
              sentence embedding alone, with "enhanced decoding": every position i gets its own
              attention mask, drawn from a pool of ~50% whole-word masks, so each token is
              reconstructed from the sentence embedding plus a different small, random context.
    loss:     L = L_enc (MLM on masked positions) + L_dec (every real token, from the decoder).

The decoder only owns its layer's weights: it reuses the encoder's embedding module (for the
content stream) and MLM head (`cls.predictions`, tied to the word embeddings).

Two streams feed the decoder layer (paper, sec. 3.3):
    H1 (query)   = e_[CLS] + p_i                   (B, L, H)  what position i asks for
    H2 (content) = [e_[CLS] ; emb(x_1) ... emb(x_{L-1})]   (B, L, H)  what it may look at
    A_ij         = softmax(Q(H1) K(H2)^T / sqrt(d) + M_ij) V(H2), M from `position_specific_mask`

Usage (the shared trainer calls `out = model(batch)` and back-props `out["loss"]`):
    from components.data.masking import SpecialTokens, RetroMAECollator
    ids = SpecialTokens.from_tokenizer(tok)
    model = RetroMAE.from_params(params.retromae, ids)
    out = model(RetroMAECollator(ids, params.retromae)(rows))
    save_pretrained_encoder(model, tok, "models/retromae/encoder")   # AutoModel-loadable

Shapes: B batch, L sequence length incl. [CLS]/[SEP], H hidden, P mask-pool size, V vocabulary.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForMaskedLM, BertConfig, BertModel, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.masking_utils import create_bidirectional_mask

from components.data.masking import IGNORE_INDEX, SpecialTokens, counter_hash, whole_word_mask

logger = logging.getLogger(__name__)

# Independent random streams of the decoder masks (inputs to `counter_hash` next to the row seed).
_STREAM_POOL, _STREAM_ROW = 1, 2
_HEAD_PREFIX = "cls."  # BertForMaskedLM's MLM head; every other weight belongs to the encoder body


# ----------------------------------------------------------------------------------------------
# encoder
# ----------------------------------------------------------------------------------------------
def build_encoder(
    enc: Any, vocab_size: int, pad_token_id: int, *,
    cls_token_id: int | None = None, sep_token_id: int | None = None, mask_token_id: int | None = None,
) -> PreTrainedModel:
    """A BertForMaskedLM from `EncoderParams`: random init (`init: config`) or a local folder.

    A folder that holds only a bare encoder (e.g. a sentence-transformers BertModel) gets a fresh
    MLM head tied to its word embeddings, with a warning; missing *encoder* weights are an error.
    """
    if enc.init == "config":
        config = BertConfig(
            vocab_size=vocab_size, hidden_size=enc.hidden_size, num_hidden_layers=enc.num_layers,
            num_attention_heads=enc.num_heads, intermediate_size=enc.intermediate_size,
            max_position_embeddings=enc.max_position, hidden_dropout_prob=enc.dropout,
            attention_probs_dropout_prob=enc.dropout, pad_token_id=pad_token_id, tie_word_embeddings=True,
            # recorded so a saved encoder folder says which ids it was trained with
            cls_token_id=cls_token_id, sep_token_id=sep_token_id, mask_token_id=mask_token_id,
        )
        return AutoModelForMaskedLM.from_config(config, attn_implementation="sdpa")
    model = load_pretrained_encoder(enc.pretrained_path, vocab_size, dropout=enc.dropout)
    if model.config.pad_token_id != pad_token_id:
        logger.warning("%s: config pad_token_id=%s but the tokenizer's is %s (is this the model's tokenizer?)",
                       enc.pretrained_path, model.config.pad_token_id, pad_token_id)
    logger.info("loaded %s: %d layers, hidden %d (the folder's architecture; encoder size params are ignored)",
                enc.pretrained_path, model.config.num_hidden_layers, model.config.hidden_size)
    return model


def load_pretrained_encoder(path: str | os.PathLike, vocab_size: int | None = None, dropout: float | None = None) -> PreTrainedModel:
    """AutoModelForMaskedLM from a folder, checking what HF would otherwise silently random-init."""
    overrides = {} if dropout is None else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    model, info = AutoModelForMaskedLM.from_pretrained(
        str(path), output_loading_info=True, attn_implementation="sdpa", **overrides
    )
    mlm_head(model)  # fail early on an unsupported encoder family
    missing = sorted(info["missing_keys"])
    body_missing = [k for k in missing if not k.startswith(_HEAD_PREFIX)]
    if body_missing:
        raise ValueError(f"{path}: encoder weights missing from the checkpoint (would be random): {body_missing[:8]}")
    if missing:
        logger.warning(
            "%s has no MLM head (missing %s); building one: transform randomly initialised, output "
            "layer tied to the word embeddings, bias 0. MLM/decoder losses start high until it trains.",
            path, ", ".join(missing),
        )
        _init_mlm_head(model, missing)
    if vocab_size is not None and vocab_size > model.config.vocab_size:
        logger.warning("%s: tokenizer has %d ids > model's %d; resizing the (tied) embeddings", path, vocab_size, model.config.vocab_size)
        model.resize_token_embeddings(vocab_size)
    return model


def mlm_head(encoder: PreTrainedModel) -> nn.Module:
    """The MLM head (hidden -> vocabulary logits). BERT family: `cls` (BertOnlyMLMHead)."""
    head = getattr(encoder, "cls", None)
    if head is None or not hasattr(head, "predictions"):
        raise TypeError(f"RetroMAE here expects a BERT-family *ForMaskedLM (with .cls.predictions); got {type(encoder).__name__}")
    return head


def _init_mlm_head(model: PreTrainedModel, missing: list[str]) -> None:
    """Initialise the head weights the checkpoint lacked (BERT's init: dense ~ N(0, initializer_range),
    LayerNorm = identity, biases 0; HF would also do this, silently and without our tie guarantee),
    and tie the output layer to the input word embeddings (so it starts from the trained vocabulary)."""
    pred = mlm_head(model).predictions
    named = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name in missing:
            p = named.get(name)
            if p is None:
                continue
            if name.endswith("LayerNorm.weight"):
                nn.init.ones_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, std=model.config.initializer_range)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    if pred.decoder.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        pred.decoder.weight = model.get_input_embeddings().weight  # tie by hand if HF declined
    pred.decoder.bias = pred.bias


def cls_embedding(encoder: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last-layer [CLS] state (B, H) of a *ForMaskedLM or a bare encoder (AutoModel)."""
    body = encoder.base_model if hasattr(encoder, "base_model") else encoder
    return body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]  # (B, H)


def _predicted_positions(labels: torch.Tensor) -> torch.Tensor:
    # Flat indices (N,) of positions that carry a label. This is a host sync (the count decides
    # the shape); it is done before the encoder runs, so it costs no idle time mid-step, and it
    # lets the (V x H) head run on ~30% (encoder) of the positions instead of all of them.
    return (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


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


class _LinearCrossEntropy(torch.autograd.Function):
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
        if need_grad:
            xw = (x.float() * wrow).to(cdt)  # (N, H) rows scaled by their loss weight
            gx = torch.empty(N, w.size(1), dtype=cdt, device=dev)  # (N, H), unscaled softmax @ W
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=dev)  # (V, H)
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
                if gw.dtype == cdt:
                    torch.addmm(gw, p.t(), xw[s:e], out=gw)
                else:
                    gw += p.t() @ xw[s:e]
                gb += row_weight[s:e].to(p.dtype) @ p  # (V,)
        ce = -torch.cat(nll).squeeze(1)  # (N,)
        hit = torch.cat(arg) == labels  # (N,)
        if need_grad:
            gx = (gx.float() - w[labels].float()) * wrow  # (N, H) = w_i (softmax_i - onehot_i) W
            gw.index_add_(0, labels, xw.float(), alpha=-1.0)
            gb.index_add_(0, labels, row_weight.float(), alpha=-1.0)
        ctx.save_for_backward(*((gx, gw, gb) if need_grad else ()))
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(ce, hit)
        return (ce * row_weight).sum(), ce, hit

    @staticmethod
    def backward(ctx, grad, _ce, _hit):
        gx, gw, gb = ctx.saved_tensors
        dx, dw, db = ctx.dtypes
        return ((gx * grad).to(dx), (gw * grad).to(dw), None if db is None else (gb * grad).to(db),
                None, None, None, None)


def head_token_losses(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """`token_losses(head(hidden), labels, sizes)` by `_LinearCrossEntropy`: the head's transform
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
    total, ce, hit = _LinearCrossEntropy.apply(x, out.weight, out.bias, labels, w, need_grad, chunk)
    means = [c.sum() / max(n, 1) for c, n in zip(ce.split(sizes), sizes)]  # detached values
    accs = [h.float().sum() / max(n, 1) for h, n in zip(hit.split(sizes), sizes)]
    return total, means, accs


def _last_layer_slots(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which positions of each row the encoder's last layer must output, for `encode_for_losses`.

    labels (B, L) -> slots (B, K) positions: slot 0 is [CLS] (the sentence embedding), slots 1..
    the row's labelled positions in increasing order, filled up with 0 (a repeat of [CLS], computed
    and dropped); K = 1 + the most labels in a row (a host sync, taken before the encoder runs).
    rows (Ne,): flat indices into slots[:, 1:] of the real labelled slots, in the row-major order
    of `_predicted_positions(labels)`.
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
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=att.scaling,
                                         dropout_p=att.dropout.p if att.training else 0.0)  # (B, nh, K, hd)
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
    states (Ne, H) at the labelled positions, in `_predicted_positions(labels)` order.

    fast: nothing reads the last layer at any other position (the MLM head reads labelled
    positions, RetroMAE's decoder reads [CLS]), so that layer computes its queries, attention
    output and FFN at [CLS] + the labelled ~30% only; its keys and values still cover every
    position, and every earlier layer runs in full. Same outputs as the full forward, to rounding.
    """
    bert = encoder.base_model
    if not (fast and _can_restrict_last_layer(encoder)):
        hidden = bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, L, H)
        return hidden[:, :1], hidden.reshape(-1, hidden.size(-1))[_predicted_positions(labels)]
    slots, rows = _last_layer_slots(labels)  # (B, K), (Ne,)
    x = bert.embeddings(input_ids=input_ids)  # (B, L, H)
    # the mask BertModel would build: None without padding, else (B, 1, L, L) bool, the same for every query row
    mask = create_bidirectional_mask(config=bert.config, inputs_embeds=x, attention_mask=attention_mask)
    *body, last = bert.encoder.layer
    for layer in body:
        x = layer(x, mask)  # (B, L, H)
    out = _bert_layer_at(last, x, slots, None if mask is None else mask[:, :, :1])  # (B, K, H)
    return out[:, :1], out[:, 1:].reshape(-1, out.size(-1))[rows]


# ----------------------------------------------------------------------------------------------
# enhanced decoding: the position-specific attention mask
# ----------------------------------------------------------------------------------------------
def decoder_mask_pool(word_ids: torch.Tensor, seed: torch.Tensor, ratio: float, pool_size: int, passes: int = 4) -> torch.Tensor:
    """P whole-word masks per sequence at `ratio` (True = hidden from the decoder).

    word_ids (B, L) long (-1 = special/pad: never masked), seed (B,) long -> (B, P, L) bool with
    P = min(pool_size, L): a row never needs more pool entries than it has positions (the reference
    collator draws min(len, 128) masks).
    """
    B, L = word_ids.shape
    P = min(pool_size, L)
    dev = word_ids.device
    p = torch.arange(P, device=dev).view(1, P, 1)
    w = torch.arange(L, device=dev).view(1, 1, L)  # word ids are < L (renumbered per row by the collator)
    keys = counter_hash(seed.view(B, 1, 1), torch.tensor(_STREAM_POOL, device=dev), p, w)  # (B, P, L) int word priorities
    words = word_ids[:, None, :].expand(B, P, L).reshape(B * P, L)  # (B*P, L)
    return whole_word_mask(words, ratio, keys.reshape(B * P, L), passes).view(B, P, L)


def decoder_row_choice(seed: torch.Tensor, attention_mask: torch.Tensor, pool_size: int) -> torch.Tensor:
    """Which pool entry each decoder row i uses: (B, L) long, uniform over the row's first
    min(n_b, P) entries (n_b = real tokens incl. specials, as the reference collator)."""
    B, L = attention_mask.shape
    n = attention_mask.sum(1).clamp(min=1, max=pool_size)  # (B,)
    i = torch.arange(L, device=attention_mask.device).view(1, L)
    return counter_hash(seed.view(B, 1), torch.tensor(_STREAM_ROW, device=seed.device), i) % n.view(B, 1)  # (B, L)


def position_specific_mask(pool: torch.Tensor, choice: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """visible[b, i, j] (B, L, L) bool: may decoder row i attend to position j?

    Row i sees everything its pool draw leaves unmasked, except itself (it must predict its own
    token) and padding. Position 0 holds the sentence embedding and is never in a pool mask (special
    token), so every row but row 0 sees it; this also keeps padded rows from being all-False (SDPA
    would return NaN there). Row 0 ([CLS], no loss) still sees [SEP] and the unmasked tokens.
    """
    B, P, L = pool.shape
    hidden = pool.gather(1, choice.view(B, L, 1).expand(B, L, L))  # (B, L, L) row i's draw
    visible = ~hidden & attention_mask.bool().view(B, 1, L)  # padding keys never visible
    visible &= ~torch.eye(L, dtype=torch.bool, device=pool.device)  # never itself
    visible[:, 1:, 0] = True  # the sentence embedding, for every row but its own
    return visible


# ----------------------------------------------------------------------------------------------
# the decoder layer
# ----------------------------------------------------------------------------------------------
class EnhancedDecoderLayer(nn.Module):
    """One post-LN BERT layer with two input streams: queries from H1, keys/values from H2.

        x   = LayerNorm(H1 + Dropout(O(Attention(Q H1, K H2, V H2, mask))))   # residual on the query stream
        out = LayerNorm(x + Dropout(W2 act(W1 x)))
    These are the decoder's only new weights.
    """

    def __init__(self, config: BertConfig):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.num_heads = config.num_attention_heads
        self.query, self.key, self.value = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)
        self.attn_out = nn.Linear(H, H)
        self.attn_norm = nn.LayerNorm(H, eps=config.layer_norm_eps)
        self.ffn_in, self.ffn_out = nn.Linear(H, I), nn.Linear(I, H)
        self.act = ACT2FN[config.hidden_act]
        self.ffn_norm = nn.LayerNorm(H, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.attn_dropout = config.attention_probs_dropout_prob
        self.reset_parameters(config.initializer_range)

    def reset_parameters(self, std: float) -> None:
        # BERT's init (the reference applies the encoder's `_init_weights` to this layer).
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        B, L, H = x.shape
        return x.view(B, L, self.num_heads, H // self.num_heads).transpose(1, 2)  # (B, nh, L, hd)

    def forward(self, h1: torch.Tensor, h2: torch.Tensor, visible: torch.Tensor,
                query: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """h1, h2: (B, L, H); visible: (B, L, L) bool -> (B, L, H), or (N, H) with `rows`.

        query: Q(h1) (B, L, H) when the caller has a cheaper way to it (see `enhanced_decoding`).
        rows:  flat indices (N,) into B*L of the query positions whose outputs are wanted (those
               with a target). After the attention every op is per position, so the output
               projection, both LayerNorms and the FFN run on N rows instead of B*L.
        """
        B, L, H = h1.shape
        q = self._heads(self.query(h1) if query is None else query)
        k, v = self._heads(self.key(h2)), self._heads(self.value(h2))
        ctx = F.scaled_dot_product_attention(
            q, k, v, attn_mask=visible[:, None], dropout_p=self.attn_dropout if self.training else 0.0
        )  # (B, nh, L, hd); the mask broadcasts over heads
        ctx = ctx.transpose(1, 2).reshape(B * L, H)  # (B*L, H)
        h1 = h1.reshape(B * L, H)
        if rows is not None:
            ctx, h1 = ctx[rows], h1[rows]  # (N, H)
        x = self.attn_norm(h1 + self.dropout(self.attn_out(ctx)))
        out = self.ffn_norm(x + self.dropout(self.ffn_out(self.act(self.ffn_in(x)))))  # (B*L | N, H)
        return out if rows is not None else out.view(B, L, H)


# ----------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------
class RetroMAE(nn.Module):
    """Encoder (BertForMaskedLM) + one-layer enhanced decoder. `forward(batch)` -> dict of scalars.

    batch (from `RetroMAECollator`): encoder_input_ids, attention_mask, encoder_labels,
    decoder_input_ids, word_ids (B, L) and decoder_seed (B,) (optional: drawn here if absent).
    """

    def __init__(self, encoder: PreTrainedModel, params: Any = None, *, decoder_mask_ratio: float = 0.5,
                 mask_pool_size: int = 128, h1_mode: str = "raw", passes: int = 4):
        super().__init__()
        if params is not None:  # a RetroMAEParams
            decoder_mask_ratio, mask_pool_size, h1_mode = params.decoder_mask_ratio, params.mask_pool_size, params.h1_mode
            if params.max_len > encoder.config.max_position_embeddings:
                raise ValueError(f"max_len={params.max_len} > the encoder's {encoder.config.max_position_embeddings} positions")
        if h1_mode not in ("raw", "embedding"):
            raise ValueError(f"h1_mode must be raw|embedding, got {h1_mode!r}")
        mlm_head(encoder)  # fail early on an unsupported encoder family
        self.encoder = encoder
        self.decoder = EnhancedDecoderLayer(encoder.config)
        self.decoder_mask_ratio, self.mask_pool_size, self.h1_mode, self.passes = decoder_mask_ratio, mask_pool_size, h1_mode, passes
        # True: skip the work no loss reads and fuse the head with its CE (`encode_for_losses`,
        # `EnhancedDecoderLayer.forward`, `enhanced_decoding`, `head_token_losses`). False: the
        # straightforward computation, kept as the reference that tests/test_retromae.py holds
        # the fast path to (same losses and gradients).
        self.fast_path = True

    @classmethod
    def from_params(cls, params: Any, ids: SpecialTokens) -> "RetroMAE":
        encoder = build_encoder(params.encoder, ids.vocab_size, ids.pad, cls_token_id=ids.cls,
                                sep_token_id=ids.sep, mask_token_id=ids.mask)
        return cls(encoder, params)

    # Shared modules are reached through the encoder (properties, not attributes, so that the
    # state dict holds each weight once, under `encoder.`).
    @property
    def embeddings(self) -> nn.Module:
        return self.encoder.base_model.embeddings

    @property
    def head(self) -> nn.Module:
        return mlm_head(self.encoder)

    # -- retrieval-side API -------------------------------------------------------------------
    def encode_passage(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[CLS] vectors (B, H) of unmasked passages."""
        return cls_embedding(self.encoder, input_ids, attention_mask)

    def encode_query(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[CLS] vectors (B, H) of queries: RetroMAE pre-trains one tower for both sides."""
        return cls_embedding(self.encoder, input_ids, attention_mask)

    # -- enhanced decoding ---------------------------------------------------------------------
    def decoder_attention_mask(self, word_ids: torch.Tensor, attention_mask: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        """(B, L, L) bool visibility for the decoder, built on the batch's device, no host loop."""
        pool = decoder_mask_pool(word_ids, seed, self.decoder_mask_ratio, self.mask_pool_size, self.passes)  # (B, P, L)
        choice = decoder_row_choice(seed, attention_mask, pool.size(1))  # (B, L)
        return position_specific_mask(pool, choice, attention_mask)  # (B, L, L)

    def enhanced_decoding(self, cls: torch.Tensor, decoder_input_ids: torch.Tensor, visible: torch.Tensor,
                          rows: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder states (B, L, H) from the sentence embedding `cls` (B, 1, H) and the original ids;
        (N, H) at the flat positions `rows` (N,) only, when given (the fast path)."""
        B, L = decoder_input_ids.shape
        emb = self.embeddings
        # H2, content stream: the sentence embedding in slot 0, then the embeddings of the original
        # (unmasked) tokens; which of them a row may read is decided by `visible`.
        content = emb(input_ids=decoder_input_ids)  # (B, L, H) word + position + type, LayerNorm, dropout
        h2 = torch.cat([cls, content[:, 1:]], dim=1)  # (B, L, H)
        # H1, query stream: the same sentence embedding at every position, told apart only by p_i.
        query = None
        if self.h1_mode == "raw":  # reference code: e_[CLS] + p_i, no LayerNorm
            pos = emb.position_embeddings(torch.arange(L, device=cls.device))  # (L, H)
            h1 = cls + pos.unsqueeze(0)  # (B, L, H)
            if self.fast_path:
                # Q is linear: Q(e_[CLS] + p_i) = Q(e_[CLS]) + W_q p_i, B + L rows through the
                # GEMM instead of B * L.
                query = self.decoder.query(cls) + F.linear(pos, self.decoder.query.weight)  # (B, L, H)
        else:  # FlagEmbedding: through the embedding module (+ type emb, LayerNorm, dropout)
            h1 = emb(inputs_embeds=cls.expand(B, L, -1))  # (B, L, H)
        return self.decoder(h1, h2, visible, query=query, rows=rows)  # (B, L, H) | (N, H)

    def encode_for_losses(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 1, H) sentence embedding and (Ne, H) last-layer states at the labelled positions."""
        return encode_for_losses(self.encoder, input_ids, attention_mask, labels, self.fast_path)

    # -- training ------------------------------------------------------------------------------
    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        enc_ids, attn = batch["encoder_input_ids"], batch["attention_mask"]  # (B, L)
        dec_ids, word_ids = batch["decoder_input_ids"], batch["word_ids"]  # (B, L)
        seed = batch.get("decoder_seed")
        if seed is None:  # not reproducible across resumes; RetroMAECollator always provides it
            seed = torch.randint(0, 2**31 - 1, (enc_ids.size(0),), device=enc_ids.device)
        enc_labels = batch["encoder_labels"]  # (B, L) original id at masked positions, else -100
        dec_labels = dec_ids.masked_fill(word_ids < 0, IGNORE_INDEX)  # (B, L) every real token; no specials/pad
        # Index work (host syncs: counts decide shapes) happens before the encoder runs, so it
        # costs no idle time mid-step on a GPU.
        enc_pos, dec_pos = _predicted_positions(enc_labels), _predicted_positions(dec_labels)  # (Ne,), (Nd,)
        visible = self.decoder_attention_mask(word_ids, attn, seed)  # (B, L, L), built while the queue is empty

        cls, enc_hidden = self.encode_for_losses(enc_ids, attn, enc_labels)  # (B, 1, H) on the *masked* input, (Ne, H)
        if self.fast_path:
            dec_hidden = self.enhanced_decoding(cls, dec_ids, visible, rows=dec_pos)  # (Nd, H)
        else:
            dec_hidden = self.enhanced_decoding(cls, dec_ids, visible).reshape(-1, cls.size(-1))[dec_pos]  # (Nd, H)

        # One pass of the shared head over both streams' predicted positions: a single GEMM with
        # the tied (V, H) weight (and a single one for its gradient) instead of two.
        rows = torch.cat([enc_hidden, dec_hidden])  # (Ne+Nd, H)
        labels = torch.cat([enc_labels.reshape(-1)[enc_pos], dec_labels.reshape(-1)[dec_pos]])  # (Ne+Nd,)
        sizes = [enc_pos.numel(), dec_pos.numel()]
        if self.fast_path:
            loss, (loss_enc, loss_dec), (acc_enc, acc_dec) = head_token_losses(self.head, rows, labels, sizes)
        else:
            loss, (loss_enc, loss_dec), (acc_enc, acc_dec) = token_losses(self.head(rows), labels, sizes)  # (Ne+Nd, V) logits
        return {
            "loss": loss,
            "loss_enc": loss_enc.detach(),
            "loss_dec": loss_dec.detach(),
            "acc_enc": acc_enc,
            "acc_dec": acc_dec,
            "num_tokens": attn.sum(),
        }


# ----------------------------------------------------------------------------------------------
# export
# ----------------------------------------------------------------------------------------------
def _unwrap_encoder(model: nn.Module) -> PreTrainedModel:
    model = getattr(model, "module", model)  # DDP / compiled wrappers
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "encoder", model) if not isinstance(model, PreTrainedModel) else model


def save_pretrained_encoder(model: nn.Module, tokenizer: Any, out_dir: str | os.PathLike) -> Path:
    """Write the encoder (RetroMAE / MLMModel / a bare *ForMaskedLM) as an HF folder (safetensors,
    + tokenizer when given), loadable with AutoModel and AutoModelForMaskedLM. Atomic: written to a
    temp sibling, then swapped in with os.replace."""
    encoder = _unwrap_encoder(model)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        encoder.save_pretrained(tmp)  # transformers 5 writes model.safetensors (tied weights once)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if out.exists():  # os.replace cannot replace a non-empty folder: move the old one aside first
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
