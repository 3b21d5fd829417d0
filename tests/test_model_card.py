"""The model card a transformers-flavored MLflow model carries (flows/_model_card.py): the stage's own
model_card.md under card data that names the warm start as the base model with the licence its card
declares, and none claimed where no card declares one."""

from __future__ import annotations

import json
from types import SimpleNamespace

from flows._model_card import model_card
from tests.conftest import tiny_params


def _stage_run(warm: str | None, **params):
    return SimpleNamespace(params=tiny_params(**{"warm_start.path": warm, **params}), stage="pretrain_retromae")


def _warm_folder(tmp_path, license_: str | None):
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "config.json").write_text(json.dumps({"model_type": "bert"}))
    if license_:
        (warm / "README.md").write_text(f"---\nlicense: {license_}\nlibrary_name: sentence-transformers\n---\n\n# warm\n")
    return warm


def test_the_card_is_the_stages_own_with_the_warm_starts_licence(tmp_path):
    warm = _warm_folder(tmp_path, "apache-2.0")
    model = tmp_path / "models" / "retromae" / "encoder"
    model.mkdir(parents=True)
    (model.parent / "model_card.md").write_text("# pretrain_retromae encoder\n\nTrained by retro-realm.\n")
    card = model_card(_stage_run(str(warm)), model, "retromae-encoder", "fill-mask")
    assert card.data.license == "apache-2.0" and card.data.base_model == str(warm)
    assert card.data.pipeline_tag == "fill-mask" and card.data.tags == ["retro-realm", "pretrain_retromae"]
    assert card.text.startswith("# pretrain_retromae encoder\n\nTrained by retro-realm.\n")
    assert "`apache-2.0`, as the warm start's model card declares it" in card.text


def test_without_a_declared_licence_the_card_claims_none(tmp_path):
    model = tmp_path / "encoder"
    model.mkdir()
    for warm in (None, str(_warm_folder(tmp_path, None))):  # trained from scratch; a warm start without a card
        card = model_card(_stage_run(warm), model, "init-encoder", "fill-mask")
        assert card.data.license is None and card.data.base_model == warm
        assert card.text.startswith("# init-encoder\n\nLogged by retro-realm's `pretrain_retromae` stage")
        assert "None declared." in card.text


def test_the_licence_section_points_at_the_corpus_folders_own_terms(tmp_path):
    model = tmp_path / "encoder"
    model.mkdir()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    run = _stage_run(None, **{"data.source": "beir", "data.path": str(corpus)})
    assert model_card(run, model, "e", None).text.endswith(f"(`data.source: beir`, `data.path: {corpus}`).\n")
    (corpus / "LICENSE").write_text("CC BY-SA 4.0\n")
    assert f"`data.path: {corpus}`; its terms: `{corpus / 'LICENSE'}`)" in model_card(run, model, "e", None).text
