"""The stage server (flows/stage_server.py) runs a stage as `python -m MODULE` would, in a child it
forks, and the client (flows/stage_client.py) gives DVC the same process contract: argv, cwd,
environment, stdio, exit status and signals. Whatever it cannot serve runs cold.

Real processes and a real Unix socket; the served module is a small stand-in package so that each
test takes a second (the real stages are served in the end-to-end pipeline test).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.stage_server import RUNTIME_ENV, env_difference

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "flows" / "stage_client.py"

MODULE = """
import json, os, signal, sys, time
import numpy


def main():
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "pid": os.getpid(), "ppid": os.getppid(),
                      "stage": os.environ.get("DVC_STAGE"), "do_not_track": os.environ.get("DO_NOT_TRACK"),
                      "rand": float(numpy.random.random()), "main": __name__,
                      "sighup_ignored": signal.getsignal(signal.SIGHUP) is signal.SIG_IGN}), flush=True)
    print("a line on stderr", file=sys.stderr, flush=True)
    if "--raise" in sys.argv:
        raise ValueError("boom in the stage")
    if "--sleep" in sys.argv:
        time.sleep(60)
    sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]) if "--exit" in sys.argv else 0)


if __name__ == "__main__":
    main()
"""


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "hello.py").write_text(MODULE)
    return tmp_path


def _env(**extra) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "RR_PYTHON": sys.executable, "RR_ALLOCATOR": "system"}  # scripts/py's: the same for server and stages
    return {**env, **extra}


@pytest.fixture
def server(workdir, request):
    """A server for `pkg.*` in `workdir` (it preloads `json`, `numpy.random` and the stage module itself, as the real server preloads the
    stage flows: the mechanism, not the speed); indirect parametrisation adds variables to its environment."""
    sock = workdir / "server.sock"
    proc = subprocess.Popen([sys.executable, "-m", "flows.stage_server", "--socket", str(sock), "--preload", "json", "numpy.random", "pkg.hello",
                             "--modules", "pkg."], cwd=workdir, env=_env(**getattr(request, "param", {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    while not sock.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() - t0 < 60, "the stage server did not come up"
        time.sleep(0.05)
    yield proc, sock
    proc.terminate()
    proc.wait(timeout=30)


def _client(workdir, sock, *args, env=None, **kw) -> subprocess.Popen:
    env = env if env is not None else _env()
    return subprocess.Popen([sys.executable, "-I", str(CLIENT), "-m", "pkg.hello", *args], cwd=workdir,
                            env={**env, "RR_STAGE_SERVER": str(sock)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def _run(workdir, sock, *args, env=None, **kw) -> tuple[int, dict, str, int]:
    proc = _client(workdir, sock, *args, env=env, **kw)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, json.loads(out.splitlines()[0]), err, proc.pid


def test_a_served_stage_is_a_forked_child_with_the_clients_argv_env_stdio_and_status(workdir, server):
    proc, sock = server
    # SIGHUP at its default in the client, even when the tests run under `nohup` (the next test covers the ignored case)
    rc, seen, err, client_pid = _run(workdir, sock, "--item", "a b", "--exit", "3", env=_env(DVC_STAGE="tokenize"),
                                     preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    assert seen["ppid"] == proc.pid, "not served: the module did not run in a child of the server"
    assert (rc, seen["argv"], seen["stage"], seen["main"]) == (3, ["--item", "a b", "--exit", "3"], "tokenize", "__main__")
    assert Path(seen["cwd"]) == workdir
    assert seen["do_not_track"] == "true"  # what importing `flows` sets, as in a fresh process
    assert err.strip() == "a line on stderr"  # no runpy warning about the preloaded copy of the module
    assert not seen["sighup_ignored"]


def test_each_child_draws_fresh_randomness(workdir, server):
    _, sock = server
    draws = {_run(workdir, sock)[1]["rand"] for _ in range(3)}
    assert len(draws) == 3, "forked children share the server's numpy random state"


def test_an_exception_in_the_stage_exits_1_with_its_traceback(workdir, server):
    _, sock = server
    rc, seen, err, _ = _run(workdir, sock, "--raise")
    assert seen["ppid"] == server[0].pid
    assert rc == 1 and "ValueError: boom in the stage" in err and "Traceback" in err


def test_an_environment_the_imports_did_not_see_runs_cold(workdir, server):
    proc, sock = server
    rc, seen, err, client_pid = _run(workdir, sock, env=_env(OMP_NUM_THREADS="2"))
    assert rc == 0 and seen["pid"] == client_pid and seen["ppid"] != proc.pid  # the client exec'd python -m
    assert "differs from the server's in OMP_NUM_THREADS" in err


@pytest.mark.parametrize("server", [{"_MLFLOW_TELEMETRY_SESSION_ID": "3f2a"}], indirect=True)
def test_mlflows_telemetry_session_in_one_environment_only_is_still_served(workdir, server):
    """A caller that imported MLflow with telemetry on passes the server its session id; the stages' own
    MLflow import, with telemetry off, drops it before DVC starts their clients."""
    proc, sock = server
    rc, seen, err, _ = _run(workdir, sock)
    assert rc == 0 and seen["ppid"] == proc.pid, err


def test_no_server_runs_cold(workdir):
    rc, seen, err, client_pid = _run(workdir, workdir / "absent.sock", "--exit", "4")
    assert (rc, seen["pid"]) == (4, client_pid)
    assert "not ready yet" in err


def test_a_signal_to_the_client_reaches_the_stage(workdir, server):
    proc, sock = server
    client = _client(workdir, sock, "--sleep")
    seen = json.loads(client.stdout.readline())
    assert seen["ppid"] == proc.pid
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=30) == 128 + signal.SIGTERM
    _wait_gone(seen["pid"])


def test_a_killed_client_takes_its_stage_down(workdir, server):
    proc, sock = server
    client = _client(workdir, sock, "--sleep")
    seen = json.loads(client.stdout.readline())
    client.kill()  # SIGKILL: no forwarding; the server sees the connection close
    client.wait(timeout=30)
    _wait_gone(seen["pid"])


def _wait_gone(pid: int, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"stage process {pid} still runs")


def test_scripts_py_sends_module_commands_to_the_server(workdir, server):
    proc, sock = server
    env = {**_env(), "RR_STAGE_SERVER": str(sock)}
    out = subprocess.run([str(ROOT / "scripts" / "py"), "-m", "pkg.hello"], cwd=workdir, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[0])["ppid"] == proc.pid, out.stderr
    off = subprocess.run([str(ROOT / "scripts" / "py"), "-m", "pkg.hello"], cwd=workdir,
                         env={**env, "RR_STAGE_SERVER": "off"}, capture_output=True, text=True, timeout=60)
    assert json.loads(off.stdout.splitlines()[0])["ppid"] != proc.pid


def test_env_difference_ignores_what_is_read_at_run_time_only():
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    runtime = {k: "x" for k in RUNTIME_ENV} | {"DVC_ROOT": "/r", "DVC_STAGE": "s"}
    assert env_difference(base, {**base, **runtime}) == []
    assert env_difference({**base, "_MLFLOW_TELEMETRY_SESSION_ID": "a1"}, base) == []  # MLflow's own, unset on import
    assert env_difference(base, {**base, "OMP_NUM_THREADS": "2", "PREFECT_API_URL": "u"}) == ["OMP_NUM_THREADS", "PREFECT_API_URL"]
    assert env_difference(base, {"PATH": "/bin"}) == ["OMP_NUM_THREADS"]


def test_a_server_that_runs_a_thread_refuses_to_fork(workdir):
    """A fork copies only the forking thread: a lock another thread held stays locked in the child.
    A server whose imports started a thread (here: one that never ends) runs every stage cold."""
    sock = workdir / "threaded.sock"
    (workdir / "spawner.py").write_text("import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n")
    proc = subprocess.Popen([sys.executable, "-m", "flows.stage_server", "--socket", str(sock), "--preload", "spawner",
                             "--modules", "pkg."], cwd=workdir, env={**_env(), "PYTHONPATH": f"{ROOT}:{workdir}"})
    try:
        t0 = time.monotonic()
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() - t0 < 60
            time.sleep(0.05)
        rc, seen, err, client_pid = _run(workdir, sock, env={**_env(), "PYTHONPATH": f"{ROOT}:{workdir}"})
        assert rc == 0 and seen["pid"] == client_pid
        assert "runs threads" in err
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_preloaded_libraries_leave_only_fork_safe_threads():
    """The stages' real libraries (`PRELOAD`): importing them leaves no thread that would make the
    server refuse (pyarrow's jemalloc purger is the one named exception)."""
    code = ("import importlib\nfrom flows.stage_server import PRELOAD, unsafe_threads\n"
            "for name in PRELOAD:\n    importlib.import_module(name)\nprint(unsafe_threads())")
    env = {k: v for k, v in _env().items() if k != "OMP_NUM_THREADS"}  # as `make run` starts it: BLAS pools start
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_signal_the_client_ignores_stays_ignored_in_the_stage(workdir, server):
    """`nohup dvc repro`: a fresh stage process inherits SIGHUP ignored; so does a served one."""
    proc, sock = server
    client = _client(workdir, sock, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    out, err = client.communicate(timeout=60)
    seen = json.loads(out.splitlines()[0])
    assert seen["ppid"] == proc.pid and seen["sighup_ignored"], (seen, err)


def test_the_pipeline_starts_its_stage_server_and_tracking_store_while_the_prefect_api_starts(monkeypatch):
    """`python -m flows.pipeline`: the stage server and the MLflow store's tables start inside
    `local_prefect_api(meanwhile=)`, so the flow finds the server running and starts no second one.
    `--only` starts none early, and a run that sets `tracking.*` leaves the store to its parent run.
    The flow's own run id, which the flow exports after the server started, is read at run time."""
    import contextlib

    import flows.pipeline as fp
    from flows.stage_server import ENV_SERVER

    events = []

    @contextlib.contextmanager
    def api(meanwhile=None):
        events.append("api starting")
        meanwhile()
        events.append("api ready")
        yield "http://127.0.0.1:1/api"

    @contextlib.contextmanager
    def server(env):
        events.append("stage server")
        monkeypatch.setenv(ENV_SERVER, "/tmp/rr-test/server.sock")
        yield "/tmp/rr-test/server.sock"
        monkeypatch.delenv(ENV_SERVER)

    monkeypatch.delenv(ENV_SERVER, raising=False)
    monkeypatch.setattr(fp, "local_prefect_api", api)
    monkeypatch.setattr(fp, "stage_server", server)
    monkeypatch.setattr(fp, "prepare_store", lambda params: events.append("tracking store"))
    monkeypatch.setattr(fp, "pipeline", lambda **kw: events.append(("flow", fp.stage_server_running())))
    fp.main([])
    assert events == ["api starting", "stage server", "tracking store", "api ready", ("flow", True)]
    assert ENV_SERVER not in os.environ  # stopped after the flow
    events.clear()
    fp.main(["--only", "tokenize", "--set", "tracking.uri=http://127.0.0.1:5000"])
    assert events == ["api starting", "api ready", ("flow", False)]
    assert "RR_PREFECT_FLOW_RUN_ID" in RUNTIME_ENV


def _stand_in_server(tmp_path):
    """A listening socket that plays the server by hand, so a test can hold its reply back."""
    sock_path = tmp_path / "s.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    listener.listen(1)
    return listener, sock_path


def _take_request(conn) -> None:
    _, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    for fd in fds:
        os.close(fd)


def test_a_signal_before_the_stages_pid_arrives_is_forwarded_not_fatal(tmp_path):
    """The stage may print before the server's reply with its pid reaches the client: a SIGTERM in that
    window must reach the stage once the pid arrives instead of killing the client (the stand-in server
    holds the reply back until the signal was sent, so the window is hit every time)."""
    listener, sock_path = _stand_in_server(tmp_path)
    stage = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    client = _client(tmp_path, sock_path, "--sleep")
    try:
        conn, _ = listener.accept()
        with conn:
            _take_request(conn)  # the client has its early-signal handlers in place by now
            client.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            assert client.poll() is None, "the signal killed the client before it knew the stage's pid"
            conn.sendall(json.dumps({"pid": stage.pid}).encode() + b"\n")
            assert stage.wait(timeout=30) == -signal.SIGTERM
            conn.sendall(json.dumps({"exit": 128 + signal.SIGTERM}).encode() + b"\n")
            assert client.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        for p in (stage, client):
            p.kill()
            p.wait()
        listener.close()


def test_a_signal_with_no_answer_from_the_server_ends_the_client_and_its_request(tmp_path):
    """A server that never replies: the early signal waits EARLY_SIGNAL_GRACE_S for the pid, then the client
    closes the connection (the real server takes down a stage whose client left) and dies by the signal."""
    from flows.stage_client import EARLY_SIGNAL_GRACE_S

    listener, sock_path = _stand_in_server(tmp_path)
    client = _client(tmp_path, sock_path, "--sleep")
    try:
        conn, _ = listener.accept()
        with conn:
            _take_request(conn)
            client.send_signal(signal.SIGINT)
            assert client.wait(timeout=EARLY_SIGNAL_GRACE_S + 30) == -signal.SIGINT
            conn.settimeout(10)
            assert conn.recv(1) == b"", "the client left its request open"
    finally:
        client.kill()
        client.wait()
        listener.close()
