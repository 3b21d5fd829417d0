"""A warm parent for a pipeline's stage processes (issue 31: a stage must be cheap to start).

Every `dvc repro` stage is its own `scripts/py -m flows.<stage>` process, and most of its fixed
cost is importing torch, transformers, datasets, mlflow and prefect (bench/README.md, "Stage
start-up"). The pipeline flow starts this server once: it imports those libraries and the stage
flows, then listens on a Unix socket. `scripts/py` sees $RR_STAGE_SERVER and runs the stage through
flows/stage_client.py, which hands over its argv, cwd, environment and stdio; the server forks a
child that runs `python -m MODULE ARGS` as the stage's process would (`runpy`, `__main__`, the
client's environment, atexit hooks, exit status), and the client exits with the child's status.
DVC still runs, hashes and records every stage: only the interpreter start is shared.

    with stage_server() as path:       # flows.pipeline; exports RR_STAGE_SERVER for the stages
        ...                            # dvc repro ...
    python -m flows.stage_server --socket /tmp/rr.sock    # by hand

Fork is safe here because the server never runs a torch op, opens no client and starts no thread
before it forks (it checks its OS threads, or refuses: `unsafe_threads`). A request is refused, and the
client runs the stage cold, when the server cannot reproduce a fresh process: another working
directory, or an environment that differs from the server's in any variable but those read only
at run time (`RUNTIME_ENV`): libraries read theirs at import (OMP_NUM_THREADS, PREFECT_*, ...).
Linux only; RR_STAGE_SERVER=off (or `flows.pipeline --no-warm-stages`) turns it off.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import json
import logging
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from components.tracking import ENV_FLOW_RUN, ENV_STAGE_PROCESS
from flows import run_main

ENV_SERVER = "RR_STAGE_SERVER"
OFF = ("off", "0", "false", "no")
# Read when a stage runs, not when a library is imported: they may differ from the server's.
# _MLFLOW_TELEMETRY_SESSION_ID: MLflow sets it when a process with telemetry on imports it (a caller such as
# experiments/small_seeds.py) and unsets it on import with telemetry off (flows/__init__.py), so the server
# and a stage's client could see it differ and every stage ran cold; the stages run with telemetry off.
RUNTIME_ENV = ("RR_STAGE_SERVER", "RR_PARENT_RUN_ID", ENV_FLOW_RUN, "RR_STAGE_ITEM", ENV_STAGE_PROCESS, "PWD", "OLDPWD",
               "SHLVL", "_", "_MLFLOW_TELEMETRY_SESSION_ID")
RUNTIME_ENV_PREFIXES = ("DVC_",)  # DVC_ROOT, DVC_STAGE: set by `dvc repro` for each stage
# What the stages import at their module level or in their bodies; a missing one is skipped.
PRELOAD = ("numpy", "torch", "transformers", "transformers.models.bert.modeling_bert", "datasets", "faiss",
           "mlflow", "mlflow.tracking", "prefect", "spacy", "flows", "flows._stage", "flows._torchrun",
           # logging a stage's models (flows/_stage.log_model): ~5 s of imports in every training stage
           "pandas", "sentence_transformers", "mlflow.models", "mlflow.pyfunc", "mlflow.sentence_transformers",
           "mlflow.transformers",
           # the embedded default's sqlite store (SQLAlchemy + alembic: ~0.9 s of every stage's run start)
           # and what Prefect's flow engine imports at each flow call (~0.15 s)
           "mlflow.store.tracking.sqlalchemy_store", "prefect.utilities.visualization",
           "flows.prepare_corpus", "flows.tokenize", "flows.pretrain_retromae", "flows.pretrain_mlm",
           "flows.pretrain_realm", "flows.finetune_retriever", "flows.finetune_reader", "flows.evaluate",
           "components.data.source_digest")
MODULE_PREFIXES = ("flows.", "components.")  # what the server runs; anything else runs cold

log = logging.getLogger(__name__)


def env_difference(server: dict[str, str], request: dict[str, str]) -> list[str]:
    """The variables (sorted) whose value differs between the two environments, ignoring those read
    only at run time."""
    keys = set(server) | set(request)
    return sorted(k for k in keys if server.get(k) != request.get(k)
                  and k not in RUNTIME_ENV and not k.startswith(RUNTIME_ENV_PREFIXES))


# Native threads that a fork may leave behind: pyarrow's jemalloc (imported by datasets) purges
# in a background thread, and OpenBLAS (numpy's, scipy's) parks its worker pool; both shut down or
# lock around a fork (pthread_atfork), so the child's copy is consistent and starts its own threads
# when it needs them. Any other thread (a Python one, an OpenMP pool) makes the server refuse.
FORK_SAFE_THREADS = ("jemalloc_bg_thd",)


def _openblas_workers() -> int:
    """Worker threads the loaded OpenBLAS libraries may have started (num_threads - 1 each)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return 0
    return sum(max(0, lib.get("num_threads", 1) - 1) for lib in threadpool_info() if lib.get("internal_api") == "openblas")


def unsafe_threads() -> list[str]:
    """This process's threads that a fork would not copy safely (Linux), by name: every Python
    thread but the main one, and native ones beyond FORK_SAFE_THREADS and OpenBLAS's workers
    (those carry the process's own name, as any unnamed native thread does)."""
    import threading

    unsafe = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    python_threads = len(unsafe)  # their OS threads carry the process's name too
    try:
        tasks = [t for t in os.listdir("/proc/self/task") if int(t) != os.getpid()]
        with open("/proc/self/comm", encoding="utf-8") as f:
            own = f.read().strip()
    except OSError:
        return unsafe
    unnamed = 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
                name = f.read().strip()
        except OSError:  # it ended meanwhile
            continue
        if name == own:
            unnamed += 1
        elif name not in FORK_SAFE_THREADS:
            unsafe.append(name)
    if (native := unnamed - python_threads) > _openblas_workers():
        unsafe.append(f"{native} unnamed native")
    return unsafe


def refusal(request: dict, cwd: str, env: dict[str, str], modules: tuple[str, ...] = MODULE_PREFIXES) -> str | None:
    """Why the server cannot run `request` as a fresh process would, or None. `env`: the server's
    environment as it started, before its imports."""
    argv = request.get("argv") or []
    if len(argv) < 2 or argv[0] != "-m" or not argv[1].startswith(modules):
        return f"it serves `-m {'|'.join(p + '*' for p in modules)}`, not {' '.join(argv[:2])!r}"
    if os.path.realpath(request.get("cwd", "")) != os.path.realpath(cwd):
        return f"the stage runs in {request.get('cwd')}, the server in {cwd}"
    if diff := env_difference(env, request.get("env", {})):
        return f"the environment differs from the server's in {', '.join(diff[:8])}"
    if threads := unsafe_threads():
        return f"the server runs threads ({', '.join(threads[:4])}), so a fork would not be safe"
    return None


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One length-prefixed JSON request and the client's stdin/stdout/stderr descriptors."""
    conn.settimeout(10)  # a client that connects and never sends must not stall the server
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    try:
        if len(data) < 8:
            raise ConnectionError("short request")
        size = int.from_bytes(data[:8], "big")
        body = bytearray(data[8:])
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise ConnectionError("the client closed the connection mid-request")
            body += chunk
        if len(fds) != 3:
            raise ConnectionError(f"expected 3 file descriptors, got {len(fds)}")
        request = json.loads(bytes(body))
        if not isinstance(request.get("argv"), list) or not isinstance(request.get("env"), dict):
            raise ValueError("argv must be a list and env a dict")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return request, fds


def _run_child(request: dict, fds: list[int], import_env: dict[str, str]) -> None:
    """In the forked child: become `python -m MODULE ARGS` in the client's place, then exit.
    `import_env`: what the server's imports set in the environment (e.g. flows' telemetry
    defaults), which a fresh process's imports would set too."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**request["env"], **import_env, ENV_STAGE_PROCESS: "forked"})  # MLflow tag rr.stage_process
    if "numpy.random" in sys.modules:  # a fresh process seeds numpy's global RNG from the OS; a fork
        sys.modules["numpy.random"].seed()  # would share the server's (Python's `random` reseeds itself)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in request.get("ignored_signals", []):  # what the client's process ignores (nohup, `&`)
        signal.signal(signum, signal.SIG_IGN)
    with contextlib.suppress(Exception):  # line-buffered on a terminal, as a fresh process's stdout is
        sys.stdout.reconfigure(line_buffering=os.isatty(1))
    module, args = request["argv"][1], request["argv"][2:]
    # `python -m` runs the module once, as __main__: drop the copy the server preloaded
    if module in sys.modules:
        del sys.modules[module]
        parent, _, leaf = module.rpartition(".")
        if parent in sys.modules:
            with contextlib.suppress(AttributeError):
                delattr(sys.modules[parent], leaf)
    sys.argv = [module, *args]  # runpy puts the module's file in argv[0], as `python -m` does
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        _flush_and_run_atexit()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # die of the signal, as the interpreter does
    except BaseException:  # noqa: BLE001 - the stage's traceback, as an uncaught exception prints it
        sys.excepthook(*sys.exc_info())
        code = 1
    _flush_and_run_atexit()
    os._exit(code)


def _flush_and_run_atexit() -> None:
    """What an interpreter does at exit: join the threads and run threading's exit hooks (Prefect
    drains its event and log queues there), then the atexit hooks (flows.run_main's fast exit may end here)."""
    import threading

    with contextlib.suppress(Exception):
        threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def serve(path: str, preload: tuple[str, ...] = PRELOAD, modules: tuple[str, ...] = MODULE_PREFIXES) -> None:
    """Import `preload`, then fork one child per request on the Unix socket `path` until SIGTERM;
    it runs the modules whose names start with one of `modules`."""
    t0 = time.monotonic()
    from flows import START_ENV as start_env  # before flows/__init__ set its defaults

    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a stage that needs it imports it itself (and fails there)
            print(f"stage server: not preloaded: {name} ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    cwd = os.getcwd()
    import_env = {k: v for k, v in os.environ.items() if start_env.get(k) != v}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.{os.getpid()}.tmp"
    listener.bind(tmp)
    listener.listen(16)
    os.replace(tmp, path)  # the socket appears only once the imports are done and it accepts
    print(f"stage server: ready on {path} after {time.monotonic() - t0:.1f} s of imports (pid {os.getpid()})",
          file=sys.stderr, flush=True)
    children: dict[int, socket.socket] = {}  # pid -> the client connection waiting for its exit status
    stopping = False

    def stop(_signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    owner = os.getppid()  # the pipeline: if it dies without stopping us, so do we
    abandoned: set[int] = set()  # stages whose client went away: signalled once, no longer watched
    try:
        while not stopping and os.getppid() == owner:
            watched = [c for p, c in children.items() if p not in abandoned]
            readable, _, _ = select.select([listener, *watched], [], [], 0.2)
            for conn in readable:
                if conn is listener:
                    try:
                        _accept(listener, cwd, start_env, import_env, modules, children)
                    except Exception as e:  # noqa: BLE001 - one bad request never takes the running stages down
                        print(f"stage server: request failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
                else:  # a client connection became readable while its stage runs: the client is gone
                    pid = next(p for p, c in children.items() if c is conn)
                    abandoned.add(pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
            _reap(children)
            abandoned &= set(children)
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(OSError):
            os.unlink(path)


def _accept(listener: socket.socket, cwd: str, start_env: dict[str, str], import_env: dict[str, str],
            modules: tuple[str, ...], children: dict[int, socket.socket]) -> None:
    conn, _ = listener.accept()
    try:
        request, fds = _recv_request(conn)
    except (OSError, ValueError) as e:
        print(f"stage server: bad request ({e})", file=sys.stderr, flush=True)
        conn.close()
        return
    if why := refusal(request, cwd, start_env, modules):
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"refused": why}).encode() + b"\n")
        conn.close()
        return
    try:
        pid = os.fork()
    except OSError as e:  # e.g. ENOMEM: the client runs the stage cold
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"refused": f"fork failed ({e.strerror or e})"}).encode() + b"\n")
        conn.close()
        return
    if pid == 0:  # the stage
        try:
            listener.close()
            conn.close()
            for other in children.values():
                other.close()
            _run_child(request, fds, import_env)
        finally:
            os._exit(1)  # only reached if the child's own machinery failed
    for fd in fds:
        os.close(fd)
    print(f"stage server: forked {pid} for {' '.join(request['argv'][:4])}", file=sys.stderr, flush=True)
    children[pid] = conn
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"exit": code if code >= 0 else 128 - code}).encode() + b"\n")
        conn.close()


def stage_server_running(env: dict[str, str] | None = None) -> bool:
    """Whether a stage server was started for this process's children (RR_STAGE_SERVER holds its socket)."""
    value = (env if env is not None else os.environ).get(ENV_SERVER, "")
    return bool(value) and value.lower() not in OFF


def stage_server_enabled(env: dict[str, str] | None = None) -> bool:
    """Whether the pipeline starts a stage server: Linux, and RR_STAGE_SERVER not switched off."""
    value = (env if env is not None else os.environ).get(ENV_SERVER, "")
    return sys.platform.startswith("linux") and value.lower() not in OFF


@contextlib.contextmanager
def stage_server(env: dict[str, str]) -> Iterator[str]:
    """Start a server (`scripts/py -m flows.stage_server`, with `env`: the stages' own environment)
    for the body and export its socket path as RR_STAGE_SERVER. The body does not wait for it: a
    stage that starts before the server's imports are done (the socket appears then) starts cold.
    The server's output goes to its log, named in the pipeline's log."""
    folder = tempfile.mkdtemp(prefix="rr-stages-")
    path = os.path.join(folder, "server.sock")
    env = {k: v for k, v in env.items() if k != ENV_SERVER}
    log_path = os.path.join(folder, "server.log")
    with open(log_path, "ab") as logf:
        command = [str(Path("scripts/py").resolve()), "-m", "flows.stage_server", "--socket", path]
        proc = subprocess.Popen(command, env=env, stdout=logf,
                                stderr=subprocess.STDOUT, start_new_session=True)
    log.info("stage server: pid %d, socket %s (log %s)", proc.pid, path, log_path)
    previous = os.environ.get(ENV_SERVER)
    os.environ[ENV_SERVER] = path
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop(ENV_SERVER, None)
        else:
            os.environ[ENV_SERVER] = previous
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        with contextlib.suppress(OSError):
            text = Path(log_path).read_text(encoding="utf-8", errors="replace")
            log.info("stage server: %d stage processes forked warm", text.count("stage server: forked "))
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", required=True, help="the Unix socket to listen on (created once the imports are done)")
    ap.add_argument("--preload", nargs="*", default=None, help="modules to import first (default: the stages' libraries)")
    ap.add_argument("--modules", nargs="+", default=list(MODULE_PREFIXES), help="module name prefixes it runs")
    args = ap.parse_args(argv)
    serve(args.socket, tuple(args.preload) if args.preload is not None else PRELOAD, tuple(args.modules))


if __name__ == "__main__":
    # without the interpreter's teardown of the preloaded libraries (~2 s at the end of every pipeline)
    run_main(main)
