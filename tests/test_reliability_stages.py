"""Kill -9 of the REALM and fine-tune stages through `dvc repro`, then rerun `dvc repro`.

What a user sees when a GPU worker dies: the whole process group of `dvc repro <stage>` (dvc, the
stage's Prefect flow, its training loop) gets SIGKILL at a random step. Rerunning the same command
must resume from the newest complete checkpoint, and with the same seed log the same per-step
losses and write the same model bytes as a run that was never interrupted.

The Prefect deployment path is the same mechanism: its flow runs `dvc repro --single-item <stage>`
(flows/pipeline.py), so a deployment rerun resumes exactly as the `dvc repro` rerun here does.

Each test starts three stage processes (reference, victim, rerun), so both are marked slow. The
reference runs in the background while the victim is killed and rerun (2 cores, ~1-2 min each).
The RetroMAE stage's version of this test is in test_reliability_training.py.

REALM uses `realm.refresh_mode: sync` here (the default's; the tests' tiny preset runs async): with
async, which index version serves a step depends on how fast the background refresh finishes, so
the loss sequence is not bit-reproducible across two runs (resumed or not). A resume at a checkpoint that is also a refresh
step rebuilds the index from the same weights the uninterrupted run refreshed from, so the sync
run is exactly reproducible.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from components import paths
from tests.conftest import build_data_and_encoders, make_workspace

pytestmark = pytest.mark.slow  # reason: three stage processes per test through dvc + Prefect + MLflow

OVERRIDES = {
    # REALM: 10 steps, a checkpoint and a (synchronous) refresh every 2
    "realm.retriever_init": "retromae",
    "realm.refresh_mode": "sync",
    "realm.refresh_every": 2,
    "realm.train.max_steps": 10,
    "realm.train.checkpoint_every": 2,
    "realm.train.keep_checkpoints": 2,
    # fine-tune: 8 retrieval steps (a checkpoint every 2), then 60 open-QA steps (every 10). A step
    # takes ~20 ms here: with only 8 QA steps, a kill at the 5th or 6th checkpoint plus up to 0.4 s
    # could land after the stage had finished (seen in CI), leaving no interrupted run to resume.
    "finetune.train.max_steps": 8,
    "finetune.train.checkpoint_every": 2,
    "finetune.qa_train.max_steps": 60,
    "finetune.qa_train.checkpoint_every": 10,
}

# stage -> (its trainers' checkpoint folders, the losses it logs, its output folder); the open-QA
# reader over REALM's own index stands for the fine-tuning stages (each runs the same Trainer)
STAGES = {
    "pretrain_realm@refreshed": (["pretrain_realm"], ["loss"], str(paths.REALM_OUT)),
    "finetune_reader@realm": (["finetune_qa_realm"], ["qa.realm.loss"], str(paths.reader_out("realm"))),
}


def _weights(ws: Path, out: str) -> dict[str, str]:
    """sha256 of every weight file the stage wrote (retriever, reader, ... in HF folders)."""
    files = sorted((ws / out).rglob("*.safetensors"))
    assert files, f"no weights under {ws / out}"
    return {str(f.relative_to(ws)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def _env(ws: Path, prefect_api: str) -> dict:
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": venv_bin + os.pathsep + os.environ["PATH"], "OMP_NUM_THREADS": "1",
           "PREFECT_API_URL": prefect_api, "MLFLOW_TRACKING_URI": f"sqlite:///{ws}/mlflow.db", "RR_PARENT_RUN_ID": ""}
    env.pop("RR_CHECKPOINT_ROOT", None)
    return env


def _launch(ws: Path, stage: str, prefect_api: str) -> subprocess.Popen:
    """`dvc repro --single-item <stage>` in its own process group (so a kill takes all of it)."""
    return subprocess.Popen(["dvc", "repro", "--single-item", stage], cwd=ws, env=_env(ws, prefect_api),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 420) -> str:
    out, _ = proc.communicate(timeout=timeout)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    return text


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


def _stage_runs(ws: Path, stage: str) -> list:
    client = MlflowClient(f"sqlite:///{ws}/mlflow.db")
    exp = client.get_experiment_by_name("retro-realm")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`dvc.stage` = '{stage}'")
    return sorted([r for r in runs if "rr.kind" not in r.data.tags], key=lambda r: r.info.start_time)  # not refresh children


def _losses(ws: Path, run_id: str, names: list[str]) -> dict[str, dict[int, float]]:
    client = MlflowClient(f"sqlite:///{ws}/mlflow.db")
    return {n: {m.step: m.value for m in client.get_metric_history(run_id, n)} for n in names}


def _checkpoints(ws: Path, trainers: list[str]) -> dict[str, list[int]]:
    """trainer -> committed checkpoint steps (the `step-*` folders; `.tmp-*` ones are not committed)."""
    out = {}
    for t in trainers:
        found = (ws / "checkpoints" / t).glob("*/checkpoints/step-*")  # checkpoints/<trainer>/<digest>/checkpoints/
        out[t] = sorted({int(p.name.split("-")[1]) for p in found})
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A workspace with data/ built and stand-in upstream models (a randomly initialised encoder as
    models/retromae and models/mlm), and a migrated MLflow store: `dvc repro --single-item` needs
    the stage's deps to exist, not to be fresh."""
    from components.config import load_params

    ws = make_workspace(tmp_path_factory.mktemp("stage_kills") / "ws", OVERRIDES)
    build_data_and_encoders(ws, load_params(ws / "params.yaml"), ("retromae/encoder", "init/encoder", "mlm/encoder"))
    MlflowClient(f"sqlite:///{ws}/mlflow.db").search_experiments()
    return ws


class _Reference:
    """One uninterrupted `dvc repro --single-item <stage>`, started in the background."""

    def __init__(self, ws: Path, stage: str, prefect_api: str):
        self.ws, self.stage = ws, stage
        self._proc, self._result = _launch(ws, stage, prefect_api), None

    def get(self) -> dict:
        if self._result is None:
            _finish(self._proc)
            _, names, out = STAGES[self.stage]
            (run,) = _stage_runs(self.ws, self.stage)
            self._result = {"ws": self.ws, "losses": _losses(self.ws, run.info.run_id, names), "weights": _weights(self.ws, out)}
        return self._result

    def stop(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()


@pytest.fixture(scope="module")
def realm_reference(base, shared_prefect_api, tmp_path_factory):
    ref = _Reference(_copy(base, tmp_path_factory.mktemp("realm_ref") / "ws"), "pretrain_realm@refreshed", shared_prefect_api)
    yield ref
    ref.stop()


@pytest.fixture(scope="module")
def finetune_base(realm_reference, tmp_path_factory) -> Path:
    """The REALM reference workspace after its run: the reader over REALM's index needs models/realm."""
    ws = _copy(realm_reference.get()["ws"], tmp_path_factory.mktemp("finetune_base") / "ws")
    return ws


def _kill_at_a_random_step(ws: Path, stage: str, prefect_api: str) -> tuple[str, dict[str, list[int]]]:
    """Start the victim, wait for a random number of checkpoints (at least one, and two short of
    the last), then a random fraction of a second more, and SIGKILL its whole process group."""
    trainers, _, _ = STAGES[stage]
    rng = random.Random()
    target = rng.randint(1, 3 if stage.startswith("pretrain_realm") else 4)  # REALM saves 5 checkpoints, the reader 6
    victim = _launch(ws, stage, prefect_api)
    seen: set[tuple[str, int]] = set()
    deadline = time.monotonic() + 400
    while len(seen) < target:
        assert victim.poll() is None, victim.stdout.read().decode(errors="replace")[-4000:]
        assert time.monotonic() < deadline, "the victim never reached its kill point"
        seen |= {(t, s) for t, steps in _checkpoints(ws, trainers).items() for s in steps}
        time.sleep(0.02)
    time.sleep(rng.uniform(0, 0.4))  # anywhere inside the next steps, checkpoint writes included
    assert victim.poll() is None, f"the {stage} stage finished before its kill point (checkpoint #{target}): give it more steps"
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    committed = _checkpoints(ws, trainers)
    return f"{stage} killed after checkpoint #{target}, committed: {committed}", committed


def _check_resume(ws: Path, stage: str, reference: dict, info: str, committed: dict[str, list[int]], rerun_stdout: str) -> None:
    trainers, names, out = STAGES[stage]
    assert f"Running stage '{stage}'" in rerun_stdout, (info, rerun_stdout[-2000:])
    killed, rerun = _stage_runs(ws, stage)
    assert killed.info.status == "RUNNING" and rerun.info.status == "FINISHED", info  # SIGKILL leaves the run open
    assert not list((ws / "checkpoints").rglob(".tmp-*")), info  # a save cut by the kill was cleaned up
    before = _losses(ws, killed.info.run_id, names)
    after = _losses(ws, rerun.info.run_id, names)
    for trainer, n in zip(trainers, names):
        ref = reference["losses"][n]
        # what the victim logged before the kill is the reference's (a prefix: the buffer flushes every ~2 s)
        assert all(before[n][s] == ref[s] for s in before[n]), (info, n)
        # the rerun starts after the newest committed checkpoint (a finished trainer: nothing to redo) ...
        start = max(committed[trainer], default=0)
        assert sorted(after[n]) == list(range(start + 1, max(ref) + 1)), (info, n, sorted(after[n]))
        # ... and logs the same losses as the uninterrupted run
        diff = {s: (after[n][s], ref[s]) for s in after[n] if after[n][s] != ref[s]}
        assert not diff, (info, n, f"resumed at step {start}", diff)
    assert _weights(ws, out) == reference["weights"], info


def test_sigkill_realm_stage_then_dvc_repro_resumes_exactly(base, realm_reference, shared_prefect_api, tmp_path):
    ws = _copy(base, tmp_path / "ws")
    info, committed = _kill_at_a_random_step(ws, "pretrain_realm@refreshed", shared_prefect_api)
    out = _finish(_launch(ws, "pretrain_realm@refreshed", shared_prefect_api))
    _check_resume(ws, "pretrain_realm@refreshed", realm_reference.get(), info, committed, out)
    # the half-built index from the kill (if any) is gone; every committed version loads
    from components.index.faiss_index import IndexStore
    (root,) = (ws / "checkpoints/pretrain_realm").iterdir()
    assert not list((root / "index").glob(".tmp-*"))
    assert IndexStore(root / "index", use_gpu=False).current() is not None


def test_sigkill_finetune_stage_then_dvc_repro_resumes_exactly(finetune_base, shared_prefect_api, tmp_path):
    ref = _Reference(_copy(finetune_base, tmp_path / "ref"), "finetune_reader@realm", shared_prefect_api)
    try:
        ws = _copy(finetune_base, tmp_path / "ws")
        info, committed = _kill_at_a_random_step(ws, "finetune_reader@realm", shared_prefect_api)
        out = _finish(_launch(ws, "finetune_reader@realm", shared_prefect_api))
        _check_resume(ws, "finetune_reader@realm", ref.get(), info, committed, out)
    finally:
        ref.stop()
