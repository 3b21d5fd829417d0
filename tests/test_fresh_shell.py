"""The README's commands work as written in a fresh shell: no venv activated, no `python` on PATH.

Every dvc.yaml stage runs `scripts/py -m <module>`, and scripts/py picks the project's interpreter:
RR_PYTHON, else an activated venv / conda env that has the packages, else the repo's .venv, else the
Python running dvc, else python3 / python on PATH. The fast tests check that order on a copy of the
launcher with stand-in interpreters; the slow ones run the real `dvc repro`, `dvc exp run` and
`mlflow ui` under a PATH that holds no Python at all.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from flows._runtime import start_timeout, stop_process_group
from tests.conftest import ROOT, dvc_stages, make_workspace
from tests.servers import free_port

LAUNCHER = ROOT / "scripts" / "py"
VENV = Path(sys.prefix)  # the venv running the tests: what `make setup` builds as .venv
STAGES = dvc_stages()  # foreach / matrix stages resolved

# A stand-in interpreter: answers the launcher's package probe (`-c '...find_spec...' prefect ...`),
# else prints its name and arguments. BARE lacks the packages.
GOOD = '#!/bin/sh\ncase "$2" in *find_spec*) exit 0 ;; esac\necho "{name} $*"\n'
BARE = '#!/bin/sh\ncase "$2" in *find_spec*) echo prefect mlflow torch; exit 1 ;; esac\necho "{name} $*"\n'


def _interpreter(path: Path, name: str, script: str = GOOD) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script.format(name=name))
    path.chmod(0o755)
    return path


def _bin(folder: Path, *tools: str) -> Path:
    """A PATH folder holding only links to `tools` (by name, from this machine's PATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    for tool in tools:
        found = shutil.which(tool)
        assert found, f"{tool} not found on PATH"
        (folder / tool).symlink_to(found)
    return folder


def _fresh_env(path: Path, **extra: str) -> dict[str, str]:
    """A new login's environment: nothing activated, no interpreter pinned, PATH = `path` only."""
    drop = {"PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "RR_PYTHON", "PYTHONPATH", "PYTHONHOME"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PATH": str(path), **extra}


def test_every_stage_runs_its_module_through_the_launcher():
    for name, stage in STAGES.items():
        cmd = stage["cmd"]
        assert cmd.startswith("scripts/py -m "), f"stage {name}: {cmd!r} depends on which `python` PATH holds"
        module = cmd.split()[2]
        assert (ROOT / Path(*module.split("."))).with_suffix(".py").is_file(), f"stage {name}: no module {module}"


def test_the_launcher_is_an_executable_posix_sh_script():
    assert os.access(LAUNCHER, os.X_OK), "chmod +x scripts/py (dvc.yaml runs it directly)"
    assert LAUNCHER.read_text().startswith("#!/bin/sh\n")
    staged = subprocess.run(["git", "ls-files", "-s", "scripts/py"], cwd=ROOT, capture_output=True, text=True).stdout
    assert not staged or staged.startswith("100755"), f"scripts/py is tracked without its exec bit: {staged}"


@pytest.fixture
def sandbox(tmp_path: Path) -> Path:
    """repo/scripts/py (a copy of the launcher) with a stand-in repo/.venv, and an empty PATH folder."""
    (tmp_path / "repo" / "scripts").mkdir(parents=True)
    shutil.copy2(LAUNCHER, tmp_path / "repo" / "scripts" / "py")
    _interpreter(tmp_path / "repo" / ".venv" / "bin" / "python", "dotvenv")
    (tmp_path / "bin").mkdir()
    return tmp_path


def _launch(sb: Path, **env: str) -> subprocess.CompletedProcess:
    """`repo/scripts/py -m flows.x` from outside the repo, under a PATH of sb/bin only."""
    return subprocess.run([str(sb / "repo" / "scripts" / "py"), "-m", "flows.x"], cwd=sb,
                          env=_fresh_env(sb / "bin", **env), capture_output=True, text=True, timeout=60)


def test_the_repo_venv_is_found_from_the_launchers_own_folder(sandbox):
    out = _launch(sandbox)
    assert (out.returncode, out.stdout) == (0, "dotvenv -m flows.x\n"), out.stderr


@pytest.mark.parametrize("var", ["VIRTUAL_ENV", "CONDA_PREFIX"])
def test_an_activated_env_with_the_packages_wins_over_the_repo_venv(sandbox, var):
    _interpreter(sandbox / "active" / "bin" / "python", "active")
    assert _launch(sandbox, **{var: str(sandbox / "active")}).stdout == "active -m flows.x\n"


def test_an_activated_env_without_the_packages_is_skipped(sandbox):
    _interpreter(sandbox / "base" / "bin" / "python", "base", BARE)  # e.g. conda's default `base`
    assert _launch(sandbox, CONDA_PREFIX=str(sandbox / "base")).stdout == "dotvenv -m flows.x\n"


def test_rr_python_wins_and_is_never_skipped(sandbox):
    pinned = _interpreter(sandbox / "pinned" / "python", "pinned")
    _interpreter(sandbox / "active" / "bin" / "python", "active")
    assert _launch(sandbox, RR_PYTHON=str(pinned), VIRTUAL_ENV=str(sandbox / "active")).stdout == "pinned -m flows.x\n"

    bare = _interpreter(sandbox / "bare" / "python", "bare", BARE)
    out = _launch(sandbox, RR_PYTHON=str(bare))
    assert out.returncode == 127 and out.stdout == ""  # not the .venv behind the user's back
    assert f"RR_PYTHON={bare}" in out.stderr and "lacks prefect mlflow torch" in out.stderr


def test_without_a_venv_python3_on_path_runs(sandbox):
    shutil.rmtree(sandbox / "repo" / ".venv")
    _interpreter(sandbox / "bin" / "python3", "python3")
    assert _launch(sandbox).stdout == "python3 -m flows.x\n"


def test_with_no_interpreter_the_error_names_rr_python_and_make_setup(sandbox):
    shutil.rmtree(sandbox / "repo" / ".venv")
    _interpreter(sandbox / "bin" / "python", "python", BARE)
    out = _launch(sandbox)
    assert out.returncode == 127 and out.stdout == ""
    assert "RR_PYTHON" in out.stderr and "make setup" in out.stderr
    assert "python on PATH" in out.stderr and "lacks prefect" in out.stderr  # what it tried, and why not


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads the dvc process's argv from /proc")
@pytest.mark.parametrize("form", ["script", "module"])
def test_without_a_venv_the_python_running_dvc_runs(sandbox, form):
    """`/opt/env/bin/dvc repro` (or `/opt/env/bin/python -m dvc repro`) without activating /opt/env:
    the stage gets /opt/env's Python. Here a stand-in `dvc` on this venv's Python runs the launcher
    the way DVC runs a stage (`$SHELL -c <cmd>` in the repo root)."""
    shutil.rmtree(sandbox / "repo" / ".venv")
    _bin(sandbox / "bin", "tr")
    body = ("import subprocess, sys\n"
            "sys.exit(subprocess.call(['/bin/sh', '-c', 'scripts/py -c \"import sys; print(sys.executable)\"'], cwd=sys.argv[1]))\n")
    if form == "script":
        dvc = sandbox / "env" / "bin" / "dvc"
        dvc.parent.mkdir(parents=True)
        dvc.write_text(f"#!{sys.executable}\n{body}")
        dvc.chmod(0o755)
        cmd, extra = [str(dvc), str(sandbox / "repo")], {}
    else:
        (sandbox / "mods" / "dvc").mkdir(parents=True)
        (sandbox / "mods" / "dvc" / "__init__.py").write_text("")  # a regular package: it shadows the real dvc
        (sandbox / "mods" / "dvc" / "__main__.py").write_text(body)
        cmd, extra = [sys.executable, "-m", "dvc", str(sandbox / "repo")], {"PYTHONPATH": str(sandbox / "mods")}
    out = subprocess.run(cmd, env=_fresh_env(sandbox / "bin", **extra), capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, sys.executable + "\n"), out.stderr


def test_the_pipeline_hands_its_interpreter_to_the_stages(monkeypatch):
    from flows.pipeline import dvc_env

    monkeypatch.delenv("RR_PYTHON", raising=False)
    env = dvc_env()
    assert env["RR_PYTHON"] == sys.executable
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    monkeypatch.setenv("RR_PYTHON", "/opt/cuda-env/bin/python")
    assert dvc_env()["RR_PYTHON"] == "/opt/cuda-env/bin/python"  # the user's choice stays


# ---------------------------------------------------------------------------------------------
# the real commands, as the README writes them, from a fresh shell with no Python on PATH
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bare_workspace(tmp_path_factory) -> tuple[Path, Path]:
    """A workspace (a user's clone) and a PATH folder with sh, git and tr: no python, no dvc."""
    tmp = tmp_path_factory.mktemp("fresh")
    ws = make_workspace(tmp / "ws")
    path = _bin(tmp / "bin", "sh", "git", "tr")
    assert not [p.name for p in path.iterdir() if p.name.startswith("python")]
    return ws, path


def _run(ws: Path, path: Path, *cmd: str) -> str:
    out = subprocess.run(list(cmd), cwd=ws, env=_fresh_env(path), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"$ {' '.join(cmd)} -> {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.slow
def test_dvc_repro_of_a_venv_outside_the_repo_runs_the_stage_with_that_python(bare_workspace):
    """`/opt/env/bin/dvc repro` in a clone without .venv: the stage runs with /opt/env's Python."""
    ws, path = bare_workspace
    assert not (ws / ".venv").exists()
    out = _run(ws, path, str(VENV / "bin" / "dvc"), "repro", "source_digest")
    assert "Running stage 'source_digest'" in out and (ws / "data" / "source.json").is_file()


@pytest.mark.slow
def test_readme_dvc_repro_and_exp_run_as_written(bare_workspace):
    """After `make setup` (.venv, here a link to the test venv): `.venv/bin/dvc repro` and
    `.venv/bin/dvc exp run` from the repo root, nothing activated, no Python on PATH."""
    ws, path = bare_workspace
    (ws / ".venv").symlink_to(VENV, target_is_directory=True)
    try:
        (ws / "data" / "source.json").unlink(missing_ok=True)
        assert "Running stage 'source_digest'" in _run(ws, path, ".venv/bin/dvc", "repro", "source_digest")
        assert (ws / "data" / "source.json").is_file()
        assert "Running stage 'source_digest'" in _run(ws, path, ".venv/bin/dvc", "exp", "run", "source_digest")
        # and it was the clone's .venv that ran the stage
        assert _run(ws, path, "scripts/py", "-c", "import sys; print(sys.prefix)").strip() == str(ws / ".venv")
    finally:
        (ws / ".venv").unlink()


README_MLFLOW_UI = ".venv/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db"


@pytest.mark.slow
def test_readme_mlflow_ui_as_written(bare_workspace):
    """The README's `mlflow ui` line answers from a fresh shell (on a free port instead of 5000, with
    one worker instead of 4: ~20 s instead of ~30-45 s on 2 busy cores; the same interpreter lookup)."""
    assert README_MLFLOW_UI in (ROOT / "README.md").read_text()
    ws, path = bare_workspace
    (ws / ".venv").symlink_to(VENV, target_is_directory=True)
    port = free_port()
    proc = subprocess.Popen([*README_MLFLOW_UI.split(), "--port", str(port), "--workers", "1"], cwd=ws, env=_fresh_env(path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout()
        while True:
            assert proc.poll() is None, f"mlflow ui exited {proc.returncode}:\n{proc.stdout.read()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "mlflow ui did not answer (raise RR_START_TIMEOUT on a busy machine)"
            time.sleep(0.5)
        assert (ws / "mlflow.db").is_file()
    finally:
        stop_process_group(proc, grace=20)
        (ws / ".venv").unlink()
