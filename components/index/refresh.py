"""REALM's index refresh: re-embed the knowledge corpus with a snapshot of the block encoder and
swap the new MIPS index in while training continues (REALM sec. 3.4: "asynchronously refresh").

    snapshot = snapshot_module(model.retriever)          # at a step boundary, cheap
    fresh, stats = embed_and_build(lambda b: snapshot.encode_passage(**b), blocks, ids, batch_size=64, collate=collate)
    staleness(query_vecs, stale=old_index, fresh=fresh, k=5)   # 1.0 = nothing changed

(`embed_and_build`, every block embedded and indexed, is `components.index.embed`'s.) The REALM
stage drives these through `components.index.realm_refresh.IndexRefresh`.

`AsyncRefresher` runs that build in a background worker every `refresh_every` steps; the
training loop calls `maybe_start(step, module)` and `poll(step)` once per step and swaps the new
index in at the step boundary where `poll` returns it.

Why a thread and not a process:
  * The snapshot (a deep copy of the encoder) and the finished faiss index are handed over by
    reference. A process would have to serialize both (we never pickle) or set up shared memory,
    and on CUDA it would need its own context (hundreds of MiB of GPU memory) plus a device-to-
    host copy of the (N, d) embedding matrix.
  * The heavy work releases the GIL: torch kernels (matmuls, attention) and faiss add/train/
    search all run in C++ without it, so the training thread and the worker do overlap. What
    stays serialized is Python glue (tokenized-batch collation, module call overhead), which is
    small next to a forward pass over a batch of blocks.
  * On CUDA the worker issues its kernels on its own stream, so they can overlap training's.
  * Costs accepted: on a CPU-only box both threads share the same cores, so "hidden" refresh
    time still slows training steps down (it is not free, it just does not stall them); and a
    crash inside a native kernel takes training down with it (a process would isolate it).
    A build that raises a Python exception is contained: `on_error` is called, training keeps
    the old index, and the next cadence retries.

No prefect here: the flow wraps these as a subflow.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal

import numpy as np
import torch

from components.index.faiss_index import BlockIndex
from components.models.encoder import unwrap

BuildFn = Callable[[Any, int], "tuple[BlockIndex, dict]"]


# ----------------------------------------------------------------------------------------------
# snapshot + staleness
# ----------------------------------------------------------------------------------------------
def snapshot_module(module: torch.nn.Module, device: str | torch.device | None = None) -> torch.nn.Module:
    """A frozen copy of `module` that training cannot change under the refresh: deep-copied, in
    eval mode (no dropout in the index), `requires_grad=False`, on `device` (None: same device;
    "cpu" frees accelerator memory at the cost of a slower embed). Call at a step boundary."""
    snap = copy.deepcopy(unwrap(module))
    if device is not None:
        snap = snap.to(device)
    snap.eval()
    for p in snap.parameters():
        p.requires_grad_(False)
        p.grad = None  # never carry the trainer's gradients along
    return snap


def staleness(query_vecs: np.ndarray, stale: BlockIndex, fresh: BlockIndex, k: int) -> float:
    """Mean overlap@k of the top-k block sets the two indexes return (1.0 = identical retrieval).

    Compared by block id, not row, so two versions with different row orders still match.
    `query_vecs` (Q, d) are the same queries sent to both (e.g. the current query encoder on
    `staleness_probes` training questions).
    """
    k_eff = min(k, len(stale), len(fresh))
    if k_eff < 1:
        raise ValueError("staleness needs k >= 1 and non-empty indexes")
    rows_s = stale.search(query_vecs, k_eff)[1]  # (Q, k)
    rows_f = fresh.search(query_vecs, k_eff)[1]  # (Q, k)
    ids_s, ids_f = stale.ids_for(rows_s), fresh.ids_for(rows_f)
    overlaps = [  # a missing slot (row -1, possible with ANN indexes) never counts as a match
        len(set(a[ra >= 0].tolist()) & set(b[rb >= 0].tolist())) / k_eff
        for a, b, ra, rb in zip(ids_s, ids_f, rows_s, rows_f)
    ]
    return float(np.mean(overlaps))


# ----------------------------------------------------------------------------------------------
# asynchronous refresh
# ----------------------------------------------------------------------------------------------
@dataclass
class RefreshResult:
    """One finished build. `step`: the step whose weights were snapshotted; `swap_step`: the
    step passed to the `poll` that delivered it (their difference is the index's lag)."""

    step: int
    index: BlockIndex | None
    stats: dict = field(default_factory=dict)
    seconds: float = 0.0
    error: BaseException | None = None
    swap_step: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.index is not None


@contextlib.contextmanager
def _side_stream(snapshot: Any) -> Iterator[None]:
    """Run the worker's CUDA kernels on their own stream so they overlap training's."""
    dev = None
    if isinstance(snapshot, torch.nn.Module) and torch.cuda.is_available():
        p = next(snapshot.parameters(), None)
        dev = p.device if p is not None and p.device.type == "cuda" else None
    if dev is None:
        yield
        return
    stream = torch.cuda.Stream(device=dev)
    stream.wait_stream(torch.cuda.current_stream(dev))  # the snapshot copy must have landed
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


class AsyncRefresher:
    """Every `every` steps, run `build_fn(snapshot, step) -> (BlockIndex, stats)` off the training
    thread; `poll()` hands back the finished result at a step boundary.

        r = AsyncRefresher(build_fn, on_done=lambda res: store.swap(res.index), every=25)
        for step in range(1, max_steps + 1):
            train_step(...)
            r.poll(step)                      # swaps a finished index in (via on_done)
            r.maybe_start(step, model.retriever)
        r.close(); log(r.timing())

    * Callbacks run in the thread that calls `poll`, never in the worker, so `on_done` may
      touch training state. `on_error(exc, step)` is called for a failed build (or snapshot);
      nothing is swapped, and the build is retried at the next cadence step.
    * At most one build is in flight. A due step that finds one running is deferred (counted in
      `steps_due_while_busy`); the first `maybe_start` after it is delivered starts the next one,
      so builds slower than the cadence run back to back.
    * `mode="sync"` builds inline in `maybe_start` (tests, debugging, `refresh_mode: sync`).
    * `timing()`: build seconds hidden behind training vs. seconds training was blocked
      (snapshot, sync builds, waits, callbacks) -> `fraction_hidden`.
    """

    def __init__(
        self,
        build_fn: BuildFn,
        on_done: Callable[[RefreshResult], None] | None = None,
        on_error: Callable[[BaseException, int], None] | None = None,
        *,
        every: int = 1,
        mode: Literal["async", "sync"] = "async",
        snapshot_fn: Callable[[torch.nn.Module], Any] = snapshot_module,
        start_step: int = 0,
    ):
        if mode not in ("async", "sync"):
            raise ValueError(f"mode must be async|sync, got {mode!r}")
        self.build_fn, self.on_done, self.on_error = build_fn, on_done, on_error
        self.every, self.mode, self.snapshot_fn = every, mode, snapshot_fn
        self.next_due = start_step + every if every > 0 else None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._result: RefreshResult | None = None  # finished, not yet delivered by poll()
        self._t = {"snapshot_s": 0.0, "sync_build_s": 0.0, "async_build_s": 0.0, "wait_s": 0.0, "callback_s": 0.0}
        self._n = {"started": 0, "ok": 0, "failed": 0, "steps_due_while_busy": 0, "steps_overlapped": 0}
        self._wait_in_current = 0.0  # main-thread wait on the in-flight build (not hidden)
        self._hidden_s = 0.0

    # -- state ---------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """A build is running or finished but not yet delivered by `poll`."""
        with self._lock:
            return self._thread is not None or self._result is not None

    def due(self, step: int) -> bool:
        return self.next_due is not None and step >= self.next_due

    # -- starting ------------------------------------------------------------------------------
    def maybe_start(self, step: int, module: torch.nn.Module | None = None, *, force: bool = False) -> bool:
        """Start a build if `step` is due (or `force`) and none is in flight. True if started.
        The snapshot of `module` is taken here, in the caller's thread, at the step boundary."""
        if not (force or self.due(step)):
            return False
        if self.busy:
            self._n["steps_due_while_busy"] += 1
            return False
        if self.every > 0:
            self.next_due = step + self.every
        t0 = time.perf_counter()
        try:
            snapshot = self.snapshot_fn(module) if module is not None else None
        except Exception as e:  # counts as a failed build: keep the old index, retry next cadence
            self._t["snapshot_s"] += time.perf_counter() - t0
            self._result = RefreshResult(step, None, error=e)
            return False
        self._t["snapshot_s"] += time.perf_counter() - t0
        self._n["started"] += 1
        if self.mode == "sync":
            self._result = self._build(snapshot, step)
            self._t["sync_build_s"] += self._result.seconds
            return True
        self._wait_in_current = 0.0
        thread = threading.Thread(target=self._worker, args=(snapshot, step), name=f"refresh_index@{step}", daemon=True)
        with self._lock:
            self._thread = thread
        thread.start()
        return True

    def _build(self, snapshot: Any, step: int) -> RefreshResult:
        t0 = time.perf_counter()
        try:
            with _side_stream(snapshot):
                index, stats = self.build_fn(snapshot, step)
            if not isinstance(index, BlockIndex):
                raise TypeError(f"build_fn must return (BlockIndex, stats), got {type(index).__name__}")
            return RefreshResult(step, index, dict(stats or {}), time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - handed to on_error in the caller's thread
            return RefreshResult(step, None, {}, time.perf_counter() - t0, error=e)

    def _worker(self, snapshot: Any, step: int) -> None:
        result = self._build(snapshot, step)
        with self._lock:
            self._result = result

    # -- delivering ----------------------------------------------------------------------------
    def poll(self, step: int | None = None) -> RefreshResult | None:
        """The finished build, once (None while running or idle). Calls on_done / on_error."""
        with self._lock:
            result, thread = self._result, self._thread
            if result is None:
                if thread is not None:
                    self._n["steps_overlapped"] += 1
                return None
            self._result, self._thread = None, None
        if thread is not None:  # async: the worker has stored its result and is about to exit
            thread.join()
            self._t["async_build_s"] += result.seconds
            self._hidden_s += max(0.0, result.seconds - self._wait_in_current)
        result.swap_step = step
        t0 = time.perf_counter()
        try:
            if result.ok:
                self._n["ok"] += 1
                if self.on_done is not None:
                    self.on_done(result)
            else:
                self._n["failed"] += 1
                if self.on_error is not None:
                    self.on_error(result.error, result.step)  # type: ignore[arg-type]
        finally:
            self._t["callback_s"] += time.perf_counter() - t0
        return result

    def _join(self, timeout: float | None) -> None:
        """Join the in-flight worker, if any; the wait counts as blocked time."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            t0 = time.perf_counter()
            thread.join(timeout)
            waited = time.perf_counter() - t0
            self._t["wait_s"] += waited
            self._wait_in_current += waited

    def wait(self, timeout: float | None = None, step: int | None = None) -> RefreshResult | None:
        """Block until the in-flight build finishes (counted as blocked time), then `poll`."""
        self._join(timeout)
        return self.poll(step)

    def close(self, timeout: float | None = None) -> None:
        """Join the worker (a result it produced stays available to one more `poll`)."""
        self._join(timeout)

    def __enter__(self) -> "AsyncRefresher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- accounting ----------------------------------------------------------------------------
    def timing(self) -> dict[str, float]:
        """Seconds of refresh work hidden behind training vs. seconds training was blocked.

        hidden_s: async build time minus any time the trainer waited on it (`wait`/`close`).
        blocked_s: snapshots + sync builds + waits + on_done/on_error callbacks.
        fraction_hidden = hidden_s / (hidden_s + blocked_s) (0.0 when nothing ran).
        """
        blocked = self._t["snapshot_s"] + self._t["sync_build_s"] + self._t["wait_s"] + self._t["callback_s"]
        hidden = self._hidden_s
        total = hidden + blocked
        return {
            **{k: float(v) for k, v in self._n.items()},
            **self._t,
            "build_s": self._t["sync_build_s"] + self._t["async_build_s"],
            "hidden_s": hidden,
            "blocked_s": blocked,
            "fraction_hidden": hidden / total if total > 0 else 0.0,
        }
