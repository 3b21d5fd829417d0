"""The tracking contract: one MLflow parent run per pipeline invocation, one child run per stage.

    with StageRun("tokenize", params, sections=["tokenize"]) as run:
        run.log_dataset("data/corpus", context="input")
        run.log_metrics({"tokens": 123})
        run.log_artifact("data/tokens/tokenize_card.json")

- Tracking URI: `tracking.uri` in params, else `$MLFLOW_TRACKING_URI`, else the embedded sqlite
  store in the repo (`tracking.embedded_uri`). No server is needed for the default. The URI, the
  client and the server's health probe are `tracking_server.py`.
- Parent run: `$RR_PARENT_RUN_ID` (set by `flows.pipeline`, which opens it). Without it, a stage run
  is a top-level run, so a stage can be run on its own.
- DDP ranks: the stage flow starts the run, exports `MLFLOW_RUN_ID`, and rank 0 resumes it with
  `StageRun.resume()`; other ranks never touch MLflow.
- Step metrics go through `MetricBuffer`, a background flusher: a slow or absent tracking server
  never blocks a training step, and metrics logged while it is down are flushed when it returns
  (or reported, and saved to a local JSONL, if it never does: `python -m components.tracking
  replay FILE` sends them, and the run's end status, once the server is back): `metric_buffer.py`.
- Tags on every run: git commit + dirty flag, the DVC stage, a params digest, the Prefect flow-run id.
- The experiment is tagged as model training (`mlflow.experimentKind`), so the MLflow UI opens it on
  the runs/models view, not the GenAI overview. Stage runs log system metrics (CPU, memory, GPU).
- Large artifacts: uploaded to the store of a tracking server; a URI + md5 + size reference only
  for the embedded store, or when `tracking.upload_large_artifacts` is false (`log_artifact`).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from components.config import Params
from components.io import tree_digest, write_json_atomic
from components.metric_buffer import MetricBuffer, metric_key, replay_unsent
from components.tracking_server import check_server, experiment_id, mlflow_client, server_reachable, tracking_uri, upload_large

log = logging.getLogger(__name__)

ENV_PARENT = "RR_PARENT_RUN_ID"
ENV_RUN = "MLFLOW_RUN_ID"
ENV_FLOW_RUN = "RR_PREFECT_FLOW_RUN_ID"
ENV_STAGE_PROCESS = "RR_STAGE_PROCESS"  # "forked": the stage server (flows/stage_server.py) started this process


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


# ----------------------------------------------------------------------------------------------
# stage run
# ----------------------------------------------------------------------------------------------
class StageRun:
    """An MLflow child run for one pipeline stage (or a nested run, e.g. one index refresh)."""

    system_metrics_interval = 10.0  # seconds between two samples of the machine

    def __init__(self, stage: str, params: Params, sections: list[str] | None = None, *, parent_run_id: str | None = None,
                 run_id: str | None = None, extra_tags: dict[str, str] | None = None, fallback_dir: str | os.PathLike = ".",
                 system_metrics: bool | None = None):
        self.stage, self.params, self.sections = stage, params, sections or []
        self.uri = tracking_uri(params)
        self.parent_run_id = parent_run_id if parent_run_id is not None else os.environ.get(ENV_PARENT)
        self.run_id = run_id
        self.extra_tags = extra_tags or {}
        self.fallback_dir = Path(fallback_dir)
        self.client = None
        self.metrics: MetricBuffer | None = None
        self.metrics_lost = 0
        self.fallback_path: Path | None = None
        self.system_metrics = system_metrics if system_metrics is not None else params.tracking.system_metrics
        self._monitor = None

    # -- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> "StageRun":
        check_server(self.uri)
        self.client = mlflow_client(self.uri)
        if self.run_id is None:
            exp_id = experiment_id(self.client, self.params.tracking.experiment)
            tags = {"rr.stage": self.stage, "dvc.stage": self.stage, **git_state(),
                    "rr.params_digest": self.params.section_digest(*self.sections) if self.sections else self.params.section_digest()}
            if os.environ.get(ENV_FLOW_RUN):
                tags["prefect.flow_run_id"] = os.environ[ENV_FLOW_RUN]
            tags["rr.stage_process"] = os.environ.get(ENV_STAGE_PROCESS, "cold")  # forked from the stage server, or not
            if self.parent_run_id:
                tags["mlflow.parentRunId"] = self.parent_run_id
            tags.update(self.extra_tags)
            run = self.client.create_run(exp_id, run_name=self.stage, tags=tags)
            self.run_id = run.info.run_id
            self._log_params()
        self.fallback_path = self.fallback_dir / f".mlflow-unsent-{self.run_id}.jsonl"
        self.metrics = MetricBuffer(self.client, self.run_id, fallback_path=self.fallback_path,
                                    probe=lambda: server_reachable(self.uri))
        if self.system_metrics:
            self._start_system_metrics()
        return self

    def _start_system_metrics(self) -> None:
        """MLflow's sampler (CPU, memory, disk, network; GPU through pynvml when present) as
        `system/*` metrics of this run, from this process (which also outlives torchrun's ranks)."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(self.run_id, sampling_interval=self.system_metrics_interval,
                                                 samples_before_logging=1, tracking_uri=self.uri)
            self._monitor.start()
        except Exception as e:  # noqa: BLE001 - psutil missing, ...: the run goes on without them
            log.warning("no system metrics for run %s: %s", self.run_id, e)
            self._monitor = None

    def _stop_system_metrics(self, timeout: float = 5.0) -> None:
        """Stop the sampler without ever blocking on a dead server (its thread may sit in MLflow's
        retries: it is a daemon, left behind), and log one sample for a run shorter than one interval."""
        mon, self._monitor = self._monitor, None
        try:
            mon._shutdown_event.set()
            if mon._process is not None:
                mon._process.join(timeout)
                if mon._process.is_alive() or not server_reachable(self.uri):
                    log.warning("system metrics of run %s not flushed: MLflow %s is not answering", self.run_id, self.uri)
                    return
            if mon._logging_step == 0:  # a short run: one sample, so every run has its system metrics
                mon.collect_metrics()
                mon.publish_metrics(mon.aggregate_metrics())
            mon.mlflow_logger.flush()
        except Exception as e:  # noqa: BLE001 - system metrics never fail a stage
            log.warning("system metrics of run %s: %s", self.run_id, e)

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("FINISHED" if exc_type is None else ("KILLED" if exc_type is KeyboardInterrupt else "FAILED"))

    def close(self, status: str = "FINISHED") -> None:
        if self._monitor is not None:
            self._stop_system_metrics()
        if self.metrics is not None:
            self.metrics_lost = self.metrics.close()
            self.metrics = None
        if not server_reachable(self.uri):
            # Not MLflow's ~4 minutes of retries per call: record the end locally and move on.
            if self.fallback_path is not None:
                self.fallback_path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.fallback_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"run_id": self.run_id, "status": status, "metrics_unsent": self.metrics_lost}) + "\n")
            log.error("MLflow %s is not answering: run %s stays RUNNING there; its end (%s) and %d unsent metrics "
                      "are in %s (`python -m components.tracking replay` it when the server is back)",
                      self.uri, self.run_id, status, self.metrics_lost, self.fallback_path)
            return
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
        return StageRun(name, self.params, [], parent_run_id=self.run_id, system_metrics=False,  # the stage run samples the machine
                        extra_tags={"rr.stage": self.stage, "dvc.stage": self.stage, "rr.kind": name, **(tags or {})}, fallback_dir=self.fallback_dir)

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
        self.client.log_batch(self.run_id, metrics=[Metric(metric_key(k), float(v), ts, step) for k, v in metrics.items()])

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
        """Upload small files/folders. A large one (over `tracking.large_artifact_mb`) is uploaded
        too when a tracking server is configured (its artifact store is where weights belong), and
        logged as a reference (URI + md5 + size) for the embedded store, or when
        `tracking.upload_large_artifacts: false` asks for references (`force_upload` overrides)."""
        path = Path(path)
        digest, n_files, size = tree_digest(path)
        ref = {"uri": path.resolve().as_uri(), "md5": digest, "bytes": size, "files": n_files}
        limit = self.params.tracking.large_artifact_mb * 1024 * 1024
        if force_upload or upload_large(self.params, self.uri) or size <= limit:
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

    def log_index_version(self, folder: str | os.PathLike, version: int, blocks: int) -> dict:
        """One published index version on this (refresh) run: URI, sha256, bytes, blocks as tags and
        `index_ref.json`; the files themselves stay where they are (checkpoints/index/vN)."""
        folder = Path(folder)
        digest, _, size = tree_digest(folder, "sha256")
        ref = {"uri": folder.resolve().as_uri(), "sha256": digest, "bytes": size, "blocks": int(blocks), "version": int(version)}
        self.set_tags({f"rr.index.{k}": v for k, v in ref.items()})
        self.log_dict(ref, "index_ref.json")
        return ref

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, obj, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)


def _dataset_input(ds, context: str):
    from mlflow.entities import DatasetInput, InputTag

    return DatasetInput(dataset=ds._to_mlflow_entity(), tags=[InputTag(key="mlflow.data.context", value=context)])


def prepare_store(params: Params) -> None:
    """Create the embedded store's database and the experiment now: a fresh sqlite store spends ~3 s
    on its schema, which a caller can overlap with other start-up work. A server needs nothing."""
    uri = tracking_uri(params)
    if uri.startswith("sqlite:"):
        experiment_id(mlflow_client(uri), params.tracking.experiment)


def open_parent_run(params: Params, name: str = "pipeline", tags: dict[str, str] | None = None) -> str:
    """Create the pipeline's parent run and return its id (callers export it as RR_PARENT_RUN_ID)."""
    uri = tracking_uri(params)
    check_server(uri)
    client = mlflow_client(uri)
    exp_id = experiment_id(client, params.tracking.experiment)
    run = client.create_run(exp_id, run_name=name, tags={"rr.kind": "pipeline", **git_state(),
                                                        "rr.params_digest": params.section_digest(), **(tags or {})})
    return run.info.run_id


def close_run(params: Params, run_id: str, status: str = "FINISHED") -> None:
    mlflow_client(tracking_uri(params)).set_terminated(run_id, status=status)


def latest_stage_run(client, experiment_ids: list[str], stage: str, status: str = "FINISHED"):
    """The newest run (by start time) of `stage` (its `dvc.stage` tag) with `status`, or None.
    Only stage runs count: their nested runs (a REALM `refresh_index`, tagged `rr.kind`) carry the
    same stage tag and start later, so they are filtered out in the query, not after a page of them."""
    found = client.search_runs(experiment_ids, f"tags.`dvc.stage` = '{stage}' and tags.`rr.kind` IS NULL "
                                               f"and attributes.status = '{status}'",
                               order_by=["attributes.start_time DESC"], max_results=1)
    return found[0] if found else None


def _main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m components.tracking", description="tracking utilities")
    sub = ap.add_subparsers(dest="cmd", required=True)
    rp = sub.add_parser("replay", help="send .mlflow-unsent-*.jsonl files left by runs whose server was down")
    rp.add_argument("files", nargs="+")
    rp.add_argument("--uri", default=None, help="tracking URI (default: $MLFLOW_TRACKING_URI, else the embedded store)")
    rp.add_argument("--keep", action="store_true", help="keep the files after sending")
    args = ap.parse_args(argv)
    for f in args.files:
        print(f"{f}: {replay_unsent(f, args.uri, delete=not args.keep)} metrics sent")


if __name__ == "__main__":
    _main()
