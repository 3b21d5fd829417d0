"""A refresh sharded across ranks: each rank embeds 1/N of the blocks with its snapshot of the
document tower, the (N_blocks, d) matrix is all-gathered, and every rank builds the same index.

    groups = RefreshGroups.create()                    # once, on every rank, in the main thread
    index, stats = groups.guard(lambda: embed_and_build_sharded(encode, blocks, ids, batch_size=64,
                                                                collate=collate, groups=groups))

Bit for bit the single-process build: the rows are put in `embed_blocks`'s length order (longest
first) before the shards are cut, on `batch_size` boundaries of that order, so every encoder call
sees exactly the batch (rows, padding) that one process would have sent; the gathered rows are put
back in block order. With one process (`group=None`) this is
`embed.embed_and_build` itself (`groups=None`, or one process).

Why two extra gloo groups, and why gloo even when training uses NCCL:
  * The async refresh gathers in a background thread while the training thread all-reduces
    gradients. Two threads issuing collectives on one group can enqueue them in a different order
    on different ranks (a hang, or a gradient summed with an embedding shard). So the refresh
    thread owns `gather`, the training thread owns `control`, and neither touches the other's.
  * `embed_blocks` hands back host (numpy) rows anyway, and a second NCCL communicator running
    concurrently with training's can deadlock; gloo on the host avoids both.
  * Every refresh runs the same collectives on every rank, failed or not: first an all-reduce of
    (ok, tokens), then the all-gather only if every rank's shard succeeded. A rank whose embed
    raised still joins the first one, so its peers raise too instead of waiting forever; a rank
    that fails before reaching the embed (`RefreshGroups.guard`) casts the same "failed" vote.
  * `control` carries one all-reduce per step boundary (`all_ranks`): a finished build is swapped
    in only once every rank has finished it, and only if it succeeded everywhere, so all ranks
    search the same index version at every step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

from components.index import embed as embed_lib
from components.index.faiss_index import BlockIndex
from components.index.refresh import AsyncRefresher
from components.models.encoder import unsort_rows


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def shard_range(n_blocks: int, batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) rows of `rank`: whole embed batches, as even as batches allow (the earlier
    ranks take the one extra batch), so each batch is the one a single process would embed."""
    if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad shard request: batch_size={batch_size} rank={rank} world_size={world_size}")
    n_batches = -(-n_blocks // batch_size)
    per, extra = divmod(n_batches, world_size)
    b0 = rank * per + min(rank, extra)
    b1 = b0 + per + (1 if rank < extra else 0)
    return min(b0 * batch_size, n_blocks), min(b1 * batch_size, n_blocks)


@dataclass
class RefreshGroups:
    """The refresh's own process groups (see the module docstring); None members with one process."""

    gather: Any = None  # used only by whichever thread runs the refresh
    control: Any = None  # used only by the training thread
    rounds: int = 0  # refreshes this rank has voted in (the first all-reduce of `embed_sharded`)

    @classmethod
    def create(cls) -> "RefreshGroups":
        """Collective: every rank calls it at the same point, in its main thread."""
        if world() == 1:
            return cls()
        return cls(gather=dist.new_group(backend="gloo"), control=dist.new_group(backend="gloo"))

    @property
    def active(self) -> bool:
        return self.gather is not None

    def vote(self, ok: bool, n_tokens: int = 0, dim: int = 0) -> tuple[int, int, int]:
        """The refresh's first collective: (ranks ok, tokens) summed, dim max-ed, over `gather`."""
        self.rounds += 1
        status = torch.tensor([int(ok), n_tokens], dtype=torch.int64)
        d = torch.tensor([dim], dtype=torch.int64)
        dist.all_reduce(status, op=dist.ReduceOp.SUM, group=self.gather)
        dist.all_reduce(d, op=dist.ReduceOp.MAX, group=self.gather)
        return int(status[0]), int(status[1]), int(d[0])

    def guard(self, fn: Callable[[], Any]) -> Any:
        """Run one refresh body; if it raises before it voted, vote "failed" so that no peer waits
        for this rank in the gather (they raise "failed on another rank" instead)."""
        before = self.rounds
        try:
            return fn()
        except BaseException:
            if self.active and self.rounds == before:
                self.vote(False)
            raise


def all_ranks(flags: list[bool], group: Any) -> list[bool]:
    """Each flag AND-ed over the ranks of `group` (one small all-reduce)."""
    t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [bool(v) for v in t.tolist()]


def gather_rows(local: np.ndarray, counts: list[int], group: Any) -> np.ndarray:
    """Concatenate every rank's (counts[r], d) rows in rank order -> (sum(counts), d) float32."""
    d = local.shape[1]
    pad = max(counts)
    buf = torch.zeros(pad, d, dtype=torch.float32)
    buf[: local.shape[0]] = torch.from_numpy(np.ascontiguousarray(local, dtype=np.float32))
    out = [torch.empty(pad, d, dtype=torch.float32) for _ in counts]
    dist.all_gather(out, buf, group=group)
    return np.ascontiguousarray(np.concatenate([o[:c].numpy() for o, c in zip(out, counts)], axis=0))


def embed_sharded(
    encode_fn: Callable[[Any], torch.Tensor | np.ndarray],
    blocks: Iterable,
    batch_size: int,
    collate: Callable[[list], Any] | None,
    groups: RefreshGroups,
) -> tuple[np.ndarray, dict]:
    """This rank's shard through `embed.embed_blocks`, then the all-gather -> (N, d) on every
    rank, in block order. The shards are cut from the length order (`embed.length_order`), which
    the shard's own `embed_blocks` takes as given (`length=None`). Stats as `embed_blocks`'s, for
    the whole corpus (`seconds`: embed + gather wall time) plus `shard_blocks`, `shard_seconds`
    (this rank's embed alone) and `world_size`."""
    group = groups.gather
    n, ws, rank = len(blocks), dist.get_world_size(group), dist.get_rank(group)  # type: ignore[arg-type]
    counts = [b - a for a, b in (shard_range(n, batch_size, r, ws) for r in range(ws))]
    start, stop = shard_range(n, batch_size, rank, ws)
    t0 = time.perf_counter()
    local, st, err = None, {}, None
    try:
        order = embed_lib.length_order(blocks)  # (N,) the same on every rank
        if stop > start:
            local, st = embed_lib.embed_blocks(encode_fn, embed_lib.take_rows(blocks, order[start:stop]), batch_size,
                                               collate, progress=False, length=None)  # already in length order
    except Exception as e:  # noqa: BLE001 - re-raised below, after the peers have been told
        err = e
    shard_seconds = time.perf_counter() - t0
    n_ok, n_tokens, d = groups.vote(err is None, st.get("n_tokens", 0), st.get("dim", 0))  # every rank, failed or not
    if err is not None:
        raise err
    if n_ok != ws:
        raise RuntimeError(f"refresh: the embed failed on {ws - n_ok} other rank(s); keeping the old index")
    by_length = gather_rows(local if local is not None else np.zeros((0, d), np.float32), counts, group)  # (N, d)
    emb = unsort_rows(by_length, order)  # (N, d) in block order
    seconds = time.perf_counter() - t0
    return emb, {**embed_lib.embed_stats(n, n_tokens, d, seconds),
                 "shard_blocks": stop - start, "shard_seconds": shard_seconds, "world_size": ws}


def embed_and_build_sharded(
    encode_fn: Callable[[Any], torch.Tensor | np.ndarray],
    blocks: Iterable,
    ids: Any,
    *,
    batch_size: int,
    collate: Callable[[list], Any] | None = None,
    groups: RefreshGroups | None = None,
    index_type: str = "auto",
    step: int | None = None,
    **build_kwargs: Any,
) -> tuple[BlockIndex, dict]:
    """`embed.embed_and_build` with the embedding sharded over the ranks of `groups` (None or one
    process: exactly `embed_and_build`). Every rank returns the same index. Call it inside
    `groups.guard` when the body does other fallible work before it."""
    if groups is None or not groups.active:
        return embed_lib.embed_and_build(encode_fn, blocks, ids, batch_size=batch_size, collate=collate,
                                         index_type=index_type, step=step, **build_kwargs)
    emb, stats = embed_sharded(encode_fn, blocks, batch_size, collate, groups)
    index = BlockIndex.build(emb, ids, index_type, step=step, **build_kwargs)  # type: ignore[arg-type]
    return index, {**stats, "build_seconds": index.meta["build_seconds"], "index_type": index.index_type}


class CollectiveRefresher(AsyncRefresher):
    """`AsyncRefresher` whose step-boundary decisions are the same on every rank: `poll` delivers a
    build only when every rank has finished it, and a success only if it succeeded on every rank
    (else each rank's `on_error` runs). Since deliveries agree, `busy` agrees, so every rank starts
    the next build at the same step, from the same weights. Each build runs in `groups.guard`.
    With `groups=None` (or one process): AsyncRefresher."""

    def __init__(self, build_fn: Any, *args: Any, groups: RefreshGroups | None = None, **kwargs: Any):
        active = groups is not None and groups.active
        super().__init__((lambda snap, step: groups.guard(lambda: build_fn(snap, step))) if active else build_fn,
                         *args, **kwargs)
        self.control = groups.control if active else None

    def poll(self, step: int | None = None):
        if self.control is None:
            return super().poll(step)
        with self._lock:
            res, thread = self._result, self._thread
        done, ok = all_ranks([res is not None or thread is None, res is not None and res.ok], self.control)
        if res is None or not done:
            if thread is not None:
                self._n["steps_overlapped"] += 1
            return None
        if not ok and res.ok:  # built here, failed on another rank: no rank swaps it in
            with self._lock:
                res.index = None
                res.error = RuntimeError("refresh failed on another rank; keeping the old index")
        return super().poll(step)
