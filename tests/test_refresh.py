"""The index refresh library: embedding the corpus, encoder snapshots, staleness, the async refresher."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from components.index.faiss_index import BlockIndex, IndexStore
from components.index.embed import embed_and_build, embed_blocks
from components.index.refresh import AsyncRefresher, snapshot_module, staleness

VOCAB, DIM = 50, 8


class TinyEncoder(torch.nn.Module):
    """encode_passage stand-in: mean of token embeddings over the attention mask."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.emb(input_ids))  # (B, L, H)
        m = attention_mask.unsqueeze(-1).float()  # (B, L, 1)
        return (h * m).sum(1) / m.sum(1)  # (B, H)


def _rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"block_id": f"b{i}", "input_ids": rng.integers(1, VOCAB, rng.integers(2, 9)).tolist()} for i in range(n)]


def _collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    L = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask}


# ----------------------------------------------------------------------------------------------
# embed_blocks / snapshot_module
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["list", "generator", "hf_dataset"])
def test_embed_blocks_matches_direct_encoding(source):
    rows = _rows(23)
    model = snapshot_module(TinyEncoder())
    seen_modes = []

    def encode(batch):
        seen_modes.append(torch.is_inference_mode_enabled())
        return model(**batch)

    if source == "list":
        blocks = rows
    elif source == "generator":
        blocks = (r for r in rows)
    else:
        datasets = pytest.importorskip("datasets")
        blocks = datasets.Dataset.from_list(rows)
    emb, stats = embed_blocks(encode, blocks, batch_size=5, collate=_collate, progress=False)

    assert emb.shape == (23, DIM) and emb.dtype == np.float32
    with torch.no_grad():
        want = torch.cat([model(**_collate(rows[i : i + 5])) for i in range(0, 23, 5)]).numpy()
    np.testing.assert_allclose(emb, want, rtol=1e-6)
    assert all(seen_modes) and len(seen_modes) == 5  # ceil(23 / 5) batches, all in inference mode
    assert stats["n_blocks"] == 23 and stats["dim"] == DIM
    assert stats["n_tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert stats["blocks_per_s"] > 0 and stats["tokens_per_s"] > 0


def test_embed_blocks_rejects_bad_encoder_output():
    with pytest.raises(ValueError, match=r"\(B, d\)"):
        embed_blocks(lambda b: torch.zeros(3), _rows(3), 3, _collate, progress=False)
    with pytest.raises(ValueError, match="no blocks"):
        embed_blocks(lambda b: torch.zeros(1, 2), [], 3, _collate, progress=False)


def test_snapshot_is_frozen_and_independent():
    model = TinyEncoder().train()
    model(**_collate(_rows(4))).sum().backward()
    snap = snapshot_module(model)
    assert not snap.training and model.training
    assert all(not p.requires_grad and p.grad is None for p in snap.parameters())
    assert all(p.requires_grad and p.grad is not None for p in model.parameters())
    before = snap.emb.weight.clone()
    with torch.no_grad():
        model.emb.weight.add_(1.0)  # training continues
    torch.testing.assert_close(snap.emb.weight, before)
    # eval mode: dropout off, so the snapshot embeds deterministically
    batch = _collate(_rows(4))
    torch.testing.assert_close(snap(**batch), snap(**batch))
    assert snapshot_module(model, device="cpu").emb.weight.device.type == "cpu"


# ----------------------------------------------------------------------------------------------
# staleness
# ----------------------------------------------------------------------------------------------
def test_staleness_identical_perturbed_and_reordered():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, DIM)).astype(np.float32)
    ids = [f"b{i}" for i in range(300)]
    q = rng.standard_normal((40, DIM)).astype(np.float32)
    base = BlockIndex.build(x, ids, "flat")

    assert staleness(q, base, base, k=5) == 1.0
    assert staleness(q, base, BlockIndex.build(x.copy(), ids, "flat"), k=5) == 1.0
    perm = rng.permutation(300)  # same blocks, different row order: still identical retrieval
    assert staleness(q, base, BlockIndex.build(x[perm], np.asarray(ids)[perm], "flat"), k=5) == 1.0

    small = staleness(q, base, BlockIndex.build(x + 0.3 * rng.standard_normal(x.shape).astype(np.float32), ids, "flat"), k=5)
    large = staleness(q, base, BlockIndex.build(rng.standard_normal(x.shape).astype(np.float32), ids, "flat"), k=5)
    assert 0.0 <= large < small < 1.0, (small, large)


# ----------------------------------------------------------------------------------------------
# AsyncRefresher
# ----------------------------------------------------------------------------------------------
def _index_for(step: int) -> BlockIndex:
    x = np.random.default_rng(step).standard_normal((20, 4)).astype(np.float32)
    return BlockIndex.build(x, None, "flat").with_meta(step=step)


def test_sync_mode_builds_inline_on_cadence(tmp_path):
    store = IndexStore(tmp_path)
    store.publish(_index_for(0), step=0)
    calls = []

    def build(snapshot, step):
        calls.append(step)
        return _index_for(step), {"blocks": 20}

    r = AsyncRefresher(build, on_done=lambda res: store.publish(res.index, res.step), every=2, mode="sync")
    delivered = []
    for step in range(1, 8):
        res = r.poll(step)
        if res is not None:
            delivered.append((res.step, res.swap_step, res.ok))
        started = r.maybe_start(step)
        assert started == (step % 2 == 0)
        if started:  # sync: the build already ran, inside maybe_start
            assert calls[-1] == step and r.busy
    assert calls == [2, 4, 6]
    assert delivered == [(2, 3, True), (4, 5, True), (6, 7, True)]
    assert store.current().step == 6 and store.versions() == [1, 2, 3, 4]
    t = r.timing()
    assert t["ok"] == 3 and t["failed"] == 0 and t["hidden_s"] == 0.0 and t["fraction_hidden"] == 0.0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failed_build_keeps_old_index_and_retries_next_cadence(tmp_path, mode):
    store = IndexStore(tmp_path)
    store.publish(_index_for(0), step=0)
    errors = []

    def build(snapshot, step):
        if step == 3:
            raise RuntimeError("OOM while embedding")
        return _index_for(step), {}

    r = AsyncRefresher(
        build,
        on_done=lambda res: store.publish(res.index, res.step),
        on_error=lambda exc, step: errors.append((str(exc), step)),
        every=3,
        mode=mode,
    )
    for step in range(1, 10):
        r.wait(step=step) if r.busy else None  # deterministic: deliver before the next step
        if step == 4:  # the failure was delivered; the old index is still current
            assert errors == [("OOM while embedding", 3)]
            assert store.current().step == 0 and store.versions() == [1]
        assert not r.maybe_start(step) or step % 3 == 0
    r.wait(step=10)
    r.close()
    assert errors == [("OOM while embedding", 3)]
    assert [store.load(v).step for v in store.versions()] == [0, 6, 9]  # retried at 6, again at 9
    t = r.timing()
    assert (t["started"], t["ok"], t["failed"]) == (3, 2, 1)


def test_async_build_runs_concurrently_with_training():
    release = threading.Event()
    in_build = threading.Event()
    model = TinyEncoder()
    got = {}

    def build(snapshot, step):
        got["weight"] = snapshot.emb.weight.clone()
        got["thread"] = threading.current_thread().name
        in_build.set()
        assert release.wait(10), "training thread never released the build"
        return _index_for(step), {"blocks": 20}

    done = []
    r = AsyncRefresher(build, on_done=done.append, every=2, mode="async")
    w_at_snapshot = model.emb.weight.detach().clone()
    assert r.maybe_start(2, model)
    assert in_build.wait(10)
    with torch.no_grad():
        model.emb.weight.add_(1.0)  # training steps continue while the build runs
    for step in (3, 4, 5):
        assert r.poll(step) is None and r.busy  # not finished: nothing to swap yet
        assert not r.maybe_start(step, model)  # due at 4 and 5, deferred while busy
    release.set()
    deadline = time.monotonic() + 10
    res = None
    while res is None and time.monotonic() < deadline:  # the training loop polls once per step
        time.sleep(0.01)
        res = r.poll(6)
    r.close()
    assert res is not None and res.ok and res.step == 2 and res.swap_step == 6 and done == [res]
    assert got["thread"] != threading.current_thread().name
    torch.testing.assert_close(got["weight"], w_at_snapshot)  # the snapshot, not the live weights
    t = r.timing()
    assert t["steps_due_while_busy"] == 2 and t["steps_overlapped"] >= 3
    assert t["hidden_s"] > 0 and 0 < t["fraction_hidden"] <= 1
    assert r.maybe_start(6, model)  # due since step 4: starts as soon as the last one is delivered
    assert r.wait(step=7).ok


def test_wait_counts_as_blocked_time():
    def build(snapshot, step):
        time.sleep(0.2)
        return _index_for(step), {}

    r = AsyncRefresher(build, every=1)
    r.maybe_start(1)
    res = r.wait(step=1)  # the trainer blocks on the whole build: nothing was hidden
    t = r.timing()
    assert res.ok and t["wait_s"] >= 0.15 and t["hidden_s"] < 0.05 and t["fraction_hidden"] < 0.25


def test_bad_build_return_and_snapshot_failure_go_to_on_error():
    errors = []
    r = AsyncRefresher(lambda s, step: ("not an index", {}), on_error=lambda e, s: errors.append(type(e)), every=1, mode="sync")
    r.maybe_start(1)
    assert not r.poll(1).ok and errors == [TypeError]

    def bad_snapshot(module):
        raise RuntimeError("cannot copy")

    r = AsyncRefresher(lambda s, step: (_index_for(step), {}), on_error=lambda e, s: errors.append(s), every=1, snapshot_fn=bad_snapshot)
    assert not r.maybe_start(1, TinyEncoder())
    assert not r.poll(1).ok and errors == [TypeError, 1]
    assert r.maybe_start(2)  # no module: nothing to snapshot, retried at the next cadence
    assert r.wait(step=2).ok
    with pytest.raises(ValueError):
        AsyncRefresher(lambda s, step: None, mode="threads")  # type: ignore[arg-type]


def test_embed_and_build_end_to_end_through_the_store(tmp_path):
    """snapshot -> embed -> build -> publish in the worker; the trainer swaps at a step boundary."""
    rows = _rows(40)
    ids = [r["block_id"] for r in rows]
    model = TinyEncoder()
    store = IndexStore(tmp_path)

    def build(snapshot, step):
        return embed_and_build(lambda b: snapshot(**b), rows, ids, batch_size=16, collate=_collate, step=step)

    first, stats = build(snapshot_module(model), 0)
    store.publish(first, step=0)
    assert stats["n_blocks"] == 40 and stats["index_type"] == "flat" and stats["build_seconds"] >= 0
    q = first.embeddings()[:5]  # probe queries: the blocks themselves
    r = AsyncRefresher(build, on_done=lambda res: store.publish(res.index, res.step), every=1)
    with torch.no_grad():
        model.emb.weight.mul_(-1.0)  # training moved the encoder: retrieval changes completely
    r.maybe_start(1, model)
    res = r.wait(step=2)
    r.close()
    assert res.ok and store.current().step == 1 and store.current().ids_for(np.array([0]))[0] == "b0"
    assert staleness(q, store.load(1), store.load(1), k=5) == 1.0
    assert staleness(q, store.load(1), store.current(), k=5) < 1.0
