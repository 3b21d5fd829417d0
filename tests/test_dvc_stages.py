"""DVC owns the DAG: the two data stages run through `dvc repro`, are tracked as MLflow child runs,
and changing a `tokenize.*` param reruns only `tokenize` (and what follows), never prepare_corpus."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import make_workspace

pytestmark = pytest.mark.slow


def _repro(ws: Path, env: dict, *targets: str) -> str:
    venv_bin = str(Path(sys.executable).parent)
    env = {**env, "PATH": venv_bin + os.pathsep + env["PATH"]}
    out = subprocess.run(["dvc", "repro", *targets], cwd=ws, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _ran(stdout: str) -> set[str]:
    return {line.split("'")[1] for line in stdout.splitlines() if line.startswith("Running stage '")}


def test_data_stages_rerun_only_downstream(tmp_path, shared_prefect_api):
    ws = make_workspace(tmp_path / "ws")
    uri = f"sqlite:///{ws}/mlflow.db"
    env = {**os.environ, "PREFECT_API_URL": shared_prefect_api, "MLFLOW_TRACKING_URI": uri, "RR_PARENT_RUN_ID": ""}

    assert _ran(_repro(ws, env, "tokenize")) == {"prepare_corpus", "tokenize"}
    assert (ws / "data/tokens/pretrain").is_dir() and (ws / "dvc.lock").exists()
    assert _ran(_repro(ws, env, "tokenize")) == set()  # nothing changed: nothing runs

    params = (ws / "params.yaml").read_text().replace("vocab_size: 400", "vocab_size: 420")
    assert "vocab_size: 420" in params
    (ws / "params.yaml").write_text(params)
    assert _ran(_repro(ws, env, "tokenize")) == {"tokenize"}

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("retro-realm")
    runs = client.search_runs([exp.experiment_id])
    by_stage = {}
    for r in runs:
        by_stage.setdefault(r.data.tags["dvc.stage"], []).append(r)
    assert len(by_stage["prepare_corpus"]) == 1 and len(by_stage["tokenize"]) == 2
    tok = by_stage["tokenize"][0]
    assert tok.info.status == "FINISHED" and tok.data.tags.get("prefect.flow_run_id")
    assert {d.dataset.name for d in tok.inputs.dataset_inputs} >= {"corpus", "pretrain_blocks", "retrieval_blocks"}
    assert any(a.path == "tokenizer" for a in client.list_artifacts(tok.info.run_id))
