"""Runs and models where users look for them, against the real MLflow server on loopback
(tests/servers.py: sqlite backend, artifacts proxied to S3):

- the pipeline's models are MLflow 3 logged models of their stage run, with the flavor users load
  (sentence_transformers for retrievers, transformers for MLM encoders), and load back giving the
  same embeddings / weights;
- an open-QA reader is a pyfunc model (signature, input example) whose predict answers with a span
  of the context, the span the pipeline's reader picks;
- the registered alias resolves to the latest pipeline run's retriever;
- eval metrics are attached to the model they measure;
- with a tracking server a large artifact is uploaded; the embedded store keeps a reference;
- an index version on a refresh run has its URI, sha256, size and blocks;
- stage runs carry system metrics; the experiment is tagged as model training.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import torch

from components import paths
from components.data.tokenize import load_tokenizer
from components.models.biencoder import BiEncoder
from components.models.encoder import cls_pool, load_encoder
from components.models.reader import OpenQA, SpanReader
from components.models.retriever import Retriever
from components.tracking import ENV_PARENT, StageRun, open_parent_run
from flows._model_card import model_card
from flows._stage import attach_metrics, log_model, pipeline_models, register
from tests.conftest import build_data_and_encoders, tiny_params

pytestmark = pytest.mark.servers
TEXTS = ["who founded the city of aldmoor", "the river runs north of the old bridge"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """An encoder (save_encoder's default: HF + sentence-transformers files), a fine-tuned-style
    bi-encoder folder and a REALM retriever folder, with the tokenizer."""
    root = tmp_path_factory.mktemp("models")
    build_data_and_encoders(root, tiny_params())
    tok = load_tokenizer(root / paths.TOKENS / "tokenizer")
    enc = root / paths.MODELS / "retromae/encoder"
    BiEncoder(load_encoder(enc)).save_pretrained(root / "ft", tok, max_seq_length=48)
    torch.manual_seed(0)
    Retriever.from_encoder(enc, retriever_dim=16).save_pretrained(root / "realm_retriever", tok)
    torch.manual_seed(0)  # a fresh span head on the encoder, saved as finetune saves a system (reader/ + its config)
    OpenQA(None, SpanReader.from_pretrained(enc), max_answer_tokens=5).save_pretrained(root / "qa" / "bm25", tok)
    return {"encoder": enc, "ft": root / "ft", "realm": root / "realm_retriever", "reader": root / "qa" / "bm25" / "reader",
            "tok": tok}


@pytest.fixture
def server_params(mlflow_server, monkeypatch):
    monkeypatch.delenv(ENV_PARENT, raising=False)
    return tiny_params(**{"tracking.uri": mlflow_server.url, "tracking.experiment": f"rr-models-{uuid.uuid4().hex[:8]}"})


def _st_encode(path_or_model, texts=TEXTS):
    from sentence_transformers import SentenceTransformer

    model = path_or_model if not isinstance(path_or_model, (str, bytes)) and hasattr(path_or_model, "encode") \
        else SentenceTransformer(str(path_or_model), device="cpu")
    model.max_seq_length = 48
    return model.encode(texts)


def test_logged_models_have_flavors_load_back_and_are_outputs_of_their_run(folders, server_params):
    import mlflow

    with StageRun("finetune", server_params, ["finetune"]) as run:
        ft_id = log_model(run, folders["ft"], "ft-retromae-retriever", "sentence_transformers")
        realm_id = log_model(run, folders["realm"], "realm-retriever", "sentence_transformers")
        mlm_id = log_model(run, folders["encoder"], "retromae-encoder", "transformers", task="fill-mask", card=model_card)
    client = run.client
    exp = client.get_experiment_by_name(server_params.tracking.experiment)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    outputs = {o.model_id for o in client.get_run(run.run_id).outputs.model_outputs}
    assert outputs == {ft_id, realm_id, mlm_id}
    for model_id, flavor in ((ft_id, "sentence_transformers"), (realm_id, "sentence_transformers"), (mlm_id, "transformers")):
        lm = client.get_logged_model(model_id)
        assert lm.source_run_id == run.run_id and lm.tags.get("mlflow.modelFlavor", flavor) == flavor
        assert flavor in mlflow.models.get_model_info(f"models:/{model_id}").flavors

    # same embeddings after a round trip through the server (artifacts in S3)
    for model_id, folder in ((ft_id, folders["ft"]), (realm_id, folders["realm"])):
        loaded = mlflow.sentence_transformers.load_model(f"models:/{model_id}")
        np.testing.assert_allclose(_st_encode(loaded), _st_encode(folder), atol=1e-5)
    assert _st_encode(mlflow.sentence_transformers.load_model(f"models:/{realm_id}")).shape == (2, 16)  # the projection
    # the transformers flavor stores the card log_model hands it (flows/_model_card.py), not one from the hub
    card = mlflow.artifacts.download_artifacts(f"{client.get_logged_model(mlm_id).artifact_location}/model_card.md")
    assert open(card).read().startswith("# retromae-encoder\n\nLogged by retro-realm's `finetune` stage")
    parts = mlflow.transformers.load_model(f"models:/{mlm_id}", return_type="components")
    assert type(parts["model"]).__name__.endswith("ForMaskedLM")  # the fill-mask model, head included
    t = folders["tok"](TEXTS, padding=True, return_tensors="pt", return_token_type_ids=False)
    with torch.no_grad():
        got = cls_pool(parts["model"].eval(), t["input_ids"], t["attention_mask"])
        want = cls_pool(load_encoder(folders["encoder"]).eval(), t["input_ids"], t["attention_mask"])
    torch.testing.assert_close(got, want)


SHORT = "Aldmoor was founded by Kessa Varn."  # one window of the reader's passage length
CONTEXT = ("The city of Aldmoor was founded by Kessa Varn on the north bank of the Ardel river, "
           "where the old stone bridge still stands beside the market of the weavers.")


def test_reader_is_a_pyfunc_model_that_answers_with_a_span_of_the_context(folders, server_params):
    import mlflow
    import pandas as pd

    from components.data.qa_batch import QACollator

    with StageRun("finetune", server_params, ["finetune"], system_metrics=False) as run:
        model_id = log_model(run, folders["reader"], "qa-bm25-reader", "python_function")
    lm = run.client.get_logged_model(model_id)
    assert lm.source_run_id == run.run_id and model_id in {o.model_id for o in run.client.get_run(run.run_id).outputs.model_outputs}
    info = mlflow.models.get_model_info(f"models:/{model_id}")
    assert "python_function" in info.flavors and info.saved_input_example_info is not None
    assert [c.name for c in info.signature.inputs.inputs] == ["question", "context", "contexts"]
    assert [c.name for c in info.signature.outputs.inputs] == ["answer", "context_index", "start", "end", "score"]

    reader = mlflow.pyfunc.load_model(f"models:/{model_id}")  # artifacts through the server (S3)
    long = " ".join([CONTEXT] * 4)  # longer than finetune.passage_len: read as overlapping windows
    out = reader.predict(pd.DataFrame({"question": ["who founded aldmoor?", "where is the bridge?", "nothing to read"],
                                       "context": [SHORT, long, ""]}))
    for i, ctx in enumerate([SHORT, long]):
        row = out.iloc[i]
        assert row["answer"] and row["answer"] == ctx[row["start"]:row["end"]] and row["context_index"] == 0, row
    assert (out.iloc[2]["answer"], out.iloc[2]["start"]) == ("", -1)  # no context, no span
    many = reader.predict(pd.DataFrame({"question": ["who founded aldmoor?"], "contexts": [["", "the weavers' market", CONTEXT]]}))
    c = int(many.iloc[0]["context_index"])
    assert many.iloc[0]["answer"] == ["", "the weavers' market", CONTEXT][c][many.iloc[0]["start"]:many.iloc[0]["end"]]

    # the span the pipeline's reader picks for the same question and block
    ft = server_params.finetune
    collator = QACollator(folders["tok"], query_len=ft.query_len, passage_len=ft.passage_len, top_k=1, max_answer_tokens=5)
    local = OpenQA(None, SpanReader.from_pretrained(folders["reader"]), max_answer_tokens=5)
    assert len(folders["tok"](SHORT, add_special_tokens=False)["input_ids"]) <= ft.passage_len - 2
    assert out.iloc[0]["answer"] == local.predict("who founded aldmoor?", [{"text": SHORT}], None, collator)


def test_alias_tracks_the_latest_pipeline_runs_retriever(folders, server_params, monkeypatch):
    import mlflow

    t = server_params.tracking
    t = t.model_copy(update={"registry_name": f"rr-retriever-{uuid.uuid4().hex[:6]}"})
    server_params = server_params.model_copy(update={"tracking": t})
    ids = []
    for _ in range(2):  # two pipeline runs
        monkeypatch.setenv(ENV_PARENT, open_parent_run(server_params))
        with StageRun("finetune", server_params, ["finetune"]) as run:
            ids.append(log_model(run, folders["ft"], "ft-retromae-retriever", "sentence_transformers"))
            register(run, ids[-1])
    mv = run.client.get_model_version_by_alias(t.registry_name, t.registry_alias)
    assert ids[-1] in (mv.model_id, mv.source.removeprefix("models:/")), (mv.source, mv.model_id)
    assert mv.version == "2" and mv.tags["rr.pipeline_run"] == os.environ[ENV_PARENT]
    uri = f"models:/{t.registry_name}@{t.registry_alias}"  # the README's two lines
    model = mlflow.sentence_transformers.load_model(uri)
    np.testing.assert_allclose(_st_encode(model), _st_encode(folders["ft"]), atol=1e-5)


def test_eval_metrics_attach_to_the_model_they_measure(folders, server_params, monkeypatch):
    monkeypatch.setenv(ENV_PARENT, open_parent_run(server_params))
    with StageRun("finetune", server_params, ["finetune"]) as run:
        model_id = log_model(run, folders["ft"], "ft-retromae-retriever", "sentence_transformers")
    with StageRun("evaluate", server_params, ["evaluate"]) as ev:
        assert pipeline_models(ev) == {"ft-retromae-retriever": model_id}
        n = attach_metrics(ev, {"ft-retromae-retriever": {"test.ndcg_at_10": 0.5, "test.recall_at_20": 0.75},
                                "not-logged": {"test.ndcg_at_10": 0.1}}, dataset=("test_data", "abc123"))
    assert n == 2
    lm = ev.client.get_logged_model(model_id)
    got = {m.key: (m.value, m.run_id, m.dataset_name) for m in lm.metrics}
    assert got == {"test.ndcg_at_10": (0.5, ev.run_id, "test_data"), "test.recall_at_20": (0.75, ev.run_id, "test_data")}


def test_large_artifact_uploaded_to_a_server_referenced_in_the_embedded_store(tmp_path, server_params, monkeypatch):
    big = tmp_path / "weights"
    big.mkdir()
    (big / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(200_000))
    small_limit = {"large_artifact_mb": 0.1}  # 200 kB is "large" here
    params = server_params.model_copy(update={"tracking": server_params.tracking.model_copy(update=small_limit)})
    with StageRun("pretrain_retromae", params, system_metrics=False) as run:
        ref = run.log_artifact(big, "encoder")
    assert ref["uploaded"] and {a.path for a in run.client.list_artifacts(run.run_id, "encoder")} == {"encoder/model.safetensors"}

    monkeypatch.chdir(tmp_path)
    embedded = params.tracking.model_copy(update={"uri": f"sqlite:///{tmp_path}/mlflow.db"})
    with StageRun("pretrain_retromae", params.model_copy(update={"tracking": embedded}), system_metrics=False) as run:
        ref = run.log_artifact(big, "encoder")
    assert not ref["uploaded"] and ref["bytes"] == 200_000 and len(ref["md5"]) == 32 and ref["uri"].startswith("file://")
    asked = params.tracking.model_copy(update={"upload_large_artifacts": False})
    with StageRun("pretrain_retromae", params.model_copy(update={"tracking": asked}), system_metrics=False) as run:
        assert not run.log_artifact(big, "encoder")["uploaded"]  # references on request, also with a server


def test_refresh_run_holds_its_index_reference(tmp_path, server_params):
    folder = tmp_path / "index" / "v3"
    folder.mkdir(parents=True)
    (folder / "index.faiss").write_bytes(b"\0" * 1000)
    (folder / "meta.json").write_text("{}")
    with StageRun("pretrain_realm", server_params, ["realm"], system_metrics=False) as run:
        with run.child("refresh_index") as child:
            ref = child.log_index_version(folder, version=3, blocks=40)
    tags = run.client.get_run(child.run_id).data.tags
    assert tags["rr.index.sha256"] == ref["sha256"] and len(ref["sha256"]) == 64
    assert tags["rr.index.bytes"] == "1002" and tags["rr.index.blocks"] == "40" and tags["rr.index.version"] == "3"
    assert tags["rr.index.uri"] == folder.resolve().as_uri()
    assert "index_ref.json" in {a.path for a in run.client.list_artifacts(child.run_id)}


def test_stage_runs_log_system_metrics_also_when_shorter_than_one_sample(server_params):
    with StageRun("pretrain_retromae", server_params, ["retromae"]) as run:  # well under the 10 s interval
        pass
    keys = set(run.client.get_run(run.run_id).data.metrics)
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= keys, keys
    with StageRun("pretrain_retromae", server_params, ["retromae"]) as run:
        with run.child("refresh_index") as child:  # nested runs: the stage run samples the machine
            pass
    assert not any(k.startswith("system/") for k in run.client.get_run(child.run_id).data.metrics)


def test_the_reader_model_file_defines_its_class_without_mlflow_type_hint_warnings():
    """MLflow checks `predict`'s type hints when the class is created (every log and load of the model)
    and warns when there are none; the DataFrame hint gives it nothing to infer, so the logged signature
    stays the one schema, and the warning is gone."""
    import runpy
    import warnings
    from pathlib import Path

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runpy.run_path(str(Path(__file__).resolve().parents[1] / "flows" / "_reader_model.py"))
    assert not [str(w.message) for w in caught if "type hint" in str(w.message).lower()]
