"""Checkpoints: atomic layout, exact resume after SIGKILL, corrupt-newest fallback, pickle refusal."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from components.config_shared import ComputeParams, TrainParams
from components.io import file_entry
from components.training import checkpoint as ckpt
from components.training.trainer import Trainer
from tests.scripts.tiny_train import TinyLM, make_rows, random_mask_collate

REPO = Path(__file__).resolve().parents[1]
CPU = ComputeParams(device="cpu", seed=1234, precision="fp32")  # weights compared with torch.equal: no autocast


def trainer(out: Path, max_steps: int = 10, **kw) -> Trainer:
    torch.manual_seed(0)
    kw = {"checkpoint_every": 5, "keep_checkpoints": 3, **kw}
    train = TrainParams(batch_size=8, lr=3e-3, max_steps=max_steps, **kw)
    return Trainer(TinyLM(), make_rows(), random_mask_collate, train, CPU, out, progress=False)


def rewrite_meta_hash(folder: Path, name: str) -> None:
    """What an attacker who can write the folder can also do: make the manifest agree."""
    meta = json.loads((folder / ckpt.META_FILE).read_text())
    meta["files"][name] = file_entry(folder / name)
    (folder / ckpt.META_FILE).write_text(json.dumps(meta))


class RunsShell:
    """A pickle that runs a shell command when unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ----------------------------------------------------------------------------------------------
def test_save_and_load_roundtrip_keeps_tied_weights(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    path = ckpt.save_checkpoint(tmp_path, 3, model, {"step": 3})
    assert path.name == "step-000003" and not list(tmp_path.glob(".tmp-*"))
    meta = ckpt.verify_checkpoint(path)
    assert set(meta["files"]) == {ckpt.MODEL_FILE, ckpt.STATE_FILE, "rng-rank0.pt"} and meta["step"] == 3
    torch.manual_seed(1)
    fresh = TinyLM()
    ckpt.load_model_weights(path, fresh)
    assert fresh.head.weight is fresh.emb.weight  # still tied after loading
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    assert ckpt.load_state(path) == {"step": 3}


def test_keeps_newest_checkpoints_and_removes_stale_tmp(tmp_path):
    stale = tmp_path / "checkpoints" / ".tmp-step-000007"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half written")
    result = trainer(tmp_path, max_steps=15, keep_checkpoints=2, checkpoint_every=3).fit()
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "checkpoints")] == [12, 15]
    assert result.checkpoint == tmp_path / "checkpoints" / "step-000015"
    assert not stale.exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000012", "step-000015"]  # no leftovers


def test_a_crash_while_pruning_never_leaves_a_half_deleted_step(tmp_path, monkeypatch):
    trainer(tmp_path, max_steps=6, keep_checkpoints=3, checkpoint_every=3).fit()
    root = tmp_path / "checkpoints"

    def killed(path, *a, **kw):  # the process dies after the rename, before a single file is deleted
        raise KeyboardInterrupt

    monkeypatch.setattr("components.io.shutil.rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.prune_checkpoints(root, keep=1)
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [6]  # step 3 is gone under its name, whole or not at all
    monkeypatch.undo()
    assert [p.name.split("-")[0] for p in ckpt.remove_leftovers(root)] == [".old"]
    assert sorted(p.name for p in root.iterdir()) == ["step-000006"]


def test_completed_run_resumes_as_a_no_op(tmp_path):
    trainer(tmp_path).fit()
    again = trainer(tmp_path).fit()
    assert again.resumed_from == 10 and again.step == 10 and again.checkpoint.name == "step-000010"


def test_a_full_disk_is_named_and_the_next_run_resumes_from_the_last_complete_checkpoint(tmp_path, monkeypatch):
    """torch.save on a full disk raises only "unexpected pos ... iostream error": the Trainer reports
    ENOSPC with the folder and the free space, and the rerun resumes from the last step that committed.
    With room left, the same failure is not blamed on the disk."""
    import errno
    import shutil

    real_write_state = ckpt.write_state

    def full_at_step_10(folder, state):
        if state["step"] == 10:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 46908544 vs 46908432")
        real_write_state(folder, state)

    monkeypatch.setattr(ckpt, "write_state", full_at_step_10)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=4096))
    with pytest.raises(OSError, match=r"checkpoint of step 10: no space left under .*step-000010 \(0 MiB free\)") as e:
        trainer(tmp_path).fit()
    assert e.value.errno == errno.ENOSPC and "unexpected pos" in str(e.value.__cause__)
    monkeypatch.setattr(ckpt, "write_state", real_write_state)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10 * 2**30))
    again = trainer(tmp_path).fit()
    assert again.resumed_from == 5 and again.checkpoint.name == "step-000010"
    assert not list(tmp_path.rglob(".tmp-*"))  # the half-written step is gone

    monkeypatch.setattr(ckpt, "write_state", full_at_step_10)  # room left: the original error, unchanged
    with pytest.raises(RuntimeError, match="unexpected pos"):
        trainer(tmp_path / "roomy").fit()


def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path):
    reference = trainer(tmp_path / "ref")
    reference.fit()
    t = trainer(tmp_path / "run")
    t.fit()
    root = tmp_path / "run" / "checkpoints"
    model_file = root / "step-000010" / ckpt.MODEL_FILE
    model_file.write_bytes(model_file.read_bytes()[:100])  # truncated
    with pytest.warns(ckpt.CheckpointWarning, match=r"step 10: .*model.safetensors does not match"):
        result = trainer(tmp_path / "run").fit()
    assert result.resumed_from == 5 and result.step == 10
    assert (root / "corrupt-step-000010").is_dir()  # kept for inspection, out of the way
    ckpt.verify_checkpoint(root / "step-000010")  # re-trained and re-written
    # ... and the re-trained step 10 is the same as the uninterrupted run's
    a, b = TinyLM(), TinyLM()
    ckpt.load_model_weights(root / "step-000010", a)
    ckpt.load_model_weights(tmp_path / "ref" / "checkpoints" / "step-000010", b)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_crafted_pickle_is_refused_and_never_executed(tmp_path):
    trainer(tmp_path).fit()
    folder = tmp_path / "checkpoints" / "step-000010"
    marker = tmp_path / "PWNED"
    (folder / ckpt.STATE_FILE).write_bytes(pickle.dumps(RunsShell(marker)))

    # 1) manifest not updated: the hash check rejects it before anything is unpickled
    with pytest.warns(ckpt.CheckpointWarning, match="trainer_state.pt does not match"):
        assert trainer(tmp_path).fit().resumed_from == 5
    assert not marker.exists()

    # 2) manifest updated too: weights_only refuses the pickle with a clear error
    trainer(tmp_path).fit()  # (re-creates step 10)
    (folder / ckpt.STATE_FILE).write_bytes(pickle.dumps(RunsShell(marker)))
    rewrite_meta_hash(folder, ckpt.STATE_FILE)
    with pytest.raises(ckpt.CheckpointError, match=r"refusing to load .*trainer_state.pt.*weights_only"):
        trainer(tmp_path).fit()
    assert not marker.exists()

    # 3) the same inside torch.save's zip container, in an RNG file
    torch.save({"torch": RunsShell(marker)}, folder / "rng-rank0.pt")
    with pytest.raises(ckpt.CheckpointError, match="refusing to load"):
        ckpt.load_rng(folder, 0)
    assert not marker.exists()


def test_manifest_cannot_point_outside_its_folder(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, TinyLM(), {"step": 1})
    meta = json.loads((path / ckpt.META_FILE).read_text())
    meta["files"]["../x"] = {"sha256": "0" * 64, "bytes": 0}
    (path / ckpt.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="outside"):
        ckpt.verify_checkpoint(path)
    with pytest.warns(ckpt.CheckpointWarning, match="skipping corrupt checkpoint step 1"):
        assert ckpt.latest_checkpoint(tmp_path) is None


# ----------------------------------------------------------------------------------------------
def _launch(out: Path, log: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "tests.scripts.tiny_train", "--out", str(out), "--log-file", str(log),
           "--max-steps", "20", "--checkpoint-every", "5", *extra]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _losses(log: Path) -> dict[int, float]:
    complete = log.read_text().split("\n")[:-1] if log.exists() else []  # a line being written is skipped
    lines = [json.loads(x) for x in complete if x.strip()]
    return {d["step"]: d["loss"] for d in lines}


def test_sigkill_then_resume_gives_the_uninterrupted_loss_sequence(tmp_path):
    # Uninterrupted reference and the victim run side by side (same seed, CPU, dropout + random masking).
    ref = _launch(tmp_path / "ref", tmp_path / "ref.jsonl")
    victim = _launch(tmp_path / "run", tmp_path / "killed.jsonl", "--sleep", "0.1")
    deadline = time.time() + 120
    while max(_losses(tmp_path / "killed.jsonl"), default=0) < 12:
        assert victim.poll() is None, victim.stderr.read().decode()
        assert time.time() < deadline, "victim never reached step 12"
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = max(_losses(tmp_path / "killed.jsonl"))
    assert 12 <= killed_at < 20

    resumed = _launch(tmp_path / "run", tmp_path / "resumed.jsonl")
    assert resumed.wait(timeout=120) == 0, resumed.stderr.read().decode()
    assert ref.wait(timeout=120) == 0, ref.stderr.read().decode()

    result = json.loads((tmp_path / "run" / "result.json").read_text())
    start = result["resumed_from"]
    assert start in (10, 15) and start <= killed_at and result["step"] == 20
    reference, after = _losses(tmp_path / "ref.jsonl"), _losses(tmp_path / "resumed.jsonl")
    assert sorted(after) == list(range(start + 1, 21))
    assert all(after[s] == reference[s] for s in after), [(s, after[s], reference[s]) for s in after]
    before = _losses(tmp_path / "killed.jsonl")
    assert all(before[s] == reference[s] for s in before)
    root = tmp_path / "run" / "checkpoints"
    assert not list(root.glob(".tmp-*"))
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [15, 20]
