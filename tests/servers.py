"""Real local servers for tests: S3 (moto_server), MLflow tracking, Prefect (+ a process worker).

Each one is the real process (the same commands as `infra/servers.sh`), bound to 127.0.0.1 on a
free port, with its state in a pytest tmp dir, in its own process group (so stopping it also stops
mlflow's uvicorn child). Session-scoped fixtures:

    s3_server       S3Server:      .url, .env, .client(), .buckets["dvc"|"mlflow"|"data"]
    mlflow_server   MLflowServer:  .url (tracking URI), .env (tracking + S3 vars), .client()
    prefect_server  PrefectServer: .url, .api_url, .env, .pool; a worker polls .pool

Use them from a test module with `pytest_plugins = ["tests.servers"]` (or from tests/conftest.py).
Every server has `start()` (idempotent), `stop()`, `kill()` (SIGKILL: a crash), `restart()` and
`with server.stopped(): ...` (down inside the block, back on the same port with the same store
after it, even when the block raises). Reliability tests take a server down and bring it back:

    def test_client_survives_restart(mlflow_server):
        run_id = ...
        with mlflow_server.stopped():
            ...                                 # the server is down here
        assert mlflow_server.client().get_run(run_id)

`.env` is what a client process needs (pass `env={**os.environ, **srv.env}` to subprocesses, or
`srv.patch_env(monkeypatch)` in a test). The S3 keys are moto's dummies, never real credentials.
Flow runs on the worker inherit the worker's env: give them MLflow/S3 through the deployment's
job variables (`{"env": mlflow_server.env}`), or build a `PrefectServer(..., worker_env=...)`.
moto keeps objects in memory: `stop()` snapshots every bucket to its tmp dir and `start()` restores
it, so objects survive a stop/start (not a `kill()`).

Startup on 2 cores, idle -> shared with other jobs (load 6-8): moto 0.4 -> 1.3 s (with buckets),
MLflow 8 -> 17-24 s, Prefect 10-12 -> 13-26 s including its worker (~6 s of that). Stops: < 2 s.
A server that exits or does not answer raises `ServerError` with the command and its log tail.
`RR_SERVER_START_TIMEOUT` (seconds) overrides every start timeout on slow machines.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOCALHOST = "127.0.0.1"

# Environment variables a server process must not inherit from the developer's shell: they would
# point it at another tracking server, API or cloud account.
_SCRUB = (
    "MLFLOW_TRACKING_URI", "MLFLOW_S3_ENDPOINT_URL", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME",
    "PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_PROFILE", "PREFECT_HOME",
    "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
)
MOTO_KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}  # moto's dummies


class ServerError(RuntimeError):
    """A server did not start (or stop); the message has the command and the log tail."""


def _tool(name: str) -> str:
    """A console script of the running interpreter's venv (then PATH)."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if (Path(d) / name).exists():
            return str(Path(d) / name)
    raise ServerError(f"{name!r} not found next to {sys.executable} or on PATH (run scripts/setup.sh)")


def free_port(host: str = LOCALHOST) -> int:
    """A port nobody listens on right now (the OS picks it; a race is retried by `start`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """(status, body); raises OSError when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_json(method: str, url: str, body=None, timeout: float = 10.0, retries: int = 3):
    """JSON request helper for REST APIs (Prefect).

    Retries 429/5xx (a loaded sqlite-backed server answers 503 "database is locked" now and then,
    and Prefect's own client retries those too); raises urllib.error.HTTPError otherwise, with the
    response body in its message.
    """
    data = None if body is None else json.dumps(body).encode()
    for attempt in range(retries + 1):
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
            return json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            detail = e.read()[:1000].decode(errors="replace")
            e.msg = f"{e.msg} ({method} {url}): {detail}"
            if (e.code == 429 or e.code >= 500) and attempt < retries:
                time.sleep(0.5 * 2**attempt)
                continue
            raise


def _load_s3_state():
    """infra/s3_state.py (bucket init + snapshot/restore), shared with infra/servers.sh."""
    spec = importlib.util.spec_from_file_location("rr_infra_s3_state", REPO / "infra" / "s3_state.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------
# one process group
# ---------------------------------------------------------------------------------------------
_LIVE: set["ProcessGroup"] = set()


@atexit.register
def _kill_leftovers() -> None:  # a crashed test run must not leave servers behind
    for group in list(_LIVE):
        group.kill()


class ProcessGroup:
    """A command in its own session (pgid == pid), logging to a file; stop/kill signal the group."""

    def __init__(self, name: str, log_path: Path):
        self.name, self.log_path = name, Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.cmd: list[str] = []
        self._start_offset = 0

    def spawn(self, cmd: list[str], env: dict[str, str], cwd: Path) -> None:
        self.cmd = cmd
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"===== {time.strftime('%F %T')} start: {shlex.join(cmd)}\n".encode())
            log.flush()
            self._start_offset = log.tell()  # log_tail() shows this start's lines only
            self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        _LIVE.add(self)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def exited(self) -> int | None:
        """The exit code when the leader has exited, else None."""
        return None if self.proc is None else self.proc.poll()

    def group_alive(self) -> bool:
        if self.proc is None:
            return False
        self.proc.poll()  # reap the leader so a zombie does not count as alive
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:  # pgid reused by someone else's process
            return False

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def _wait_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.group_alive():
                return True
            time.sleep(0.05)
        return not self.group_alive()

    def members(self) -> set[int]:
        """PIDs in the group (Linux /proc; elsewhere `ps`)."""
        if self.proc is None:
            return set()
        pgid, pids = self.proc.pid, set()
        if os.path.isdir("/proc/self"):
            for entry in os.listdir("/proc"):
                if entry.isdigit():
                    try:
                        stat = Path(f"/proc/{entry}/stat").read_text()
                    except OSError:
                        continue
                    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
                    if int(fields[2]) == pgid and fields[0] != "Z":
                        pids.add(int(entry))
            return pids
        out = subprocess.run(["ps", "-eo", "pid=,pgid="], capture_output=True, text=True).stdout
        return {int(p) for p, g in (l.split() for l in out.splitlines()) if int(g) == pgid}

    def stop(self, grace: float = 10.0, leader_is_wrapper: bool = False) -> None:
        """TERM the group; after `grace` a second TERM (Prefect's CLIs: "now"), then KILL.

        `leader_is_wrapper`: the leader only forwards signals to the real server (the `mlflow
        server` CLI and its uvicorn child). Once every child has exited, the leader has nothing
        left to flush but spends seconds in interpreter teardown: it is killed right away.
        """
        if self.proc is None:
            return
        if self.group_alive():
            self._signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while self.group_alive() and time.monotonic() < deadline:
                if leader_is_wrapper and self.members() <= {self.proc.pid}:
                    self._signal(signal.SIGKILL)
                time.sleep(0.05)
            if self.group_alive():
                self._signal(signal.SIGTERM)
                if not self._wait_gone(2.0):
                    self.kill()
        self._finish()

    def kill(self) -> None:
        if self.proc is None:
            return
        self._signal(signal.SIGKILL)
        self._wait_gone(5.0)
        self._finish()

    def _finish(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        _LIVE.discard(self)

    def log_tail(self, lines: int = 40, since_start: bool = True) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no log)"
        if since_start and self._start_offset <= len(data):
            data = data[self._start_offset:] or data
        return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


# ---------------------------------------------------------------------------------------------
# servers
# ---------------------------------------------------------------------------------------------
class LocalServer:
    """Base: a server process on 127.0.0.1:`port` with its state under `workdir`."""

    name = "server"
    health_path = "/"
    start_timeout = 60.0
    stop_grace = 10.0

    def __init__(self, workdir: str | os.PathLike, host: str = LOCALHOST, port: int | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.port = port
        self._port_fixed = port is not None  # after the first start the port never changes
        self.process = ProcessGroup(self.name, self.workdir / f"{self.name}.log")
        self.start_seconds: list[float] = []  # wall time of each start, for reports

    # -- subclass hooks --------------------------------------------------------------------------
    def command(self) -> list[str]:
        raise NotImplementedError

    def server_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _after_start(self) -> None:
        """Runs once the health URL answers (buckets, pools, workers)."""

    def _before_stop(self) -> None:
        """Runs before a graceful stop while the server still answers (snapshots)."""

    # -- public API ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def health_url(self) -> str:
        return self.url + self.health_path

    @property
    def env(self) -> dict[str, str]:
        """Environment variables a client needs to use this server."""
        return {}

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    def patch_env(self, monkeypatch) -> None:
        for k, v in self.env.items():
            monkeypatch.setenv(k, v)

    def is_running(self) -> bool:
        return self.process.group_alive() and self.process.exited() is None

    def healthy(self) -> bool:
        try:
            return http_get(self.health_url, timeout=2)[0] == 200
        except OSError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        return self.process.log_tail(lines)

    def start(self, timeout: float | None = None) -> "LocalServer":
        """Start (no-op when running) and wait for the health URL; same port as before."""
        if self.is_running():
            return self
        timeout = float(os.environ.get("RR_SERVER_START_TIMEOUT") or timeout or self.start_timeout)
        t0 = time.monotonic()
        attempts = 1 if self._port_fixed else 3
        for attempt in range(attempts):
            if not self._port_fixed:
                self.port = free_port(self.host)
            elif port_open(self.host, self.port):
                # On a restart the old process may still be closing its socket; on a first start
                # a pinned port that answers belongs to someone else: fail fast.
                self._wait_port_free(self.port, 10.0 if self.start_seconds else 1.0)
            self.process.spawn(self.command(), self.server_env(), cwd=self.workdir)
            try:
                self._wait_healthy(t0 + timeout)
                break
            except ServerError as e:
                # Another process may have taken the free port between bind and listen: retry.
                if attempt + 1 < attempts and "address already in use" in str(e).lower():
                    continue
                raise
        self._port_fixed = True
        try:
            self._after_start()
        except Exception:
            self.process.kill()
            raise
        self.start_seconds.append(round(time.monotonic() - t0, 2))
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Graceful stop of the whole process group (state kept for `start()`)."""
        if self.is_running() and self.healthy():
            self._before_stop()
        self.process.stop(self.stop_grace if timeout is None else timeout)

    def kill(self) -> None:
        """SIGKILL the whole process group: a crash (moto loses objects since the last stop)."""
        self.process.kill()

    def restart(self) -> "LocalServer":
        self.stop()
        return self.start()

    @contextlib.contextmanager
    def stopped(self):
        """`with server.stopped():` the server is down inside, back (same port, same store) after."""
        self.stop()
        try:
            yield self
        finally:
            self.start()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"<{type(self).__name__} {self.url} {state} starts={self.start_seconds}s>"

    # -- internals -------------------------------------------------------------------------------
    def _wait_port_free(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while port_open(self.host, port):
            if time.monotonic() > deadline:
                raise ServerError(f"{self.name}: port {port} on {self.host} is in use by another process")
            time.sleep(0.1)

    def _fail(self, why: str) -> ServerError:
        return ServerError(
            f"{self.name} {why}\n  command: {shlex.join(self.process.cmd)}\n  log: {self.log_path}\n"
            f"  --- last lines of the log ---\n{self.log_tail(40)}"
        )

    def _wait_healthy(self, deadline: float) -> None:
        t0 = time.monotonic()
        while True:
            code = self.process.exited()
            if code is not None:
                raise self._fail(f"exited with code {code} during startup (after {time.monotonic() - t0:.1f}s)")
            if self.healthy():
                return
            if time.monotonic() > deadline:
                err = self._fail(f"did not answer {self.health_url} within {time.monotonic() - t0:.0f}s")
                self.process.kill()
                raise err
            time.sleep(0.1)


class S3Server(LocalServer):
    """moto_server: an in-memory S3 endpoint, with buckets created on start."""

    name = "s3"
    health_path = "/moto-api/"
    start_timeout = 30.0
    stop_grace = 5.0

    def __init__(self, workdir, host: str = LOCALHOST, port: int | None = None,
                 buckets: dict[str, str] | None = None, persist: bool = True):
        super().__init__(workdir, host, port)
        self.buckets = buckets or {"dvc": "retro-realm-dvc", "mlflow": "retro-realm-mlflow", "data": "retro-realm-data"}
        self.persist = persist
        self.snapshot_dir = self.workdir / "snapshot"
        self._state = _load_s3_state()

    def command(self) -> list[str]:
        return [_tool("moto_server"), "-H", self.host, "-p", str(self.port)]

    @property
    def env(self) -> dict[str, str]:
        return {**MOTO_KEYS, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": self.url, "MLFLOW_S3_ENDPOINT_URL": self.url}

    def client(self):
        """A boto3 S3 client for this endpoint (moto's dummy keys)."""
        return self._state.s3_client(self.url, MOTO_KEYS["AWS_ACCESS_KEY_ID"], MOTO_KEYS["AWS_SECRET_ACCESS_KEY"])

    def _after_start(self) -> None:
        client = self.client()
        if self.persist:
            self._state.restore(client, self.snapshot_dir)
        self._state.ensure_buckets(client, self.buckets.values())

    def _before_stop(self) -> None:
        if self.persist:
            self._state.snapshot(self.client(), self.snapshot_dir)


class MLflowServer(LocalServer):
    """`mlflow server` with a sqlite backend in `workdir` and artifacts proxied to S3 (moto)."""

    name = "mlflow"
    health_path = "/health"
    start_timeout = 120.0

    def __init__(self, workdir, s3: S3Server, host: str = LOCALHOST, port: int | None = None,
                 backend_store_uri: str | None = None):
        super().__init__(workdir, host, port)
        self.s3 = s3
        self.backend_store_uri = backend_store_uri or f"sqlite:///{self.workdir / 'mlflow.db'}"
        self.artifacts_destination = f"s3://{s3.buckets['mlflow']}/"

    def command(self) -> list[str]:
        return [_tool("mlflow"), "server", "--host", self.host, "--port", str(self.port), "--workers", "1",
                "--backend-store-uri", self.backend_store_uri,
                "--artifacts-destination", self.artifacts_destination]

    def server_env(self) -> dict[str, str]:
        # No job runner: ~8 s startup instead of ~18 s, and no huey consumer processes.
        return {**super().server_env(), **self.s3.env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}

    @property
    def env(self) -> dict[str, str]:
        return {**self.s3.env, "MLFLOW_TRACKING_URI": self.url}

    def client(self):
        import mlflow

        return mlflow.MlflowClient(tracking_uri=self.url)

    def stop(self, timeout: float | None = None) -> None:
        # uvicorn (the child) shuts down gracefully in ~0.3 s; the CLI wrapper then needs ~3 s of
        # interpreter teardown, which is skipped.
        self.process.stop(self.stop_grace if timeout is None else timeout, leader_is_wrapper=True)


class PrefectServer(LocalServer):
    """`prefect server start` with its own PREFECT_HOME, plus a process worker on `pool`."""

    name = "prefect"
    health_path = "/api/health"
    start_timeout = 180.0

    def __init__(self, workdir, host: str = LOCALHOST, port: int | None = None,
                 pool: str = "retro-realm-process", worker: bool = True, ui: bool = False,
                 worker_env: dict[str, str] | None = None, worker_query_seconds: float | None = None):
        super().__init__(workdir, host, port)
        self.pool = pool
        self.with_worker = worker
        # How often the worker asks for scheduled runs (Prefect's default: 10 s). A flow run waits up
        # to this long before the worker picks it up.
        self.worker_query_seconds = worker_query_seconds
        self.ui = ui
        self.worker_env = dict(worker_env or {})
        self.worker_name = f"rr-test-worker-{os.getpid()}"
        self.worker = ProcessGroup("prefect-worker", self.workdir / "prefect-worker.log")
        self.home = self.workdir / "home"

    def command(self) -> list[str]:
        return [_tool("prefect"), "server", "start", "--host", self.host, "--port", str(self.port),
                "--ui" if self.ui else "--no-ui"]

    def server_env(self) -> dict[str, str]:
        return {**super().server_env(), "PREFECT_HOME": str(self.home),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}

    @property
    def api_url(self) -> str:
        return self.url + "/api"

    @property
    def env(self) -> dict[str, str]:
        return {"PREFECT_API_URL": self.api_url, "PREFECT_HOME": str(self.home)}

    # -- worker ----------------------------------------------------------------------------------
    def start_worker(self, timeout: float = 90.0) -> None:
        """Start `prefect worker start --pool POOL --type process` (creates the pool if missing)."""
        if self.worker.group_alive():
            return
        env = {**super().server_env(), **self.env, **self.worker_env}
        if self.worker_query_seconds is not None:
            env["PREFECT_WORKER_QUERY_SECONDS"] = str(self.worker_query_seconds)
        self.worker.spawn([_tool("prefect"), "worker", "start", "--pool", self.pool, "--type", "process",
                           "--name", self.worker_name], env, cwd=self.workdir)
        deadline = time.monotonic() + float(os.environ.get("RR_SERVER_START_TIMEOUT") or timeout)
        while not self.worker_online():
            if self.worker.exited() is not None:
                raise ServerError(f"prefect worker exited with code {self.worker.exited()}\n"
                                  f"  log: {self.worker.log_path}\n{self.worker.log_tail()}")
            if time.monotonic() > deadline:
                tail = self.worker.log_tail()
                self.worker.kill()
                raise ServerError(f"prefect worker not ONLINE on pool {self.pool!r} within {timeout:.0f}s\n"
                                  f"  log: {self.worker.log_path}\n{tail}")
            time.sleep(0.25)

    def stop_worker(self) -> None:
        # Prefect 3.9's worker ignores the first TERM when idle; the second one stops it.
        self.worker.stop(grace=3.0)

    def worker_online(self) -> bool:
        try:
            workers = http_json("POST", f"{self.api_url}/work_pools/{self.pool}/workers/filter", {})
        except (OSError, urllib.error.HTTPError):
            return False
        return any(w["name"] == self.worker_name and w["status"] == "ONLINE" for w in workers)

    def work_pool(self) -> dict:
        return http_json("GET", f"{self.api_url}/work_pools/{self.pool}")

    def _after_start(self) -> None:
        if self.with_worker:
            self.start_worker()

    def stop(self, timeout: float | None = None, worker: bool = True) -> None:
        """Stop the server; with `worker=False` the worker stays up (to test its reconnects)."""
        if worker:
            self.stop_worker()
        super().stop(timeout)

    def kill(self) -> None:
        self.worker.kill()
        super().kill()

    def start(self, timeout: float | None = None) -> "PrefectServer":
        super().start(timeout)
        if self.with_worker and not self.worker.group_alive():
            self.start_worker()
        return self


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> S3Server:
    server = S3Server(tmp_path_factory.mktemp("s3-server")).start()
    yield server
    server.persist = False  # nothing to keep at the end of the session
    server.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory, s3_server) -> MLflowServer:
    server = MLflowServer(tmp_path_factory.mktemp("mlflow-server"), s3=s3_server).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> PrefectServer:
    # The worker polls every 2 s, not 10: each deployment run in the suite starts sooner.
    server = PrefectServer(tmp_path_factory.mktemp("prefect-server"), worker_query_seconds=2.0).start()
    yield server
    server.stop()
