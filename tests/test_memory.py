"""Host memory: no tensor (and so no autograd graph) outlives a training step, the leak check
catches one that does, the allocator scripts/py preloads is the one the stage runs on, and RSS
reaches the logged metrics. Mechanisms only: the RSS slopes are bench/bench_memory.py's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from components.config_shared import ComputeParams
from components.data.masking import RetroMAECollator
from components.data.special_tokens import SpecialTokens
from components.models.retromae import RetroMAE
from components.training import memory
from components.training.trainer import Trainer
from tests.conftest import tiny_params

ROOT = Path(__file__).resolve().parents[1]
IDS = SpecialTokens(pad=0, cls=1, sep=2, mask=3, vocab_size=400, special=(0, 1, 2, 3))


def varying_rows(n: int = 256, seed: int = 0) -> list[dict]:
    """Blocks of 5..60 tokens: every batch pads to its own length, as the real corpora do."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        k = int(rng.integers(5, 61))
        rows.append({"input_ids": rng.integers(4, 400, k).tolist(), "word_ids": list(range(k))})
    return rows


class KeepsOutputs(nn.Module):
    """A model that stores every output it returns, graph included: the leak the check must see."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.kept = inner, []

    def forward(self, batch):
        out = self.inner(batch)
        self.kept.append(out["loss"])
        return out


def count_per_step(tmp_path, model: nn.Module, steps: int, at: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    """Train `steps` RetroMAE steps on varying shapes; (live tensors, with a graph) after each step in `at`."""
    p = tiny_params(**{"retromae.train.max_steps": steps, "retromae.train.batch_size": 4,
                       "retromae.train.checkpoint_every": 10_000})
    seen: dict[int, tuple[int, int]] = {}

    def on_step_end(step: int, trainer: Trainer) -> None:
        if step in at:
            seen[step] = memory.live_tensors()

    compute = ComputeParams(device="cpu", seed=1234, malloc_trim_every=0, precision="fp32")
    Trainer(model, varying_rows(), RetroMAECollator(IDS, p.retromae, seed=1), p.retromae.train, compute, tmp_path,
            hooks={"on_step_end": on_step_end}, progress=False).fit()
    return seen


def tiny_retromae() -> RetroMAE:
    torch.manual_seed(0)
    return RetroMAE.from_params(tiny_params().retromae, IDS)


def test_no_tensor_outlives_a_training_step(tmp_path):
    # 300 steps on batches of changing shapes: the live tensors after step 300 are those after
    # step 20 (parameters, optimiser state, the window sums), and none holds a graph.
    seen = count_per_step(tmp_path, tiny_retromae(), 300, at=(20, 150, 300))
    assert seen[20][1] == seen[150][1] == seen[300][1] == 0, seen
    assert seen[20][0] == seen[150][0] == seen[300][0], seen


def test_the_check_sees_a_loop_that_keeps_its_graphs(tmp_path):
    # The negative control: the same loop, one loss tensor (and its graph) kept per step.
    seen = count_per_step(tmp_path, KeepsOutputs(tiny_retromae()), 40, at=(10, 40))
    assert seen[10][1] >= 10 and seen[40][1] >= 40, seen
    assert seen[40][0] - seen[10][0] >= 30, seen


def test_the_trainer_logs_rss_and_trims_glibc_only_when_asked(tmp_path):
    logged = []
    p = tiny_params(**{"retromae.train.max_steps": 4, "retromae.train.batch_size": 4})
    compute = ComputeParams(device="cpu", seed=1, malloc_trim_every=2, precision="fp32")
    t = Trainer(tiny_retromae(), varying_rows(32), RetroMAECollator(IDS, p.retromae, seed=1), p.retromae.train, compute,
                tmp_path, log_fn=lambda m, s: logged.append(m), progress=False)
    t.fit()
    assert len(logged) == 4 and all(0 < m["rss_mb"] <= memory.peak_rss_mb() + 1 for m in logged)
    assert t.heap.enabled == (memory.allocator() == "glibc")
    assert not memory.HeapTrimmer(0).enabled


@pytest.mark.parametrize("choice, expected", [(None, "mimalloc"), ("system", "glibc"), ("mimalloc", "mimalloc")])
def test_scripts_py_preloads_the_allocator(choice, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "RR_ALLOCATOR", "RR_PYTHON")}
    if choice:
        env["RR_ALLOCATOR"] = choice
    out = subprocess.run([str(ROOT / "scripts/py"), "-c", "from components.training import memory; print(memory.allocator())"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


def test_scripts_py_names_an_unknown_allocator():
    env = {**os.environ, "RR_ALLOCATOR": "hoard"}
    out = subprocess.run([str(ROOT / "scripts/py"), "-c", "print(1)"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 127 and "RR_ALLOCATOR=hoard" in out.stderr and "mimalloc" in out.stderr
