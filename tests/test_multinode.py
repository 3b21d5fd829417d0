"""Multi-node torchrun: the launch command from compute.* (c10d rendezvous), the joining node's
entry point, and a loopback run: two launchers on 127.0.0.1 as two "nodes" (1 gloo process each)
train RetroMAE and end with the weights of one process with the same global batch.

The worker half: `python -m tests.test_multinode --out DIR --max-steps N` (one process or a rank).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from components.config_shared import ComputeParams
from components.training import distributed as D

REPO = Path(__file__).resolve().parents[1]
VOCAB, SEQ, ROWS, BATCH = 120, 24, 64, 8


def test_launch_command_one_node_is_standalone_and_many_nodes_rendezvous(monkeypatch):
    monkeypatch.delenv(D.ENV_RDZV_ENDPOINT, raising=False)
    monkeypatch.delenv(D.ENV_RDZV_ID, raising=False)
    one = D.launch_command(ComputeParams(nproc=2), "components.stages.pretrain_realm", run_id="r1")
    assert one == D.torchrun_command("components.stages.pretrain_realm", [], 2)
    assert "--standalone" in one and not any(a.startswith("--rdzv") for a in one)

    many = ComputeParams(nproc=8, nnodes=2, rdzv_endpoint="node0.svc:29400")
    cmd = D.launch_command(many, "components.stages.pretrain_realm", run_id="abc123")
    assert cmd[3:9] == ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0.svc:29400", "--rdzv-id=abc123",
                        "--nproc_per_node=8", "-m"]
    assert "--standalone" not in cmd
    assert "--rdzv-id=fixed" in D.launch_command(many.model_copy(update={"rdzv_id": "fixed"}), "m", run_id="abc123")
    monkeypatch.setenv(D.ENV_RDZV_ENDPOINT, "job-0.rdzv:29500")  # the cluster's word wins
    monkeypatch.setenv(D.ENV_RDZV_ID, "flowrun-7")
    cmd = D.launch_command(many, "m", run_id="abc123")
    assert "--rdzv-endpoint=job-0.rdzv:29500" in cmd and "--rdzv-id=flowrun-7" in cmd
    monkeypatch.delenv(D.ENV_RDZV_ENDPOINT)
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        D.launch_command(many.model_copy(update={"rdzv_endpoint": None}), "m", run_id="x")
    with pytest.raises(ValueError, match="nnodes"):
        D.torchrun_command("m", [], 1, nnodes=0)


def test_rendezvous_params_are_validated():
    with pytest.raises(ValueError):
        ComputeParams(rdzv_endpoint="no-port")
    with pytest.raises(ValueError):
        ComputeParams(nnodes=0)
    assert ComputeParams().nnodes == 1 and ComputeParams().rdzv_endpoint is None  # params.yaml: one node


def test_join_refuses_a_single_node_config(tmp_path, monkeypatch, capsys):
    from flows._torchrun import join

    monkeypatch.setenv("RR_PARAMS", str(REPO / "params.yaml"))
    with pytest.raises(SystemExit):
        join(["--join", "--module", "components.stages.pretrain_retromae"])
    assert "nothing to join" in capsys.readouterr().err


@pytest.mark.slow
def test_two_loopback_nodes_train_retromae_like_one_process(tmp_path):
    """2 nodes x 1 process x micro 4 vs 1 process x 8: the same weights and losses after 4 steps."""
    from safetensors.torch import load_file

    from tests.servers import free_port
    from tests.test_ddp import two_rank_weights

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", D.ENV_RDZV_ENDPOINT, D.ENV_RDZV_ID):
        env.pop(k, None)
    args = ["--max-steps", "4"]
    many = ComputeParams(nproc=1, nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id="loopback")
    node = D.launch_command(many, "tests.test_multinode", [*args, "--out", str(tmp_path / "multi")])
    nodes = [subprocess.Popen(node, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    one = subprocess.run([sys.executable, "-m", "tests.test_multinode", *args, "--out", str(tmp_path / "single")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    outs = [p.communicate(timeout=600)[0] for p in nodes]
    assert one.returncode == 0, one.stderr[-3000:]
    for p, out in zip(nodes, outs):
        assert p.returncode == 0, out[-3000:]

    a = two_rank_weights(tmp_path / "multi", 4)
    b = load_file(str(tmp_path / "single" / "checkpoints" / "step-000004" / "model.safetensors"))
    assert a.keys() == b.keys()
    start = load_file(str(tmp_path / "single" / "init.safetensors"))
    assert max((b[k] - start[k]).abs().max().item() for k in b) > 1e-4  # it did train
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-5, worst
    la = [json.loads(x)["loss"] for x in (tmp_path / "multi" / "loss.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (tmp_path / "single" / "loss.jsonl").read_text().splitlines()]
    assert len(la) == len(lb) == 4 and la == pytest.approx(lb, abs=1e-5)


# ----------------------------------------------------------------------------------------------
# the worker: a tiny RetroMAE on the shared Trainer
# ----------------------------------------------------------------------------------------------
def _rows() -> list[dict]:
    """Equal-length rows ([CLS] tokens [SEP]), each with its own decoder seed."""
    import numpy as np

    rng = np.random.default_rng(0)
    rows = []
    for i in range(ROWS):
        ids = [2, *rng.integers(5, VOCAB, SEQ - 2).tolist(), 3]
        words = [-1, *range(SEQ - 2), -1]
        rows.append({"input_ids": ids, "word_ids": words, "seed": 1000 + i})
    return rows


def _collate(rows: list[dict]) -> dict:
    """Layout-free masks: fixed encoder positions and a per-row decoder seed, so a row's loss terms
    do not depend on which rank or micro-batch it lands in; equal counts per row make the
    token-mean loss a mean of per-row means, which DDP's gradient average reproduces."""
    import torch

    ids = torch.tensor([r["input_ids"] for r in rows])  # (B, L)
    words = torch.tensor([r["word_ids"] for r in rows])  # (B, L)
    mask = (torch.arange(ids.shape[1]) % 4 == 1).expand_as(ids) & (words >= 0)
    return {"encoder_input_ids": ids.masked_fill(mask, 4), "attention_mask": torch.ones_like(ids),
            "encoder_labels": ids.masked_fill(~mask, -100), "word_ids": words, "decoder_input_ids": ids,
            "decoder_seed": torch.tensor([r["seed"] for r in rows])}


def main(argv: list[str] | None = None) -> None:
    import torch
    from safetensors.torch import save_file

    from components.config_shared import EncoderParams, TrainParams
    from components.config_stages import RetroMAEParams
    from components.data.special_tokens import SpecialTokens
    from components.models.retromae import RetroMAE
    from components.training.trainer import Trainer

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-steps", type=int, default=4)
    a = ap.parse_args(argv)
    out = Path(a.out)
    ids = SpecialTokens(pad=0, cls=2, sep=3, mask=4, vocab_size=VOCAB, special=(0, 1, 2, 3, 4))
    enc = EncoderParams(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position=SEQ, dropout=0.0)
    params = RetroMAEParams(encoder=enc, max_len=SEQ)
    torch.manual_seed(0)  # the same init in every process (DDP also broadcasts rank 0's weights)
    model = RetroMAE.from_params(params, ids)
    train = TrainParams(batch_size=BATCH, grad_accum=1, lr=3e-3, max_steps=a.max_steps, checkpoint_every=a.max_steps,
                        keep_checkpoints=1, warmup_ratio=0.0)
    compute = ComputeParams(device="cpu", num_threads=1, precision="fp32")
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(out / "init.safetensors"))
    log = open(out / "loss.jsonl", "a") if rank == 0 else None

    def log_fn(metrics: dict, step: int) -> None:
        if log is not None:
            log.write(json.dumps({"step": step, **metrics}) + "\n")
            log.flush()

    try:
        trainer = Trainer(model, _rows(), _collate, train, compute, out, log_fn=log_fn, progress=False)
        result = trainer.fit()
        if trainer.is_rank0:
            (out / "result.json").write_text(json.dumps({"step": result.step, "world_size": trainer.world_size}))
    finally:
        D.cleanup()


if __name__ == "__main__":
    main()
