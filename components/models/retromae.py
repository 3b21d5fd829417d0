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

The masks are drawn in components/data/masking.py; the encoder is built, pooled and saved by
components/models/encoder.py; the speed paths of the step (last encoder layer at the labelled
positions only, head fused with its CE) are in components/models/ops/.

Usage (the shared trainer calls `out = model(batch)` and back-props `out["loss"]`):
    from components.data.masking import SpecialTokens, RetroMAECollator
    ids = SpecialTokens.from_tokenizer(tok)
    model = RetroMAE.from_params(params.retromae, ids)
    out = model(RetroMAECollator(ids, params.retromae)(rows))
    save_encoder(model, tok, "models/retromae/encoder")   # components.models.encoder; AutoModel-loadable

Shapes: B batch, L sequence length incl. [CLS]/[SEP], H hidden, P mask-pool size, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, PreTrainedModel
from transformers.activations import ACT2FN

from components.data.masking import decoder_mask_pool, decoder_row_choice, position_specific_mask
from components.data.special_tokens import IGNORE_INDEX, SpecialTokens
from components.models.encoder import build_encoder, cls_pool, mlm_head
from components.models.ops.bert_last_layer import encode_for_losses, predicted_positions
from components.models.ops.dropout import attention, is_fast
from components.models.ops.fused_ce import head_token_losses, token_losses


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
        ctx = attention(q, k, v, visible[:, None], dropout_p=self.attn_dropout if self.training else 0.0,
                        fast=is_fast(self))  # (B, nh, L, hd); the mask broadcasts over heads
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
    def from_params(cls, params: Any, ids: SpecialTokens, pretrained: str | None = None) -> "RetroMAE":
        """params: a RetroMAEParams; pretrained: a warm start (see `build_encoder`)."""
        encoder = build_encoder(params.encoder, ids.vocab_size, ids.pad, cls_token_id=ids.cls,
                                sep_token_id=ids.sep, mask_token_id=ids.mask, pretrained=pretrained)
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
        return cls_pool(self.encoder, input_ids, attention_mask)

    def encode_query(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[CLS] vectors (B, H) of queries: RetroMAE pre-trains one tower for both sides."""
        return cls_pool(self.encoder, input_ids, attention_mask)

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
        enc_pos, dec_pos = predicted_positions(enc_labels), predicted_positions(dec_labels)  # (Ne,), (Nd,)
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
