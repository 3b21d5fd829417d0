"""Fast dropout masks (components/models/ops/dropout.py): the same inverted dropout as F.dropout, its
attention path against SDPA, and that `use_fast_dropout` reaches every dropout of the models trained."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from components.config_shared import ComputeParams, TrainParams
from components.models.ops import dropout as D
from components.training.trainer import Trainer
from tests.test_trainer import _MaskedBert


def test_keep_threshold_rounds_p_to_a_multiple_of_2_to_the_minus_16():
    assert D.keep_threshold(0.0) == (-32768, 1.0)  # every int16 is >= -32768: nothing drops
    t, q = D.keep_threshold(0.1)
    assert t == 6554 - 32768 and q == (65536 - 6554) / 65536 and abs(q - 0.9) < 1e-5
    with pytest.raises(ValueError, match="must be in"):
        D.keep_threshold(1.0)


def test_masks_keep_at_the_rate_independently_and_follow_the_seed():
    torch.manual_seed(3)
    m = D.keep_mask((1000, 1003), 0.25)  # not a multiple of 4: the last word is cut
    q = D.keep_threshold(0.25)[1]
    n = m.numel()
    assert m.dtype == torch.bool and m.shape == (1000, 1003)
    assert abs(m.float().mean().item() - q) < 5 * (q * (1 - q) / n) ** 0.5
    # the four fields of one 64-bit word are independent draws: neighbours do not co-vary
    flat = m.flatten().float()
    corr = torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1].item()
    assert abs(corr) < 5 / n ** 0.5
    torch.manual_seed(3)
    assert torch.equal(D.keep_mask((1000, 1003), 0.25), m)


def test_dropout_is_inverted_dropout_and_its_gradient_uses_the_same_mask():
    x = torch.rand(64, 300, dtype=torch.float64) + 0.5
    x.requires_grad_(True)
    torch.manual_seed(0)
    y = D.dropout(x, 0.3)
    q = D.keep_threshold(0.3)[1]
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / q)
    assert abs(kept.double().mean().item() - q) < 0.02
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept.double() / q)
    assert D.dropout(x, 0.3, training=False) is x and D.dropout(x, 0.0) is x


def test_fast_dropout_module_is_an_nn_dropout_with_the_same_p():
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2))
    assert D.use_fast_dropout(m) == 1
    assert type(m[1]) is D.FastDropout and m[1].p == 0.2 and isinstance(m[1], nn.Dropout)
    x = torch.randn(3, 4)
    assert torch.equal(m.eval()(x), m[0](x))


def _qkv(B=2, nh=3, L=7, hd=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, nh, L, hd, generator=g, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_attention_with_fast_masks_is_sdpas_math_path(monkeypatch, mask_kind):
    q, k, v = _qkv()
    mask = None
    if mask_kind == "bool":
        mask = torch.ones(2, 1, 7, 7, dtype=torch.bool)
        mask[..., 5:] = False
        mask[1, 0, 3] = False  # a query row that may attend to nothing: SDPA gives it 0
    elif mask_kind == "additive":
        mask = torch.zeros(2, 1, 1, 7)
        mask[..., 4:] = torch.finfo(torch.float32).min
    # no dropout: SDPA itself, bit for bit
    assert torch.equal(D.attention(q, k, v, mask, 0.0, fast=True), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    # with dropout: softmax(q k^T / sqrt(hd)) * keep / q_keep @ v, the mask from keep_mask
    keep = torch.rand(2, 3, 7, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    monkeypatch.setattr(D, "keep_mask", lambda shape, p, device="cpu": keep)
    got = D.attention(q, k, v, mask, 0.3, fast=True)
    probs = F.scaled_dot_product_attention(q, k, torch.eye(7).expand(2, 3, 7, 7), attn_mask=mask)  # the probabilities
    want = (probs * keep / D.keep_threshold(0.3)[1]) @ v
    torch.testing.assert_close(got, want)
    if mask_kind == "bool":
        assert torch.equal(got[1, :, 3], torch.zeros(3, 8))


def test_attention_without_the_flag_is_sdpa():
    q, k, v = _qkv()
    torch.manual_seed(0)
    a = D.attention(q, k, v, None, 0.5, fast=False)
    torch.manual_seed(0)
    assert torch.equal(a, F.scaled_dot_product_attention(q, k, v, dropout_p=0.5))


def _count_dropouts(monkeypatch) -> list[tuple[int, ...]]:
    """Make every fast mask keep everything (scale 1) and record its shape: the model then computes
    exactly its dropout-free forward, through every fast-mask site."""
    seen: list[tuple[int, ...]] = []

    def identity(ctx, x, p):
        seen.append(tuple(x.shape))
        return x.clone()

    monkeypatch.setattr(D._MaskedScale, "forward", staticmethod(identity))
    return seen


def _tiny_bert(p: float):
    """test_trainer's tiny HF BertForMaskedLM, every dropout at p, seeded: two calls give the same weights."""
    torch.manual_seed(0)
    return _MaskedBert(attention_dropout=p, hidden_dropout=p).mlm


def test_every_dropout_of_an_hf_bert_draws_fast_masks(monkeypatch):
    model, reference = _tiny_bert(0.1), _tiny_bert(0.0)
    layers = model.config.num_hidden_layers
    ids = torch.randint(5, 64, (2, 12))
    attn = torch.ones(2, 12, dtype=torch.long)
    attn[1, 9:] = 0  # padding: HF's bool key mask reaches `attention`
    before = model.eval()(input_ids=ids, attention_mask=attn).logits
    assert D.use_fast_dropout(model) == 1 + 3 * layers + layers  # the nn.Dropouts, and each attention layer flagged
    assert torch.equal(model.eval()(input_ids=ids, attention_mask=attn).logits, before)  # evaluation untouched
    seen = _count_dropouts(monkeypatch)
    got = model.train()(input_ids=ids, attention_mask=attn).logits
    # embeddings + per layer (attention probabilities, attention output, FFN output); nothing else
    assert len(seen) == 1 + 3 * layers and seen.count((2, 2, 12, 12)) == layers
    torch.testing.assert_close(got, reference.train()(input_ids=ids, attention_mask=attn).logits)


def _set_every_dropout(model: nn.Module, p: float) -> nn.Module:
    from components.models.encoder import set_attention_dropout

    set_attention_dropout(model, p)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = p
    return model


def test_the_retromae_decoder_and_the_last_layer_fast_path_draw_fast_masks(monkeypatch):
    from tests.test_retromae import model_and_batch

    model, batch = model_and_batch(seed=2)
    no_dropout = _set_every_dropout(copy.deepcopy(model), 0.0)
    D.use_fast_dropout(_set_every_dropout(model, 0.1))
    seen = _count_dropouts(monkeypatch)
    torch.manual_seed(0)
    got = model.train()(batch)["loss"]
    torch.manual_seed(0)
    want = no_dropout.train()(batch)["loss"]
    B, L = batch["encoder_input_ids"].shape
    nh = model.decoder.num_heads
    assert (B, nh, L, L) in seen  # the decoder's attention probabilities
    assert any(len(s) == 4 and s[2] < L for s in seen)  # the encoder's last layer at its K output slots
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("setting,fast", [("auto", True), ("torch", False), ("fast", True)])
def test_the_trainer_draws_fast_masks_as_compute_dropout_masks_says(tmp_path, setting, fast):
    compute = ComputeParams(device="cpu", seed=1234, precision="fp32", dropout_masks=setting)
    rows = [{"input_ids": list(range(5, 17))} for _ in range(8)]

    def collate(batch, generator=None):
        ids = torch.tensor([r["input_ids"] for r in batch])
        return {"input_ids": ids, "labels": ids.clone()}

    train = TrainParams(batch_size=4, lr=1e-3, max_steps=1, warmup_ratio=0.0, checkpoint_every=100, keep_checkpoints=1)
    trainer = Trainer(_MaskedBert(attention_dropout=0.1, hidden_dropout=0.1), rows, collate, train, compute, tmp_path,
                      progress=False)
    kinds = {type(m) for m in trainer.raw_model.modules() if isinstance(m, nn.Dropout)}
    assert kinds == ({D.FastDropout} if fast else {nn.Dropout})
    assert D.fast_dropout_masks(setting, torch.device("cuda")) is (setting == "fast")


def test_attention_under_autocast_computes_in_fp32_like_sdpas_math_path():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t * 2 for t in _qkv(L=40))
    with torch.autocast("cpu", torch.bfloat16):
        with sdpa_kernel(SDPBackend.MATH):
            want = F.scaled_dot_product_attention(q, k, v)
        got = D.attention(q, k, v, None, 1e-9, fast=True)  # p rounds to 0: every element kept, scale 1
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=0)
