"""Distributed plumbing: torchrun command, streamed subprocess output, 2-process gloo == 1 process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from components.config_shared import ComputeParams
from components.training import distributed as D

REPO = Path(__file__).resolve().parents[1]


def test_torchrun_command_module_and_script():
    cmd = D.torchrun_command("components.stages.retromae", ["--out", "x", 3], nproc=2)
    assert cmd == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   "-m", "components.stages.retromae", "--out", "x", "3"]  # fmt: skip
    assert D.torchrun_command("tests/scripts/tiny_train.py", [], 4, python="py")[-2:] == [
        "--nproc_per_node=4", "tests/scripts/tiny_train.py"]  # fmt: skip
    with pytest.raises(ValueError, match="'--log' abbreviates torchrun options"):
        D.torchrun_command("m", ["--log", "f"], 2)
    with pytest.raises(ValueError, match="nproc"):
        D.torchrun_command("m", [], 0)


def test_run_streaming_hands_over_each_line_and_returns_rc():
    lines: list[str] = []
    code = "import sys; print('one'); print('two', file=sys.stderr); sys.stdout.flush(); print('three'); sys.exit(3)"
    rc = D.run_streaming([sys.executable, "-c", code], env={"X": "1"}, log=lines.append)
    assert rc == 3
    assert lines[0] == "one" and sorted(lines) == ["one", "three", "two"]
    lines.clear()
    assert D.run_streaming([sys.executable, "-c", "import os; print(os.environ['X'])"], {"X": "42"}, lines.append) == 0
    assert lines == ["42"]


def test_init_distributed_single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    rank, world, local, device = D.init_distributed(ComputeParams(device="cpu"))
    assert (rank, world, local, device.type) == (0, 1, 0, "cpu")
    assert D.is_rank0() and D.get_world_size() == 1
    D.barrier()  # no-op without a process group
    with pytest.warns(UserWarning, match="not launched by torchrun"):
        D.init_distributed(ComputeParams(device="cpu", nproc=2))


@pytest.mark.slow
def two_rank_weights(run_dir: Path, step: int) -> dict:
    """The weights a 2-rank run saved at `step`, after checking it ran as 2 ranks and kept both
    ranks' RNG states."""
    result = json.loads((run_dir / "result.json").read_text())
    assert result["world_size"] == 2 and result["step"] == step
    ckpt = run_dir / "checkpoints" / f"step-{step:06d}"
    assert (ckpt / "rng-rank0.pt").is_file() and (ckpt / "rng-rank1.pt").is_file()
    return load_file(str(ckpt / "model.safetensors"))


def test_two_process_gloo_matches_one_process(tmp_path):
    """Same global batch (8): 2 ranks x micro 4 vs 1 rank x 8 -> the same weights after 6 steps."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    common = ["--max-steps", "6", "--checkpoint-every", "3", "--batch-size", "8", "--dropout", "0", "--mask", "fixed"]

    def args(name: str) -> list[str]:
        return ["--out", str(tmp_path / name), "--log-file", str(tmp_path / f"{name}.jsonl"), *common]

    two = subprocess.Popen(D.torchrun_command("tests.scripts.tiny_train", args("ddp"), nproc=2), cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    one = subprocess.run([sys.executable, "-m", "tests.scripts.tiny_train", *args("single")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    out, _ = two.communicate(timeout=300)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, out

    a = two_rank_weights(tmp_path / "ddp", 6)
    b = load_file(str(tmp_path / "single" / "checkpoints" / "step-000006" / "model.safetensors"))
    assert a.keys() == b.keys()
    mid = load_file(str(tmp_path / "ddp" / "checkpoints" / "step-000003" / "model.safetensors"))
    assert max((a[k] - mid[k]).abs().max().item() for k in a) > 1e-3  # it did train
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-5, worst
    # logged (all-reduced) loss equals the single process's
    la = [json.loads(x) for x in (tmp_path / "ddp.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in (tmp_path / "single.jsonl").read_text().splitlines()]
    assert [d["step"] for d in la] == list(range(1, 7))  # rank 0 only: one line per step
    for x, y in zip(la, lb):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5)
