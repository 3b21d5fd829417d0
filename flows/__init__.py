"""Thin Prefect flows, one per pipeline stage, plus the pipeline flow. Business logic lives in components/."""

import atexit
import contextlib
import os
import sys
import tomllib
from pathlib import Path
from typing import Any, Callable

# The environment this process started with, before the defaults below: flows.stage_server
# compares a stage's environment with its own as it started.
START_ENV = dict(os.environ)

# Offline-friendly defaults (users may override them in their environment):
# no telemetry calls from a local Prefect server or from transformers.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

# A stage run by `dvc repro` without PREFECT_API_URL starts Prefect's ephemeral API in a subprocess
# (~12 s on 2 idle cores) and gives up after this setting, 20 s by Prefect's default: too short on a
# busy machine. Set before Prefect is imported (it reads its settings then). A value of the user's,
# in the environment or in the active Prefect profile (`prefect config set`), is kept.
EPHEMERAL_STARTUP_TIMEOUT = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
EPHEMERAL_STARTUP_TIMEOUT_DEFAULT = 120


def _prefect_profile_sets(name: str) -> bool:
    """Whether the active profile in Prefect's profiles.toml sets `name`."""
    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()
    path = Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    try:
        profiles = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    active = os.environ.get("PREFECT_PROFILE") or profiles.get("active") or "ephemeral"
    return name in profiles.get("profiles", {}).get(active, {})


if not _prefect_profile_sets(EPHEMERAL_STARTUP_TIMEOUT):
    os.environ.setdefault(EPHEMERAL_STARTUP_TIMEOUT, str(EPHEMERAL_STARTUP_TIMEOUT_DEFAULT))


def ephemeral_timeout_hint(exc: BaseException) -> str | None:
    """What to do about Prefect's "Timed out while attempting to connect to ephemeral Prefect API
    server" anywhere in `exc`'s chain: the setting to raise and its value. None for other errors."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RuntimeError) and "connect to ephemeral Prefect API server" in str(exc):
            break
        exc = exc.__cause__ or exc.__context__
    else:
        return None
    try:
        from prefect.settings import get_current_settings

        value = f"{get_current_settings().server.ephemeral.startup_timeout_seconds} s"
    except Exception:  # noqa: BLE001 - a hint must not fail
        value = os.environ.get(EPHEMERAL_STARTUP_TIMEOUT, "unknown")
    if "exited with code" in str(exc):
        return (f"retro-realm: the ephemeral Prefect API's process died (its output is above); a longer "
                f"{EPHEMERAL_STARTUP_TIMEOUT} (now {value}) will not help.")
    return (f"retro-realm: the ephemeral Prefect API did not answer within {EPHEMERAL_STARTUP_TIMEOUT} "
            f"(now {value}), e.g. on a busy machine. Raise it (`export {EPHEMERAL_STARTUP_TIMEOUT}=600`), "
            "or give the stages one API that is already up: PREFECT_API_URL (`make servers-up`; the "
            "pipeline flow, `make run`, starts one for all its stages).")


def _excepthook(exc_type, exc, tb, _previous=sys.excepthook):
    """A stage process that dies of the ephemeral API's startup timeout says which knob to raise."""
    if (hint := ephemeral_timeout_hint(exc)) and hint not in getattr(exc, "__notes__", ()):
        exc.add_note(hint)
    _previous(exc_type, exc, tb)


sys.excepthook = _excepthook


# A stage process ends by tearing its interpreter down: every module of torch, transformers, mlflow
# and prefect freed one by one, after the stage's work, its MLflow run and its Prefect flow run are
# all closed (2.4-4.2 s for those imports on the shared 2-core machine at load 6; bench/README.md). `run_main` skips that teardown once
# the flow has returned: `_exit_without_teardown` is the first atexit callback registered (it runs
# last), so Prefect's and MLflow's own exit hooks (log and event flushes) have run by then.
_completed = False

# Prefect's flow-run heartbeat (every 180 s by default) lets a server mark a run crashed once its
# process is gone. A stage flow is a child process of `dvc repro`, whose exit status already reports
# a crash to DVC and to the pipeline flow, and the pipeline flow (what a deployment's worker runs)
# keeps its heartbeat. In a stage the heartbeat thread only adds its join to the end of every flow
# run (it sleeps in 1 s steps): ~0.8 s a stage and a REALM refresh subflow (bench/README.md,
# "Stage start-up"). A value the user sets, in the environment or the active profile, is kept.
HEARTBEAT_SETTINGS = ("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "PREFECT_RUNNER_HEARTBEAT_FREQUENCY")  # Prefect's name, its legacy alias


def _heartbeat_set_by_user() -> bool:
    return any(name in os.environ or _prefect_profile_sets(name) for name in HEARTBEAT_SETTINGS)


def run_main(flow_fn: Callable[..., Any], *args: Any, heartbeat: bool = True, **kwargs: Any) -> Any:
    """A flow module's `__main__`: run the flow; if it returns, the process exits with 0 without the
    interpreter's teardown. An exception exits as usual (traceback, status 1). `heartbeat=False`
    (the stage flows): its flow runs send no Prefect heartbeat, unless the user set its frequency."""
    global _completed
    with contextlib.ExitStack() as stack:
        if not heartbeat and not _heartbeat_set_by_user():
            from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

            stack.enter_context(temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}))
        result = flow_fn(*args, **kwargs)
    _completed = True
    return result


def _exit_without_teardown() -> None:
    if not _completed:
        return
    import logging

    logging.shutdown()  # flush and close every handler (a no-op if logging's own hook ran)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced streams
            pass
    os._exit(0)


atexit.register(_exit_without_teardown)
