"""Local servers get a startup timeout that holds on a busy machine, and when one still does not
answer, the error names the knob to raise and its value.

- Prefect's ephemeral API (a stage run by `dvc repro` without PREFECT_API_URL): `import flows` sets
  PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS (Prefect's default is 20 s) unless the user set it,
  in the environment or in the active Prefect profile; a stage process that dies of it says so.
- The pipeline's shared local API (`flows._runtime.local_prefect_api`): RR_START_TIMEOUT.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import flows
from flows import EPHEMERAL_STARTUP_TIMEOUT as KNOB
from tests.conftest import ROOT


def _python(code: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
    """`python -c code` in a new process, with its own PREFECT_HOME (no profile unless the test writes one)."""
    base = {k: v for k, v in os.environ.items() if k not in (KNOB, "PREFECT_PROFILE", "PREFECT_PROFILES_PATH", "PREFECT_API_URL")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**base, "PREFECT_HOME": str(tmp_path / "prefect-home"), **env})


def _knob_after_import(tmp_path, **env: str) -> str:
    out = _python(f"import os, flows; print(os.environ.get({KNOB!r}))", tmp_path, **env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _write_profile(tmp_path, value: int) -> None:
    home = tmp_path / "prefect-home"
    home.mkdir(exist_ok=True)
    (home / "profiles.toml").write_text(f'active = "mine"\n\n[profiles.mine]\n{KNOB} = "{value}"\n'
                                        'PREFECT_SERVER_EPHEMERAL_ENABLED = "true"\n')


def test_the_ephemeral_startup_timeout_gets_a_default_that_a_users_value_overrides(tmp_path):
    assert _knob_after_import(tmp_path) == str(flows.EPHEMERAL_STARTUP_TIMEOUT_DEFAULT)
    assert flows.EPHEMERAL_STARTUP_TIMEOUT_DEFAULT >= 60  # Prefect's own 20 s fails on a busy 2-core machine
    assert _knob_after_import(tmp_path, **{KNOB: "7"}) == "7"
    _write_profile(tmp_path, 300)  # `prefect config set ...` writes here: not shadowed by the default
    assert _knob_after_import(tmp_path) == "None"


def test_prefect_reads_the_default_and_a_profiles_value(tmp_path):
    code = "import flows; from prefect.settings import get_current_settings as s; print(s().server.ephemeral.startup_timeout_seconds)"
    out = _python(code, tmp_path)
    assert out.stdout.strip() == str(flows.EPHEMERAL_STARTUP_TIMEOUT_DEFAULT), out.stderr
    _write_profile(tmp_path, 300)
    out = _python(code, tmp_path)
    assert out.stdout.strip() == "300", out.stderr


def test_the_hint_is_only_for_the_ephemeral_startup_timeout():
    prefect_error = RuntimeError("Timed out while attempting to connect to ephemeral Prefect API server.")
    hint = flows.ephemeral_timeout_hint(prefect_error)
    assert KNOB in hint and "(now " in hint and "PREFECT_API_URL" in hint
    try:  # found behind another error too
        try:
            raise prefect_error
        except RuntimeError as e:
            raise ValueError("while starting the flow run") from e
    except ValueError as wrapped:
        assert flows.ephemeral_timeout_hint(wrapped) == hint
    crashed = RuntimeError("Timed out while attempting to connect to ephemeral Prefect API server. "
                           "Ephemeral server process exited with code 1.")
    assert "will not help" in flows.ephemeral_timeout_hint(crashed)
    assert flows.ephemeral_timeout_hint(RuntimeError("something else")) is None


def test_a_process_that_dies_of_it_names_the_knob_and_its_value(tmp_path):
    out = _python("import flows\nraise RuntimeError('Timed out while attempting to connect to ephemeral Prefect API server.')",
                  tmp_path, **{KNOB: "45"})
    assert out.returncode == 1
    assert f"{KNOB} (now 45 s)" in out.stderr and f"export {KNOB}=" in out.stderr, out.stderr


@pytest.mark.slow
def test_a_real_stage_flow_whose_ephemeral_api_is_too_slow_names_the_knob(tmp_path):
    """A flow run with no PREFECT_API_URL and a 1 s startup timeout (the server needs ~10 s): the
    error is Prefect's, plus the knob."""
    code = "import flows\nfrom prefect import flow\n@flow\ndef stage():\n    return 1\nstage()\n"
    out = _python(code, tmp_path, **{KNOB: "1"})
    assert out.returncode == 1
    assert "Timed out while attempting to connect to ephemeral Prefect API server" in out.stderr, out.stderr[-3000:]
    assert f"{KNOB} (now 1 s)" in out.stderr, out.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# the pipeline's local Prefect API
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def no_api(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("RR_START_TIMEOUT", raising=False)
    from flows import _runtime

    return _runtime


def test_start_timeout_default_and_knob(no_api, monkeypatch):
    assert no_api.start_timeout() == no_api.START_TIMEOUT_DEFAULT >= 60
    monkeypatch.setenv("RR_START_TIMEOUT", "300")
    assert no_api.start_timeout() == 300
    monkeypatch.setenv("RR_START_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="RR_START_TIMEOUT='soon'"):
        no_api.start_timeout()


def test_a_local_api_that_never_answers_names_the_knob(no_api, monkeypatch, tmp_path):
    monkeypatch.setattr(no_api, "prefect_server_command", lambda port: [sys.executable, "-c", "import time; time.sleep(120)"])
    monkeypatch.setenv("RR_START_TIMEOUT", "1.5")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"within 1.5 s \(RR_START_TIMEOUT=1.5\)\. On a busy machine raise RR_START_TIMEOUT"):
        with no_api.local_prefect_api(home=tmp_path / "prefect"):
            pytest.fail("the API never answered")
    assert time.monotonic() - t0 < 30  # the server process was stopped, not waited for
    assert "PREFECT_API_URL" not in os.environ


def test_start_up_work_runs_while_the_local_api_starts(no_api, monkeypatch, tmp_path):
    """`meanwhile` (the pipeline's stage server and tracking store) runs before the API answers, with
    the URL that the stage processes will use already exported; with a running API it runs too."""
    monkeypatch.setattr(no_api, "prefect_server_command", lambda port: [sys.executable, "-c", "import time; time.sleep(120)"])
    monkeypatch.setenv("RR_START_TIMEOUT", "1")
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "before"))  # restored after the test
    seen = []
    with pytest.raises(RuntimeError, match="did not answer"):
        with no_api.local_prefect_api(home=tmp_path / "prefect", meanwhile=lambda: seen.append(os.environ["PREFECT_API_URL"])):
            pytest.fail("the API never answered")
    assert len(seen) == 1 and seen[0].startswith("http://127.0.0.1:") and seen[0].endswith("/api")
    assert "PREFECT_API_URL" not in os.environ
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")
    with no_api.local_prefect_api(home=tmp_path / "prefect", meanwhile=lambda: seen.append("with a running API")) as url:
        assert url == "http://127.0.0.1:1/api" and seen[-1] == "with a running API"


def test_a_local_api_that_exits_says_so_not_to_wait_longer(no_api, monkeypatch, tmp_path):
    monkeypatch.setattr(no_api, "prefect_server_command",
                        lambda port: [sys.executable, "-c", "import sys; print('port already in use'); sys.exit(3)"])
    with pytest.raises(RuntimeError, match="exited with code 3") as err:
        with no_api.local_prefect_api(home=tmp_path / "prefect"):
            pytest.fail("the API never answered")
    assert "port already in use" in str(err.value) and "RR_START_TIMEOUT" not in str(err.value)
