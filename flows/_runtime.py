"""Shared plumbing for the stage flows: params, the local Prefect API, run tags.

Flows stay thin: `flows._stage.run_stage` opens the stage's MLflow run, calls `components/` and
logs; training flows launch their body through `flows._torchrun.run_training`; the DAG's folders
come from `components.paths`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

from components.config import Params, load_params
from components.quiet_logs import quiet_third_party_logs

# dvc.yaml's stages; a foreach / matrix group (pretrain_realm, finetune_*) names all its `<group>@<item>` stages
STAGES = ["prepare_corpus", "tokenize", "pretrain_retromae", "pretrain_mlm", "pretrain_realm", "finetune_retriever",
          "finetune_reader", "evaluate"]

log = logging.getLogger("retro_realm")

# The loggers whose INFO lines (training progress, stage notes, logged models) a flow run forwards.
LIBRARY_LOGGERS = ("components", "flows")


class _InRunOnly(logging.Filter):
    """Only records emitted inside a flow or task run go to the API (no "missing flow run" warnings
    from library lines logged outside one, e.g. by a background flusher thread)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from prefect.context import FlowRunContext, TaskRunContext

        return bool(getattr(record, "flow_run_id", None) or FlowRunContext.get() or TaskRunContext.get())


def forward_library_logs(names: tuple[str, ...] = LIBRARY_LOGGERS) -> None:
    """Send the library's INFO log lines to the console and to the Prefect flow-run log.

    What PREFECT_LOGGING_EXTRA_LOGGERS does (Prefect's API log handler on each name), also when the
    variable was not set before Prefect configured logging, plus the INFO level: under Prefect's
    root logger (WARNING) the progress lines would be dropped. The console copy comes from the
    root's handler, which the lines still propagate to. Idempotent.
    """
    from prefect.logging.handlers import APILogHandler

    for name in names:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET or logger.level > logging.INFO:
            logger.setLevel(logging.INFO)
        if not any(isinstance(h, APILogHandler) for h in logger.handlers):
            handler = APILogHandler()
            handler.addFilter(_InRunOnly())
            logger.addHandler(handler)


forward_library_logs()
quiet_third_party_logs()  # transformers' per-load bars and expected load reports: components/quiet_logs.py


def flush_api_logs(timeout: float = 10.0) -> None:
    """Send the log lines still queued for the Prefect API and stop its log workers (a new line
    starts one again). Before a local API stops: the run's last lines reach its flow-run log, and no
    batch is left to fail at interpreter exit, where the failure is printed through a console
    handler whose stream is closed by then (pytest's capture): "I/O operation on closed file"."""
    from prefect.logging.handlers import APILogWorker

    try:
        APILogWorker.drain_all(timeout=timeout, at_exit=False)
    except Exception as e:  # noqa: BLE001 - never fail a finished run over its last log lines
        log.warning("could not flush the Prefect API logs: %s: %s", type(e).__name__, e)


def params_from_env() -> Params:
    return load_params(os.environ.get("RR_PARAMS", "params.yaml"))


def prefect_tags() -> dict[str, str]:
    """Prefect's flow-run id for MLflow tags; also exported so torchrun ranks inherit it."""
    try:
        from prefect.runtime import flow_run

        fid = flow_run.get_id()
    except Exception:  # noqa: BLE001 - outside a flow run
        fid = None
    if fid:
        os.environ["RR_PREFECT_FLOW_RUN_ID"] = str(fid)
        return {"prefect.flow_run_id": str(fid)}
    return {}


WORKSPACE_QUEUE = "retro-realm-workspace"


def workspace_queue(pool: str, name: str = WORKSPACE_QUEUE, limit: int = 1) -> dict:
    """prefect.yaml's build step: the work queue every deployment of this workspace is on, with
    `limit` concurrency slot(s). One checkout holds one DVC repo lock, so a second pipeline or stage
    run stays SCHEDULED until the first ends (the worker does not pick it up) instead of failing on
    the lock mid-run. Created when missing, its limit reset when present. Returns {"work_queue": name}.
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            queue = client.read_work_queue_by_name(name, work_pool_name=pool)
        except ObjectNotFound:
            client.create_work_queue(name, work_pool_name=pool, concurrency_limit=limit,
                                     description="one retro-realm run per workspace (DVC's repo lock)")
        else:
            if queue.concurrency_limit != limit:
                client.update_work_queue(queue.id, concurrency_limit=limit)
    return {"work_queue": name}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


# How long a server this project starts on the machine (the local Prefect API here; infra/servers.sh's
# MLflow, Prefect and S3) may take to answer. ~12 s on 2 idle cores; the default holds under load.
START_TIMEOUT = "RR_START_TIMEOUT"
START_TIMEOUT_DEFAULT = 120.0


def start_timeout() -> float:
    """$RR_START_TIMEOUT in seconds, else the default."""
    raw = os.environ.get(START_TIMEOUT, "").strip()
    if not raw:
        return START_TIMEOUT_DEFAULT
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{START_TIMEOUT}={raw!r}: expected a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{START_TIMEOUT}={raw!r}: expected a positive number of seconds")
    return value


def stop_process_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the process group that `proc` leads (started with start_new_session=True), SIGKILL it
    after `grace` seconds, and reap `proc`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def prefect_server_command(port: int) -> list[str]:
    """The local Prefect API's command line (tests swap it for one that never answers)."""
    return [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-services"]


@contextlib.contextmanager
def local_prefect_api(home: str | os.PathLike = ".prefect", meanwhile: Callable[[], None] | None = None) -> Iterator[str | None]:
    """One local Prefect API for a whole pipeline run, shared by every stage process.

    Without PREFECT_API_URL each stage process would start its own ephemeral API (15-25 s each on
    2 cores). Here the pipeline starts `prefect server start` once (own process group, 127.0.0.1,
    free port, state in `.prefect/`), exports PREFECT_API_URL to its children, and stops it at the
    end. If PREFECT_API_URL is already set (a real server / work pool), it is used as is.
    It may take $RR_START_TIMEOUT seconds (default 120) to answer; the error says so when it does not.

    `meanwhile()` runs while the API starts (~10 s on 2 cores, most of it the schema of a fresh
    database), with PREFECT_API_URL and PREFECT_HOME already exported: start-up work that needs no
    API answer (flows.pipeline's stage server and tracking store).
    """
    if os.environ.get("PREFECT_API_URL"):
        if meanwhile is not None:
            meanwhile()
        yield os.environ["PREFECT_API_URL"]
        return
    timeout = start_timeout()
    home = Path(home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "false", "PREFECT_SERVER_API_HOST": "127.0.0.1"}
    server_log = home / "server.log"
    logf = open(server_log, "ab")
    proc = subprocess.Popen(prefect_server_command(port), env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.monotonic()
    try:
        os.environ["PREFECT_API_URL"] = url  # the stage processes'
        os.environ["PREFECT_HOME"] = str(home)
        if meanwhile is not None:
            meanwhile()
        while not _healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"the local Prefect API (`prefect server start`) exited with code {proc.returncode} "
                                   f"before it answered; log {server_log}:\n{_tail(server_log)}")
            if time.monotonic() - t0 > timeout:
                knob = f"{START_TIMEOUT}={os.environ[START_TIMEOUT]}" if os.environ.get(START_TIMEOUT) else f"{START_TIMEOUT} unset"
                raise RuntimeError(
                    f"the local Prefect API did not answer at {url} within {timeout:g} s ({knob}). On a busy machine "
                    f"raise {START_TIMEOUT} (e.g. `export {START_TIMEOUT}=600`), or point PREFECT_API_URL at a "
                    f"running server (`make servers-up`). Log {server_log}:\n{_tail(server_log)}")
            time.sleep(0.3)
        log.info("local Prefect API at %s (ready in %.1fs)", url, time.monotonic() - t0)
        # and this process's: Prefect read its settings at import, so without this the pipeline's
        # own flow run would start Prefect's ephemeral API (~11 s) and be recorded there, not here
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: url}):
            try:
                yield url
            finally:
                flush_api_logs()  # while the API still answers, and this process's settings name it
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        stop_process_group(proc, grace=15)
        logf.close()
