"""The tracking contract: one MLflow parent run per pipeline invocation, one child run per stage.

    with StageRun("tokenize", params, sections=["tokenize"]) as run:
        run.log_dataset("data/corpus", context="input")
        run.log_metrics({"tokens": 123})
        run.log_artifact("data/tokens/tokenize_card.json")

- Tracking URI: `tracking.uri` in params, else `$MLFLOW_TRACKING_URI`, else the embedded sqlite
  store in the repo (`tracking.embedded_uri`). No server is needed for the default.
- Parent run: `$RR_PARENT_RUN_ID` (set by `flows.pipeline`, which opens it). Without it, a stage run
  is a top-level run, so a stage can be run on its own.
- DDP ranks: the stage flow starts the run, exports `MLFLOW_RUN_ID`, and rank 0 resumes it with
  `StageRun.resume()`; other ranks never touch MLflow.
- Step metrics go through `MetricBuffer`, a background flusher: a slow or absent tracking server
  never blocks a training step, and metrics logged while it is down are flushed when it returns
  (or reported, and saved to a local JSONL, if it never does).
- Tags on every run: git commit + dirty flag, the DVC stage, a params digest, the Prefect flow-run id.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from components.config import Params
from components.io import tree_digest, write_json_atomic

log = logging.getLogger(__name__)

ENV_PARENT = "RR_PARENT_RUN_ID"
ENV_RUN = "MLFLOW_RUN_ID"
ENV_FLOW_RUN = "RR_PREFECT_FLOW_RUN_ID"


def tracking_uri(params: Params | None = None) -> str:
    if params is not None and params.tracking.uri:
        return params.tracking.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    embedded = params.tracking.embedded_uri if params is not None else "sqlite:///mlflow.db"
    return embedded


def git_state(cwd: str | os.PathLike = ".") -> dict[str, str]:
    def run(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    commit = run("rev-parse", "HEAD") or "unknown"
    # dvc-managed outputs and lock churn are not code changes; count tracked source changes only
    dirty = bool(run("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)dvc.lock"))
    return {"git.commit": commit, "git.dirty": str(dirty).lower()}


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def check_server(uri: str, timeout: float = 5.0) -> None:
    """Fail fast, with a clear message, when an http(s) tracking server does not answer.

    Chosen over a silent fallback to the embedded store: a run logged somewhere the user is not
    looking is worse than a stage that stops in seconds and says which URL to fix.
    """
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as r:
            if r.status == 200:
                return
            problem = f"HTTP {r.status}"
    except (urllib.error.URLError, OSError) as e:
        problem = str(getattr(e, "reason", e))
    raise ConnectionError(
        f"MLflow tracking server {uri} is not answering ({problem}). Start it (`bash infra/servers.sh up mlflow`), "
        f"fix MLFLOW_TRACKING_URI / tracking.uri, or unset both to use the embedded store ({Params().tracking.embedded_uri}).")


# ----------------------------------------------------------------------------------------------
# metric buffer
# ----------------------------------------------------------------------------------------------
class MetricBuffer:
    """Queue step metrics and send them from a background thread in batches.

    If the server is unreachable the batch is kept and retried with backoff; training never waits.
    `close()` makes a last attempt and returns how many metrics could not be sent; those are
    written to `fallback_path` (JSONL) so nothing is lost.
    """

    def __init__(self, client, run_id: str, flush_every: float = 2.0, fallback_path: str | os.PathLike | None = None):
        self.client, self.run_id, self.flush_every = client, run_id, flush_every
        self.fallback_path = Path(fallback_path) if fallback_path else None
        self._q: queue.Queue = queue.Queue()
        self._pending: list = []
        self._stop = threading.Event()
        self.failures = 0
        self.sent = 0
        self._thread = threading.Thread(target=self._loop, name="mlflow-metrics", daemon=True)
        self._thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        for k, v in metrics.items():
            self._q.put(Metric(key=k, value=float(v), timestamp=ts, step=int(step)))

    def _drain(self) -> None:
        while True:
            try:
                self._pending.append(self._q.get_nowait())
            except queue.Empty:
                return

    def _flush(self) -> bool:
        self._drain()
        while self._pending:
            batch = self._pending[:1000]  # MLflow's log_batch limit
            try:
                self.client.log_batch(self.run_id, metrics=batch, synchronous=True)
            except Exception as e:  # noqa: BLE001 - any transport error: keep the batch, retry later
                self.failures += 1
                if self.failures in (1, 10) or self.failures % 100 == 0:
                    log.warning("MLflow unreachable (%s); %d metrics buffered, will retry", type(e).__name__, len(self._pending))
                return False
            del self._pending[: len(batch)]
            self.sent += len(batch)
        return True

    def _loop(self) -> None:
        backoff = self.flush_every
        while not self._stop.wait(backoff):
            backoff = self.flush_every if self._flush() else min(backoff * 2, 30.0)

    def close(self, timeout: float = 10.0) -> int:
        self._stop.set()
        self._thread.join(timeout=timeout)
        deadline = time.time() + timeout
        while not self._flush() and time.time() < deadline:
            time.sleep(0.5)
        self._drain()
        lost = len(self._pending)
        if lost and self.fallback_path:
            self.fallback_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.fallback_path, "a", encoding="utf-8") as f:
                for m in self._pending:
                    f.write(json.dumps({"key": m.key, "value": m.value, "step": m.step, "timestamp": m.timestamp}) + "\n")
            log.error("%d metrics could not reach MLflow; saved to %s (replay with `python -m flows.replay_metrics`)", lost, self.fallback_path)
        return lost


# ----------------------------------------------------------------------------------------------
# stage run
# ----------------------------------------------------------------------------------------------
class StageRun:
    """An MLflow child run for one pipeline stage (or a nested run, e.g. one index refresh)."""

    def __init__(self, stage: str, params: Params, sections: list[str] | None = None, *, parent_run_id: str | None = None,
                 run_id: str | None = None, extra_tags: dict[str, str] | None = None, fallback_dir: str | os.PathLike = "."):
        self.stage, self.params, self.sections = stage, params, sections or []
        self.uri = tracking_uri(params)
        self.parent_run_id = parent_run_id if parent_run_id is not None else os.environ.get(ENV_PARENT)
        self.run_id = run_id
        self.extra_tags = extra_tags or {}
        self.fallback_dir = Path(fallback_dir)
        self.client = None
        self.metrics: MetricBuffer | None = None
        self.metrics_lost = 0

    # -- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> "StageRun":
        check_server(self.uri)
        self.client = _client(self.uri)
        if self.run_id is None:
            exp = self.client.get_experiment_by_name(self.params.tracking.experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(self.params.tracking.experiment)
            tags = {"rr.stage": self.stage, "dvc.stage": self.stage, **git_state(),
                    "rr.params_digest": self.params.section_digest(*self.sections) if self.sections else self.params.section_digest()}
            if os.environ.get(ENV_FLOW_RUN):
                tags["prefect.flow_run_id"] = os.environ[ENV_FLOW_RUN]
            if self.parent_run_id:
                tags["mlflow.parentRunId"] = self.parent_run_id
            tags.update(self.extra_tags)
            run = self.client.create_run(exp_id, run_name=self.stage, tags=tags)
            self.run_id = run.info.run_id
            self._log_params()
        self.metrics = MetricBuffer(self.client, self.run_id, fallback_path=self.fallback_dir / f".mlflow-unsent-{self.run_id}.jsonl")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("FINISHED" if exc_type is None else ("KILLED" if exc_type is KeyboardInterrupt else "FAILED"))

    def close(self, status: str = "FINISHED") -> None:
        if self.metrics is not None:
            self.metrics_lost = self.metrics.close()
            self.metrics = None
        try:
            if self.metrics_lost:
                self.client.set_tag(self.run_id, "rr.metrics_unsent", str(self.metrics_lost))
            self.client.set_terminated(self.run_id, status=status)
        except Exception as e:  # noqa: BLE001
            log.error("could not close MLflow run %s (%s); its status stays RUNNING", self.run_id, e)

    @classmethod
    def resume(cls, stage: str, params: Params) -> "StageRun":
        """Rank 0 inside torchrun: continue the stage run the flow opened (`$MLFLOW_RUN_ID`)."""
        return cls(stage, params, run_id=os.environ[ENV_RUN])

    def child(self, name: str, tags: dict[str, str] | None = None) -> "StageRun":
        """A nested run under this one (e.g. one REALM index refresh)."""
        return StageRun(name, self.params, [], parent_run_id=self.run_id,
                        extra_tags={"rr.stage": self.stage, "rr.kind": name, **(tags or {})}, fallback_dir=self.fallback_dir)

    # -- logging ------------------------------------------------------------------------------
    def _log_params(self) -> None:
        from mlflow.entities import Param

        flat = {}
        for s in self.sections:
            flat.update(flatten(getattr(self.params, s).model_dump(mode="json"), f"{s}."))
        flat.update(flatten(self.params.compute.model_dump(mode="json"), "compute."))
        items = [Param(k, json.dumps(v) if isinstance(v, (list, dict)) else str(v)[:6000]) for k, v in sorted(flat.items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        """Buffered, non-blocking (see MetricBuffer)."""
        self.metrics.log(metrics, step)

    def log_metrics_now(self, metrics: dict[str, float], step: int = 0) -> None:
        """Synchronous: for end-of-stage summary numbers that must be there when the stage ends."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ts, step) for k, v in metrics.items()])

    def set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, str(v))

    def log_dataset(self, path: str | os.PathLike, name: str | None = None, context: str = "input") -> str:
        """`mlflow.log_input` of a folder or file, with its md5 digest. Returns the digest."""
        import warnings

        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.data.meta_dataset import MetaDataset

        path = Path(path)
        digest, n_files, size = tree_digest(path)
        with warnings.catch_warnings():  # "can be interpreted in multiple ways": both are local-file sources
            warnings.simplefilter("ignore")
            source = resolve_dataset_source(str(path.resolve()))
        ds = MetaDataset(source=source, name=name or path.name, digest=digest[:16])
        self.client.log_inputs(self.run_id, datasets=[_dataset_input(ds, context)])
        self.client.set_tag(self.run_id, f"rr.data.{name or path.name}.md5", digest)
        return digest

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None, force_upload: bool = False) -> dict:
        """Upload small files/folders; log a large one as a reference (URI + md5 + size) unless
        `tracking.upload_large_artifacts` (or `force_upload`) says to upload it anyway."""
        path = Path(path)
        digest, n_files, size = tree_digest(path)
        ref = {"uri": path.resolve().as_uri(), "md5": digest, "bytes": size, "files": n_files}
        limit = self.params.tracking.large_artifact_mb * 1024 * 1024
        if force_upload or self.params.tracking.upload_large_artifacts or size <= limit:
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), artifact_path or path.name)
            else:
                self.client.log_artifact(self.run_id, str(path), artifact_path)
            ref["uploaded"] = True
        else:
            with tempfile.TemporaryDirectory() as tmp:
                ref_file = Path(tmp) / f"{path.name}.ref.json"
                write_json_atomic(ref_file, ref)
                self.client.log_artifact(self.run_id, str(ref_file), artifact_path or "references")
            ref["uploaded"] = False
        return ref

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, obj, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)


def _dataset_input(ds, context: str):
    from mlflow.entities import DatasetInput, InputTag

    return DatasetInput(dataset=ds._to_mlflow_entity(), tags=[InputTag(key="mlflow.data.context", value=context)])


def open_parent_run(params: Params, name: str = "pipeline", tags: dict[str, str] | None = None) -> str:
    """Create the pipeline's parent run and return its id (callers export it as RR_PARENT_RUN_ID)."""
    uri = tracking_uri(params)
    check_server(uri)
    client = _client(uri)
    exp = client.get_experiment_by_name(params.tracking.experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(params.tracking.experiment)
    run = client.create_run(exp_id, run_name=name, tags={"rr.kind": "pipeline", **git_state(),
                                                        "rr.params_digest": params.section_digest(), **(tags or {})})
    return run.info.run_id


def close_run(params: Params, run_id: str, status: str = "FINISHED") -> None:
    _client(tracking_uri(params)).set_terminated(run_id, status=status)
