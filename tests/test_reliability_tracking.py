"""Tracking server failures against a real `mlflow server` (tests/servers.py): down at stage start
(fail fast, naming the URL), down mid-run (training never waits; metrics arrive when it is back),
and down for good (metrics and the run's end land in a local JSONL that `replay` sends later)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest
import torch
from mlflow.entities import Metric

from components.config_shared import ComputeParams, TrainParams
from components.metric_buffer import MetricBuffer
from components.tracking import StageRun, _main, open_parent_run
from components.training import checkpoint as ckpt
from components.training.trainer import Trainer
from tests.conftest import tiny_params
from tests.scripts.tiny_train import TinyLM, make_rows, random_mask_collate


@pytest.fixture
def server(mlflow_server):
    if not mlflow_server.is_running():
        mlflow_server.start()
    yield mlflow_server
    mlflow_server.start()  # whatever a test did, the session's server is up afterwards


def _params(uri: str):
    return tiny_params(**{"tracking.uri": uri, "tracking.experiment": "reliability"})


def _history(client, run_id: str, key: str = "loss") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


# ----------------------------------------------------------------------------------------------
# (a) down at stage start: fail fast with the URL, no silent fallback
# ----------------------------------------------------------------------------------------------
def test_stage_start_fails_fast_naming_the_url_when_server_is_down(server, monkeypatch):
    p = tiny_params(**{"tracking.experiment": "reliability"})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)  # the way infra/env.sh points a shell at it
    with server.stopped():
        for start in (lambda: StageRun("tokenize", p, ["tokenize"]).__enter__(), lambda: open_parent_run(p)):
            t0 = time.monotonic()
            with pytest.raises(ConnectionError) as e:
                start()
            assert time.monotonic() - t0 < 5
            msg = str(e.value)
            assert f"MLflow tracking server {server.url} is not answering" in msg
            assert "MLFLOW_TRACKING_URI" in msg and "servers.sh up mlflow" in msg  # and how to fix it


def test_hanging_server_fails_at_start_within_the_health_timeout():
    with socket.socket() as srv:  # accepts connections, never answers
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=re.escape(url) + r".*timed out"):
            StageRun("tokenize", _params(url), ["tokenize"]).__enter__()
        assert time.monotonic() - t0 < 10


# ----------------------------------------------------------------------------------------------
# (b) down mid-run, then back
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow  # reason: stops and restarts the real MLflow server (~10 s per start on 2 cores)
def test_restart_mid_training_blocks_nothing_and_loses_no_metric(server, tmp_path):
    run = StageRun("pretrain_retromae", _params(server.url), ["retromae"], fallback_dir=tmp_path).__enter__()
    log_seconds: list[float] = []

    def log_fn(metrics, step):  # what the stage's RankZeroLogger does, timed
        t0 = time.perf_counter()
        run.log_metrics(metrics, step)
        log_seconds.append(time.perf_counter() - t0)

    def outage(step, trainer):
        if step == 5:
            server.stop()
            assert not server.healthy()
        if step == 20:
            # Let the flusher try (and fail) while the server is away. Not asserted: in the rare case
            # that a send was already in flight when the server died, MLflow's client is retrying
            # it (for minutes) and `failures` stays 0 until the server is back.
            deadline = time.monotonic() + 10
            while run.metrics.failures == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            server.start()

    train = TrainParams(batch_size=8, lr=3e-3, max_steps=30, checkpoint_every=10, keep_checkpoints=5)
    torch.manual_seed(0)
    trainer = Trainer(TinyLM(), make_rows(), random_mask_collate, train, ComputeParams(device="cpu", seed=1, precision="fp32"),
                      tmp_path / "train", log_fn=log_fn, hooks={"on_step_end": outage}, progress=False)
    result = trainer.fit()
    run.__exit__(None, None, None)

    assert result.step == 30
    assert max(log_seconds) < 0.1, max(log_seconds)  # logging never waited for the server
    assert run.metrics_lost == 0 and not (tmp_path / f".mlflow-unsent-{run.run_id}.jsonl").exists()
    client = server.client()
    assert _history(client, run.run_id) == list(range(1, 31))  # every step, exactly once
    assert client.get_run(run.run_id).info.status == "FINISHED"
    root = tmp_path / "train" / "checkpoints"
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [10, 20, 30]
    for _, path in ckpt.list_checkpoints(root):
        ckpt.verify_checkpoint(path)


# ----------------------------------------------------------------------------------------------
# (c) down for good: bounded exit, fallback JSONL, replay later
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow  # reason: stops and restarts the real MLflow server, and close() waits its 10 s for it
def test_server_gone_at_the_end_saves_metrics_and_end_status_then_replays(server, tmp_path):
    run = StageRun("pretrain_retromae", _params(server.url), ["retromae"], fallback_dir=tmp_path).__enter__()
    for step in range(1, 6):
        run.log_metrics({"loss": 1.0 / step, "lr": 0.1}, step)
    deadline = time.monotonic() + 15
    while run.metrics.sent < 10:
        assert time.monotonic() < deadline, "steps 1-5 never reached the server"
        time.sleep(0.1)

    server.stop()
    for step in range(6, 11):
        run.log_metrics({"loss": 1.0 / step, "lr": 0.1}, step)
    t0 = time.monotonic()
    run.__exit__(None, None, None)
    elapsed = time.monotonic() - t0
    # MLflow's own client would retry each call for ~4 minutes; the buffer's close waits its 10 s
    assert elapsed < 20, elapsed
    assert run.metrics_lost == 10
    fallback = tmp_path / f".mlflow-unsent-{run.run_id}.jsonl"
    rows = [json.loads(line) for line in fallback.read_text().splitlines()]
    assert sorted(r["step"] for r in rows if r.get("key") == "loss") == [6, 7, 8, 9, 10]
    assert {"run_id": run.run_id, "status": "FINISHED", "metrics_unsent": 10} in rows

    server.start()
    client = server.client()
    assert _history(client, run.run_id) == [1, 2, 3, 4, 5]
    assert client.get_run(run.run_id).info.status == "RUNNING"  # its end could not be recorded
    _main(["replay", str(fallback), "--uri", server.url])
    assert _history(client, run.run_id) == list(range(1, 11))
    after = client.get_run(run.run_id)
    assert after.info.status == "FINISHED" and after.data.tags["rr.metrics_replayed"] == "10"
    assert not fallback.exists()


# ----------------------------------------------------------------------------------------------
# the buffer itself: one sender at a time
# ----------------------------------------------------------------------------------------------
class _SlowClient:
    """The first log_batch hangs (a server that died mid-call) and then succeeds."""

    def __init__(self, hang: float):
        self.hang, self.calls, self.got = hang, 0, []

    def log_batch(self, run_id, metrics=(), synchronous=True):
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.hang)
        self.got.extend(metrics)


def test_close_never_sends_a_batch_twice_and_loses_nothing(tmp_path):
    client = _SlowClient(hang=1.5)
    buf = MetricBuffer(client, "run", flush_every=0.05, fallback_path=tmp_path / "unsent.jsonl")
    for step in range(20):
        buf.log({"loss": float(step)}, step)
    time.sleep(0.3)  # the flusher is now inside the hanging call
    lost = buf.close(timeout=0.5)  # gives up before the call returns
    buf._thread.join(timeout=5)  # let the hanging call finish
    sent = [m.step for m in client.got]
    assert len(sent) == len(set(sent))  # nothing sent twice
    saved = [json.loads(line)["step"] for line in (tmp_path / "unsent.jsonl").read_text().splitlines()] if lost else []
    assert set(sent) | set(saved) == set(range(20))  # at least once: delivered, or saved for replay


def test_probe_skips_sends_while_the_server_is_down():
    class Client:
        calls = 0

        def log_batch(self, *a, **k):
            Client.calls += 1

    up = threading.Event()
    buf = MetricBuffer(Client(), "run", flush_every=0.05, probe=up.is_set)
    buf.log({"loss": 1.0}, 1)
    time.sleep(0.3)
    assert Client.calls == 0 and buf.failures >= 1  # no call into a dead server (MLflow would retry it for minutes)
    up.set()
    assert buf.close(timeout=5) == 0 and Client.calls == 1


def test_replay_sends_each_metric_once_per_file(tmp_path):
    class Client:
        def __init__(self):
            self.batches, self.tags, self.ended = [], {}, {}

        def log_batch(self, run_id, metrics=(), synchronous=True):
            self.batches.append((run_id, list(metrics)))

        def set_tag(self, run_id, k, v):
            self.tags[(run_id, k)] = v

        def set_terminated(self, run_id, status):
            self.ended[run_id] = status

    f = tmp_path / ".mlflow-unsent-abc.jsonl"
    f.write_text("".join(json.dumps({"key": "loss", "value": v, "step": s, "timestamp": 1}) + "\n" for s, v in [(1, 0.5), (2, 0.4)])
                 + json.dumps({"run_id": "abc", "status": "FAILED", "metrics_unsent": 2}) + "\n")
    client = Client()
    import components.metric_buffer as mb

    real = mb.mlflow_client
    mb.mlflow_client = lambda uri: client
    try:
        assert mb.replay_unsent(f, "http://x") == 2
    finally:
        mb.mlflow_client = real
    (run_id, metrics), = client.batches
    assert run_id == "abc" and [(m.key, m.step, m.value) for m in metrics] == [("loss", 1, 0.5), ("loss", 2, 0.4)]
    assert isinstance(metrics[0], Metric) and client.ended == {"abc": "FAILED"} and client.tags[("abc", "rr.metrics_replayed")] == "2"
    assert not f.exists()
