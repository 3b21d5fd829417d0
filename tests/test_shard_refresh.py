"""The sharded refresh (components/index/shard.py): shards on batch boundaries, 2 gloo processes
build the single process's index bit for bit (vectors and retrieved candidates), and an async
refresh whose gathers run in a background thread beside "training" all-reduces stays in lockstep:
every rank swaps the same versions at the same steps, and a failure on one rank fails it on all.

The worker half runs under torchrun: `python -m torch.distributed.run --nproc_per_node=2 -m
tests.test_shard_refresh --out DIR` (or plain `python -m tests.test_shard_refresh` for one process).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from components.index.shard import shard_range

REPO = Path(__file__).resolve().parents[1]
VOCAB, DIM, N_BLOCKS, BATCH = 97, 16, 203, 16  # 13 batches: uneven over 2 ranks, a short last batch


@pytest.mark.parametrize("n,bs,ws", [(203, 16, 2), (203, 16, 3), (16, 16, 2), (5, 8, 4), (1000, 7, 8)])
def test_shard_range_tiles_the_rows_on_batch_boundaries(n, bs, ws):
    ranges = [shard_range(n, bs, r, ws) for r in range(ws)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in rank order
    assert all(a % bs == 0 or a == b for a, b in ranges)  # each (non-empty) shard starts on a batch boundary
    sizes = [(b - a + bs - 1) // bs for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_one_process_is_embed_and_build_itself():
    from components.index import embed as embed_lib
    from components.index.shard import embed_and_build_sharded

    blocks, enc, collate = _world()
    ids = [f"b{i}" for i in range(N_BLOCKS)]
    a, _ = embed_and_build_sharded(enc, blocks, ids, batch_size=BATCH, collate=collate, index_type="flat")
    b, _ = embed_lib.embed_and_build(enc, blocks, ids, batch_size=BATCH, collate=collate, index_type="flat")
    assert a.embeddings().tobytes() == b.embeddings().tobytes()


@pytest.mark.slow
def test_two_gloo_ranks_build_the_single_process_index_bit_for_bit_and_refresh_in_lockstep(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    one = subprocess.run([sys.executable, "-m", "tests.test_shard_refresh", "--out", str(tmp_path / "one")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "tests.test_shard_refresh", "--out", str(tmp_path / "two")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]

    single = np.load(tmp_path / "one" / "rank0.npz")
    for rank in (0, 1):
        got = np.load(tmp_path / "two" / f"rank{rank}.npz")
        assert got["flat_emb"].tobytes() == single["flat_emb"].tobytes(), rank
        for kind in ("flat", "ivf"):
            assert np.array_equal(got[f"{kind}_rows"], single[f"{kind}_rows"]), (rank, kind)  # the same candidates
            assert got[f"{kind}_scores"].tobytes() == single[f"{kind}_scores"].tobytes(), (rank, kind)

    logs = [json.loads((tmp_path / "two" / f"async{r}.json").read_text()) for r in (0, 1)]
    assert logs[0] == logs[1]  # every step searched the same version (and content) on both ranks
    ok = [e for e in logs[0]["events"] if e["kind"] == "done"]
    failed = [e for e in logs[0]["events"] if e["kind"] == "error"]
    second = logs[0]["started"][1]
    assert [e["step"] for e in failed] == [second]  # injected on rank 1 only; rank 0 built it but did not swap it
    assert len(ok) >= 3 and all(e["step"] != second for e in ok)
    assert len({e["digest"] for e in ok}) == len(ok)  # each swap brought new weights' vectors
    assert logs[0]["timing"]["ok"] == len(ok) and logs[0]["timing"]["failed"] == 1


# ----------------------------------------------------------------------------------------------
# the worker (one process, or one rank under torchrun)
# ----------------------------------------------------------------------------------------------
class _Tower(torch.nn.Module):
    """A padding-sensitive passage tower: a transformer layer over padded batches, [CLS] out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.layer = torch.nn.TransformerEncoderLayer(DIM, 2, 32, dropout=0.0, batch_first=True)

    def forward(self, input_ids, attention_mask):
        h = self.layer(self.emb(input_ids), src_key_padding_mask=attention_mask == 0)  # (B, L, H)
        return torch.nn.functional.normalize(h[:, 0], dim=-1)  # (B, H)


def _world():
    import datasets

    rng = np.random.default_rng(0)
    ids = [rng.integers(1, VOCAB, rng.integers(3, 30)).tolist() for _ in range(N_BLOCKS)]
    blocks = datasets.Dataset.from_dict({"input_ids": ids})
    tower = _Tower().eval()

    def collate(rows):
        L = max(len(r["input_ids"]) for r in rows)  # padded to the batch's longest: batch-dependent
        x = torch.zeros(len(rows), L, dtype=torch.long)
        for i, r in enumerate(rows):
            x[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        return {"input_ids": x, "attention_mask": (x != 0).long()}

    return blocks, (lambda b: tower(**b)), collate


def _digest(index) -> str:
    return hashlib.sha256(index.embeddings().tobytes()).hexdigest()[:16]


def _async_run(groups, blocks, collate, rank: int, world: int, out: Path) -> None:
    """A fake training loop: an all-reduce on the default group every step (DDP's place), the
    refresh every 2 steps in the background with weights that move each step; rank 0 builds
    slower; the second build fails on rank 1 only, before its shard's vote. The loop runs until
    4 builds were delivered: that count agrees across ranks only if the deliveries do."""
    import torch.distributed as dist

    from components.index.shard import CollectiveRefresher, embed_and_build_sharded

    model = _Tower().eval()
    ids = [f"b{i}" for i in range(N_BLOCKS)]
    active: dict = {"version": 0, "digest": None}
    events: list[dict] = []

    started = []

    def build(snap, step):
        started.append(step)
        if rank == 0:
            time.sleep(0.3)
        if rank == 1 and len(started) == 2:
            raise RuntimeError("injected on rank 1")
        enc = lambda b: snap(**b)  # noqa: E731
        return embed_and_build_sharded(enc, blocks, ids, batch_size=BATCH, collate=collate, groups=groups,
                                       index_type="flat", step=step)

    def on_done(res):
        active.update(version=active["version"] + 1, digest=_digest(res.index))
        events.append({"kind": "done", "step": res.step, "swap_step": res.swap_step, "digest": active["digest"]})

    def on_error(exc, step):
        events.append({"kind": "error", "step": step})

    r = CollectiveRefresher(build, on_done=on_done, on_error=on_error, every=2, mode="async", groups=groups)
    seen, step = [], 0
    while len(events) < 4 and step < 400:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * step)  # the same update on every rank
        t = torch.ones(4)
        if world > 1:
            dist.all_reduce(t)  # the training thread's collective, while a gather may be in flight
        time.sleep(0.05)
        r.poll(step)
        r.maybe_start(step, model)
        seen.append([step, active["version"], active["digest"]])
    r.wait(step=step + 1)
    r.close()
    timing = {k: r.timing()[k] for k in ("ok", "failed", "started")}
    (out / f"async{rank}.json").write_text(json.dumps({"seen": seen, "events": events, "timing": timing,
                                                       "started": started}))


def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist

    from components.index.shard import RefreshGroups, embed_and_build_sharded

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if world > 1:
        dist.init_process_group("gloo")
    groups = RefreshGroups.create()
    blocks, enc, collate = _world()
    ids = [f"b{i}" for i in range(N_BLOCKS)]
    queries = np.random.default_rng(1).standard_normal((40, DIM)).astype(np.float32)
    res = {}
    for kind in ("flat", "ivf"):  # the refresh's own call; group None = embed.embed_and_build
        index, _ = embed_and_build_sharded(enc, blocks, ids, batch_size=BATCH, collate=collate, groups=groups,
                                           index_type=kind, nlist=8, nprobe=2, use_gpu=False)
        scores, rows = index.search(queries, 8)
        res.update({f"{kind}_rows": rows, f"{kind}_scores": scores})
        if kind == "flat":
            res["flat_emb"] = index.embeddings()  # (N, d): the gathered rows, in block order
    np.savez(out / f"rank{rank}.npz", **res)
    if world > 1:
        _async_run(groups, blocks, collate, rank, world, out)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
