"""A stage process pays only for what its stage uses (issue 31: a stage must be cheap to start).

- Importing a data stage's flow module does not import torch or mlflow: mlflow is imported when the
  stage's MLflow run opens, torch only by a body that needs it.
- `flows.run_main` ends a stage process without the interpreter's teardown once its flow returned,
  after every atexit hook (Prefect's and MLflow's flushes) ran; a failing flow exits as usual.
- A stage flow runs without Prefect's flow-run heartbeat (whose thread's join ends every flow run),
  unless the user set its frequency; the pipeline flow keeps it.

Each check runs in a fresh interpreter: what a module imports is only visible there, and a fast exit
would end the test process itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "mlflow", "transformers", "datasets")


def _python(code: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.mark.parametrize("module", ["flows.prepare_corpus", "flows.tokenize", "flows._stage", "components.tracking"])
def test_import_leaves_heavy_packages_unloaded(module):
    out = _python(f"""
        import json, sys
        import {module}
        print(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert not any(loaded.values()), f"`import {module}` imported {[m for m, v in loaded.items() if v]}"


def test_tokenize_flow_without_warm_start_never_imports_torch():
    """The flow's own code, around the body: resolving an unset warm_start needs no encoder."""
    out = _python(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.conftest import tiny_params
        import flows.tokenize as m
        params = tiny_params()
        assert params.warm_start.path is None
        m.tokenize_and_pack = lambda p, corpus, out, warm_start: {{"warm_start": warm_start}}
        m.run_stage = lambda stage, sections, body, **kw: body(params, None)
        assert m.tokenize_flow.fn() == {{"warm_start": None}}
        print("torch" in sys.modules)
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_stage_run_opens_mlflow_lazily(tmp_path):
    """The mechanism above still reaches MLflow: the run's first call imports it."""
    out = _python(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.conftest import tiny_params
        from components.tracking import StageRun
        p = tiny_params(**{{"tracking.uri": "sqlite:///{tmp_path}/mlflow.db", "tracking.system_metrics": False}})
        assert "mlflow" not in sys.modules
        with StageRun("tokenize", p, ["tokenize"], fallback_dir={str(tmp_path)!r}) as run:
            run.log_metrics_now({{"x": 1.0}})
        assert "mlflow" in sys.modules and "torch" not in sys.modules
        print(run.client.get_run(run.run_id).data.metrics, run.client.get_run(run.run_id).info.status)
    """, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "{'x': 1.0} FINISHED" in out.stdout


RUN_MAIN = """
    import atexit, sys
    import flows  # registers the fast exit first, as a stage module's `from prefect ...` line would follow it

    class Teardown:  # a module global: freed (and its __del__ run) only by the interpreter's teardown
        def __del__(self, open=open, path={teardown!r}):  # bound now: teardown clears module globals
            with open(path, "w") as f:
                f.write("torn down")

    keep = Teardown()
    atexit.register(lambda: open({hook!r}, "w").write("hook ran"))  # as Prefect's / MLflow's flushes

    def flow():
        print("flow output", end="")  # unflushed at exit: the fast exit flushes it
        {body}

    flows.run_main(flow)
"""


def test_run_main_exits_after_the_hooks_without_teardown(tmp_path):
    hook, teardown = tmp_path / "hook", tmp_path / "teardown"
    out = _python(RUN_MAIN.format(hook=str(hook), teardown=str(teardown), body="return 1"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "flow output"
    assert hook.read_text() == "hook ran"  # every atexit hook ran before the exit
    assert not teardown.exists()  # the interpreter's teardown did not


def test_run_main_failing_flow_exits_as_usual(tmp_path):
    hook, teardown = tmp_path / "hook", tmp_path / "teardown"
    out = _python(RUN_MAIN.format(hook=str(hook), teardown=str(teardown), body="raise RuntimeError('stage failed')"))
    assert out.returncode == 1
    assert "RuntimeError: stage failed" in out.stderr
    assert hook.read_text() == "hook ran"
    assert teardown.read_text() == "torn down"  # the normal exit path, teardown included


def test_every_stage_flow_module_ends_with_run_main():
    """A stage flow module's `__main__` goes through run_main (else it pays the teardown), without
    the heartbeat; the pipeline flow, which a deployment's worker runs, keeps it."""
    missing, beating = [], []
    for path in sorted((ROOT / "flows").glob("*.py")):
        src = path.read_text(encoding="utf-8")
        if path.name.startswith("_") or path.stem == "pipeline" or "@flow(" not in src:
            continue
        main = src.split('if __name__ == "__main__":', 1)[-1]
        if "run_main(" not in main:
            missing.append(path.name)
        elif "heartbeat=False" not in main:
            beating.append(path.name)
    assert not missing, f"flows whose __main__ does not call flows.run_main: {missing}"
    assert not beating, f"stage flows that keep Prefect's heartbeat: {beating}"
    assert "heartbeat=False" not in (ROOT / "flows" / "pipeline.py").read_text(encoding="utf-8")


HEARTBEAT = """
    import flows
    from prefect import flow
    from prefect.flow_engine import FlowRunEngine

    @flow
    def probe():
        pass

    def main():  # what the flow engine will read when the flow runs (no API needed to ask)
        print(FlowRunEngine(flow=probe).heartbeat_seconds)

    flows.run_main(main{kw})
"""


@pytest.mark.parametrize("kw, env, expected", [
    (", heartbeat=False", {}, "None"),  # a stage flow: none
    ("", {}, "180"),  # the pipeline flow: Prefect's default
    (", heartbeat=False", {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "60"}, "60"),  # the user's value is kept
    (", heartbeat=False", {"PREFECT_RUNNER_HEARTBEAT_FREQUENCY": "45"}, "45"),  # and its legacy name
    (", heartbeat=False", {"profile": "PREFECT_FLOWS_HEARTBEAT_FREQUENCY = 90"}, "90"),  # or the active profile's
])
def test_stage_flows_run_without_prefects_heartbeat_unless_the_user_sets_one(tmp_path, kw, env, expected):
    env = dict(env)
    if "profile" in env:
        (tmp_path / "profiles.toml").write_text(f'active = "rr"\n[profiles.rr]\n{env.pop("profile")}\n')
    out = _python(HEARTBEAT.format(kw=kw), env={"PREFECT_HOME": str(tmp_path), **env})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == expected
