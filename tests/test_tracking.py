"""The tracking contract against the embedded MLflow store: parent/child runs, tags, datasets,
artifacts (small uploaded, large referenced), and buffered step metrics."""

import json
import time

import pytest
from mlflow.tracking import MlflowClient

from components.metric_buffer import MetricBuffer
from components.tracking import ENV_PARENT, StageRun, close_run, latest_stage_run, open_parent_run


@pytest.fixture(scope="module")
def db_uri(tmp_path_factory):
    # one store per module: creating an sqlite MLflow store runs its migrations (~5 s)
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


@pytest.fixture
def tracked(tmp_path, monkeypatch, params, db_uri):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = db_uri
    p = params.model_copy(update={"tracking": params.tracking.model_copy(update={"embedded_uri": uri, "large_artifact_mb": 0.001})})
    return p, MlflowClient(uri)


def test_parent_and_child_runs_with_contract_tags(tracked, tmp_path, monkeypatch):
    p, client = tracked
    parent = open_parent_run(p)
    monkeypatch.setenv(ENV_PARENT, parent)
    monkeypatch.setenv("RR_PREFECT_FLOW_RUN_ID", "flow-123")
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "a.txt").write_text("hello")
    with StageRun("tokenize", p, ["tokenize"]) as run:
        digest = run.log_dataset(data, name="corpus")
        run.log_metrics({"loss": 1.5}, step=1)
        run.log_metrics({"loss": 1.0}, step=2)
        run.log_metrics_now({"tokens": 42})
    close_run(p, parent)
    r = client.get_run(run.run_id)
    tags = r.data.tags
    assert tags["mlflow.parentRunId"] == parent and tags["dvc.stage"] == "tokenize"
    assert tags["prefect.flow_run_id"] == "flow-123"
    assert {"git.commit", "git.dirty", "rr.params_digest"} <= set(tags)
    assert r.data.params["tokenize.vocab_size"] == str(p.tokenize.vocab_size)
    assert r.data.metrics["tokens"] == 42
    assert [m.value for m in client.get_metric_history(run.run_id, "loss")] == [1.5, 1.0]
    assert r.inputs.dataset_inputs[0].dataset.digest == digest[:16]
    assert r.info.status == "FINISHED" and client.get_run(parent).info.status == "FINISHED"


def test_latest_stage_run_is_the_newest_finished_stage_run_not_a_nested_one(tracked):
    p, client = tracked
    p = p.model_copy(update={"tracking": p.tracking.model_copy(update={"experiment": "latest-stage-run"})})
    with StageRun("pretrain_realm", p, ["realm"], system_metrics=False) as older:
        pass
    time.sleep(0.01)  # start times are in milliseconds
    with StageRun("pretrain_realm", p, ["realm"], system_metrics=False) as newest:
        for _ in range(3):  # its refresh runs: same dvc.stage tag, started later
            with newest.child("refresh_index"):
                pass
    failed = StageRun("pretrain_realm", p, ["realm"], system_metrics=False).__enter__()
    failed.close("FAILED")
    exp = client.get_experiment_by_name("latest-stage-run").experiment_id
    assert latest_stage_run(client, [exp], "pretrain_realm").info.run_id == newest.run_id != older.run_id
    assert latest_stage_run(client, [exp], "pretrain_realm", status="FAILED").info.run_id == failed.run_id
    assert latest_stage_run(client, [exp], "tokenize") is None


def test_small_artifacts_upload_large_ones_are_referenced(tracked, tmp_path):
    p, client = tracked
    small, big = tmp_path / "small.json", tmp_path / "big.bin"
    small.write_text("{}")
    big.write_bytes(b"x" * 5000)  # over the 0.001 MB limit set in the fixture
    with StageRun("evaluate", p, ["evaluate"]) as run:
        assert run.log_artifact(small)["uploaded"] is True
        ref = run.log_artifact(big)
    assert ref["uploaded"] is False and ref["bytes"] == 5000 and len(ref["md5"]) == 32
    names = {a.path for a in client.list_artifacts(run.run_id)}
    assert "small.json" in names and "references" in names
    assert {a.path for a in client.list_artifacts(run.run_id, "references")} == {"references/big.bin.ref.json"}


def test_failed_stage_marks_run_failed(tracked):
    p, client = tracked
    with pytest.raises(RuntimeError):
        with StageRun("tokenize", p, ["tokenize"]) as run:
            raise RuntimeError("boom")
    assert client.get_run(run.run_id).info.status == "FAILED"


class _FlakyClient:
    """Fails the first `down` log_batch calls, like a tracking server that is briefly away."""

    def __init__(self, down):
        self.down, self.calls, self.got = down, 0, []

    def log_batch(self, run_id, metrics=(), synchronous=True):
        self.calls += 1
        if self.calls <= self.down:
            raise ConnectionError("server down")
        self.got.extend(metrics)


def test_metric_buffer_keeps_metrics_while_server_is_down():
    client = _FlakyClient(down=2)
    buf = MetricBuffer(client, "run", flush_every=0.05)
    for step in range(50):
        buf.log({"loss": float(step)}, step)  # never blocks, even while "down"
    lost = buf.close(timeout=5)
    assert lost == 0 and [m.step for m in client.got] == list(range(50))


def test_metric_buffer_saves_what_it_cannot_send(tmp_path):
    client = _FlakyClient(down=10**9)
    buf = MetricBuffer(client, "run", flush_every=0.05, fallback_path=tmp_path / "unsent.jsonl")
    buf.log({"loss": 1.0, "lr": 0.1}, 3)
    assert buf.close(timeout=0.5) == 2
    rows = [json.loads(l) for l in (tmp_path / "unsent.jsonl").read_text().splitlines()]
    assert sorted(r["key"] for r in rows) == ["loss", "lr"] and all(r["step"] == 3 for r in rows)


@pytest.mark.parametrize("fails", [False, True])
def test_torchrun_worker_rank0_resumes_the_stage_run_and_ends_it(tracked, monkeypatch, fails):
    """Rank 0 inside torchrun continues the flow's run (MLFLOW_RUN_ID), flushes its buffered
    metrics and ends the run: FINISHED, or FAILED when the body raises."""
    from components.stages import common

    p, client = tracked
    monkeypatch.setattr(common, "load_params", lambda path: p)
    monkeypatch.setenv("RANK", "0")

    def body(params, run):
        run.log_metrics({"loss": 0.5}, step=3)  # buffered: only the run's end sends it
        if fails:
            raise RuntimeError("boom")
        return {}

    with StageRun("finetune", p, ["finetune"]) as flow_run:
        monkeypatch.setenv("MLFLOW_RUN_ID", flow_run.run_id)
        if fails:
            with pytest.raises(RuntimeError, match="boom"):
                common.torchrun_worker("finetune", body)
        else:
            common.torchrun_worker("finetune", body)
        assert client.get_run(flow_run.run_id).info.status == ("FAILED" if fails else "FINISHED")
        assert [m.value for m in client.get_metric_history(flow_run.run_id, "loss")] == [0.5]


def test_a_curve_points_metric_name_is_one_mlflow_accepts(tracked):
    """evaluate logs one metric per row; a label-efficiency point (`ft:retromae@32`) has an `@`,
    which MLflow refuses: the name is mapped, in the synchronous and the buffered path alike."""
    p, client = tracked
    with StageRun("evaluate", p, ["evaluate"], system_metrics=False) as run:
        run.log_metrics_now({"main.ft:retromae@32.ndcg_at_10": 0.5})
        run.log_metrics({"main.ft:mlm@32.ndcg_at_10": 0.25}, step=1)
    got = client.get_run(run.run_id).data.metrics
    assert got["main.ft:retromae_at_32.ndcg_at_10"] == 0.5 and got["main.ft:mlm_at_32.ndcg_at_10"] == 0.25
