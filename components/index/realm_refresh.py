"""REALM's index during training: `IndexRefresh` builds the first index, refreshes it every
`realm.refresh_every` steps (`AsyncRefresher`), swaps each new one in at a step boundary, keeps a
failed refresh from stopping training, records every refresh, and rebuilds the final index.

    refresh = IndexRefresh(RefreshContext(blocks, block_ids, p, special, staleness_x, probe), store, run=run)
    Trainer(..., hooks={"on_train_start": refresh.on_train_start, "on_step_end": refresh.on_step_end}).fit()
    refresh.finish(trainer); refresh.close()

One refresh (`IndexRefresh.refresh`) = `embed_and_build` (embed every block with `passage_batch`,
the exact input REALM's rescoring sees, then build) -> staleness and probes (rank 0) -> publish to
the `IndexStore`. It runs through a wrapper (`refresh_wrapper(body, step=, reason=)`; the Prefect
flow passes one that makes it the `refresh_index` subflow) and is an MLflow child run of `run`.

Multi-process: the refresh is sharded (components/index/shard.py): each rank embeds 1/N of the
blocks with its snapshot of the (DDP-identical) weights, the rows are all-gathered, and every rank
builds the same index, bit for bit the one a single process builds. Each refresh starts and is
swapped in at the same step on every rank, and fails on all of them or none. Only rank 0
publishes, logs and probes (docs/experiments/realm.md says why). `run`, the probes and the trainer
are passed in, so this module needs neither tracking nor eval nor training.

Shared start (`start_cache`): runs that start from the same weights (REALM's two arms, after their
shared warm-ups) have the same first index. The first fresh run to build it saves it with its
figures (`SharedStart`); a later one loads it instead of embedding every block again. Only a
one-process fresh start (step 0) reads or writes it: a resume rebuilds from its resumed weights,
and a sharded build is collective, which a file appearing between two ranks' checks would split.
"""

from __future__ import annotations

import contextlib
import contextvars
import csv
import io
import json
import logging
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from components.config_stages import RealmParams
from components.data.realm_batch import passage_batch
from components.data.special_tokens import SpecialTokens
from components.index.faiss_index import BlockIndex, IndexStore
from components.index.refresh import RefreshResult, snapshot_module, staleness
from components.index.shard import CollectiveRefresher, RefreshGroups, embed_and_build_sharded
from components.io import atomic_dir, write_json_atomic
from components.models.retriever import Retriever, encode_queries

log = logging.getLogger(__name__)

PLOT_COLUMNS = ["step", "version", "recall_at_k", "mean_rank", "heldout_recall_at_k", "heldout_mean_rank",
                "heldout_entity_recall_at_k", "heldout_entity_mean_rank", "staleness",
                "refresh_seconds", "reason",
                "swap_step", "blocks_per_s", "tokens_per_s", "index_size"]

# body(tags=None) -> dict; a wrapper runs it (e.g. as a Prefect subflow) and returns its result.
RefreshWrapper = Callable[..., dict]
# probe(retriever, index) -> {metric: value}: the recall probes, run on rank 0 against each new index.
ProbeFn = Callable[[Retriever, BlockIndex], dict]


def plain_wrapper(body: Callable[..., dict], *, step: int, reason: str) -> dict:
    """The refresh wrapper without an orchestrator (tests, torchrun ranks)."""
    return body()


def format_metric(x) -> str:
    """"-" for a missing value, else 3 decimals (the refresh log lines and bench tables)."""
    return "-" if x is None else f"{x:.3f}"


@dataclass
class RefreshContext:
    """What every refresh needs, fixed for the run."""

    blocks: Any  # HF dataset of the retrieval blocks (input_ids used)
    block_ids: np.ndarray  # (N,) block id per row (the index ids)
    p: RealmParams
    special: SpecialTokens
    staleness_x: dict[str, torch.Tensor]  # fixed training queries for overlap@k: x_input_ids, x_attention_mask (Q, Lx)
    probe: ProbeFn | None = None
    amp_dtype: torch.dtype | None = None  # the precision REALM's rescoring runs in, so index and scores agree


class SharedStart:
    """A first index and its refresh figures (embedding speed, probes) in `folder` (index/,
    stats.json), written atomically by the run that built it, read by runs that start from the same
    weights. The caller keys `folder` by everything the first index depends on (REALM: the warm-ups'
    checkpoint folder, `pretrain_realm.warmup_root`)."""

    STATS = "stats.json"

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def load(self) -> tuple[BlockIndex, dict] | None:
        """(index, stats) when a complete one is saved, else None (a damaged one is rebuilt, with a warning)."""
        if not (self.folder / self.STATS).is_file():
            return None
        try:
            stats = json.loads((self.folder / self.STATS).read_text())
            return BlockIndex.load(self.folder / "index"), stats
        except (OSError, ValueError, RuntimeError) as e:  # a bad file (ValueError: JSON, meta or a sha256)
            log.warning("shared first index in %s unreadable (%s); building it again", self.folder, e)
            return None

    def save(self, index: BlockIndex, stats: dict) -> None:
        with atomic_dir(self.folder) as tmp:  # a concurrent writer saves the same index; the last one stays
            index.save(tmp / "index")
            write_json_atomic(tmp / self.STATS, stats)


class IndexRefresh:
    """Owns the index during training: the initial build, the cadence (AsyncRefresher), the swap at
    step boundaries, failure handling, the per-refresh records and the final build.

    Each build reads `embed_blocks` from components.index.embed at call time, so a test can
    inject a failing embed there. Under torch.distributed, construct it on every rank at the same
    point (it creates the refresh's process groups).
    """

    def __init__(self, ctx: RefreshContext, store: IndexStore, *, run=None, wrapper: RefreshWrapper | None = None,
                 history_path: Path | None = None, rank0: bool = True, start_cache: Path | None = None):
        self.ctx, self.store, self.run, self.rank0 = ctx, store, run, rank0
        self.start_cache = SharedStart(start_cache) if start_cache is not None else None
        self.wrapper = wrapper or plain_wrapper
        self.history_path = history_path
        self.history: list[dict] = []
        self.refresher: CollectiveRefresher | None = None
        self.groups = RefreshGroups.create()
        self._prefect_ctx: contextvars.Context | None = None
        # The index the next batch searches. Assigned only in the training thread at a step boundary;
        # the refresh thread only reads it (for staleness), so no lock is needed.
        self.active: BlockIndex | None = None
        self.train_index: BlockIndex | None = None  # what training used last, before any final rebuild
        # realm.query_tower: index_export: the snapshot that built `active` embeds the queries that search it
        self.active_encoder: Retriever | None = None
        self._built_by: dict[int, Retriever] = {}  # id(index) -> its snapshot, until that index is swapped in

    # -- history (survives a resume) ---------------------------------------------------------
    def load_history(self, resumed_step: int) -> None:
        if self.history_path is not None and self.history_path.is_file():
            rows = json.loads(self.history_path.read_text())
            self.history = [r for r in rows if r["step"] <= resumed_step and r.get("reason") != "final"]

    def _record(self, row: dict) -> None:
        self.history.append(row)
        if self.history_path is not None and self.rank0:
            write_json_atomic(self.history_path, self.history)

    # -- one refresh ---------------------------------------------------------------------------
    def refresh(self, retriever: Retriever, step: int, reason: str = "cadence") -> tuple[BlockIndex, dict]:
        """(snapshot, step) -> (index, stats); the new version is `stats["version"]` (and the
        index's meta). Runs in the refresh thread (async) or the training thread (sync/initial/
        final), through the wrapper, inside the context captured on the training thread."""
        holder: dict = {}

        def body(tags: dict | None = None) -> dict:
            holder["index"], stats = self._build(retriever, step, reason, tags)
            return stats

        ctx = self._prefect_ctx or contextvars.copy_context()
        self._prefect_ctx = None
        # guard: a rank that fails before its shard's vote (e.g. rank 0's child run) still votes
        stats = self.groups.guard(lambda: ctx.run(self.wrapper, body, step=step, reason=reason))
        if self.ctx.p.query_tower == "index_export":
            self._built_by[id(holder["index"])] = retriever
        return holder["index"], stats

    def query_encoder(self) -> Retriever | None:
        """The query tower of the snapshot that built the index training searches now (RealmCollator's
        `query_encoder` with realm.query_tower: index_export)."""
        return self.active_encoder

    def _shared_start(self, step: int, reason: str) -> SharedStart | None:
        """The shared first index, where this build may use it (a one-process fresh start)."""
        return self.start_cache if reason == "initial" and step == 0 and not self.groups.active else None

    def _embed_and_build(self, retriever: Retriever, step: int) -> tuple[BlockIndex, dict]:
        """Embed every block with the snapshot and build the index: (index, the embedding figures)."""
        c = self.ctx
        dev = next(retriever.parameters()).device
        amp = (torch.autocast(device_type=dev.type, dtype=c.amp_dtype) if c.amp_dtype is not None else contextlib.nullcontext())

        def encode(batch):
            return retriever.encode_passage(**{k: v.to(dev) for k, v in batch.items()})

        with amp:
            index, st = embed_and_build_sharded(
                encode, c.blocks, c.block_ids, batch_size=c.p.embed_batch_size, groups=self.groups,
                collate=lambda rows: passage_batch(rows, c.p, c.special),
                index_type=c.p.index_type, step=step, auto_flat_max=c.p.index_auto_flat_max)
        return index, {"embed_seconds": st["seconds"], "build_seconds": st["build_seconds"], "blocks_per_s": st["blocks_per_s"],
                       "tokens_per_s": st["tokens_per_s"], "n_tokens": st["n_tokens"]}

    def _build(self, retriever: Retriever, step: int, reason: str, tags: dict | None) -> tuple[BlockIndex, dict]:
        c = self.ctx
        t0 = time.perf_counter()  # wall time of the whole refresh, tracking included
        shared = self._shared_start(step, reason)
        loaded = shared.load() if shared is not None else None
        child = None
        if self.run is not None and self.rank0:
            child = self.run.child("refresh_index", tags={"rr.refresh_reason": reason, **(tags or {})})
        with child if child is not None else contextlib.nullcontext():
            # saved: the embedding figures and the probes (of the run that built it, from the same weights)
            index, saved = loaded if loaded is not None else self._embed_and_build(retriever, step)
            if self.rank0 and c.probe is not None and loaded is None:
                saved = {**saved, **c.probe(retriever, index)}
            stats: dict[str, Any] = {"step": step, "reason": reason, "index_size": len(index), "index_type": index.index_type,
                                     **saved}
            if shared is not None:
                stats["shared_start"] = float(loaded is not None)
                if loaded is None:
                    shared.save(index, saved)
                log.info("refresh_index initial: %s the shared first index %s", "read" if loaded else "saved", shared.folder)
            if self.rank0:
                old = self.active
                if old is not None:
                    stats["staleness"] = staleness(encode_queries(retriever, c.staleness_x), old, index, c.p.staleness_k)
                    stats["previous_version"] = old.version
                version = self.store.publish(index, step=step, extra_meta={"reason": reason}, make_current=False)
                self.store.prune(keep_last=2, keep_first=True)
                index = index.with_meta(version=version, step=step)
                stats["version"] = version
                stats["index_bytes"] = sum(f.stat().st_size for f in self.store.path(version).iterdir() if f.is_file())
            stats["refresh_seconds"] = time.perf_counter() - t0
            if child is not None:
                child.set_tags({"rr.index_version": stats.get("version"), "rr.index_type": index.index_type})
                if stats.get("version") is not None:  # the index files this run built: URI, sha256, size, blocks
                    child.log_index_version(self.store.path(stats["version"]), stats["version"], len(index))
                child.log_metrics_now({k: float(v) for k, v in stats.items() if isinstance(v, (int, float)) and v is not None}, step=step)
        return index, stats

    # -- delivering ----------------------------------------------------------------------------
    def _swap(self, index: BlockIndex, stats: dict, swap_step: int) -> None:
        """At a step boundary, in the training thread: the next batch searches `index`."""
        self.store.swap(index)
        self.active = index
        self.active_encoder = self._built_by.pop(id(index), None)
        self._built_by.clear()  # an older build that never got swapped in is never searched
        row = {k: stats.get(k) for k in PLOT_COLUMNS if k in stats}
        row.update(ok=True, swap_step=swap_step, version=stats.get("version"))
        self._record(row)
        if self.run is not None and self.rank0:
            names = {"recall_at_k": "probe_recall_at_k", "mean_rank": "probe_mean_rank", "staleness": "staleness",
                     "heldout_recall_at_k": "heldout_recall_at_k", "heldout_mean_rank": "heldout_mean_rank",
                     "heldout_entity_recall_at_k": "heldout_entity_recall_at_k", "heldout_entity_mean_rank": "heldout_entity_mean_rank",
                     "refresh_seconds": "refresh_seconds"}
            m = {names[k]: float(stats[k]) for k in names if stats.get(k) is not None}
            m["refresh_version"] = float(stats.get("version") or 0)
            self.run.log_metrics(m, stats["step"])
        log.log(logging.INFO if self.rank0 else logging.DEBUG,
                "refresh_index %s: step %d -> v%s in %.2fs (swapped in after step %d) recall@%d=%s heldout=%s "
                "heldout_entity=%s staleness=%s", stats["reason"], stats["step"], stats.get("version"), stats["refresh_seconds"],
                swap_step, self.ctx.p.staleness_k, format_metric(stats.get("recall_at_k")),
                format_metric(stats.get("heldout_recall_at_k")), format_metric(stats.get("heldout_entity_recall_at_k")),
                format_metric(stats.get("staleness")))

    def _on_done(self, res: RefreshResult) -> None:
        self._swap(res.index, res.stats, res.swap_step if res.swap_step is not None else res.step)

    def _on_error(self, exc: BaseException, step: int) -> None:
        # Training keeps the old index; AsyncRefresher retries at the next cadence step.
        log.warning("refresh_index at step %d failed; training continues on index v%s and retries at the next cadence: %s\n%s",
                    step, getattr(self.active, "version", None), exc,
                    "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]))
        self._record({"step": step, "ok": False, "reason": "cadence", "error": f"{type(exc).__name__}: {exc}"})
        if self.run is not None and self.rank0:
            self.run.log_metrics({"refresh_failed": 1.0}, step)

    # -- trainer hooks (trainer: components.training.trainer.Trainer) --------------------------
    def on_train_start(self, step: int, trainer) -> None:
        """Initial index, always from the weights training starts with (fresh or resumed)."""
        if self.rank0:
            removed = self.store.cleanup_partial()
            if removed:
                log.warning("removed %d half-written index folder(s) from a killed run: %s", len(removed), [p.name for p in removed])
        self.load_history(step)
        retriever = trainer.raw_model.retriever
        index, stats = self.refresh(snapshot_module(retriever), step, "initial")
        self._swap(index, stats, step)
        every = self.ctx.p.refresh_every
        self.refresher = CollectiveRefresher(
            lambda snap, s: self.refresh(snap, s, "cadence"), on_done=self._on_done, on_error=self._on_error,
            every=every, mode=self.ctx.p.refresh_mode, groups=self.groups,
            start_step=step - step % every if every else step,  # keep the cadence grid across a resume
        )

    def on_step_end(self, step: int, trainer) -> None:
        used = self.active  # the index this step's batch was retrieved from
        if self.run is not None and self.rank0:
            self.run.log_metrics({"index_version": float(used.version or 0), "index_lag": float(step - (used.step or 0))}, step)
        r = self.refresher
        r.poll(step)  # a finished async build is swapped in here, between two steps
        if r.due(step):
            # Captured here, on the training thread: the refresh thread runs the subflow inside this
            # context, so Prefect sees the stage's flow/task run as the parent (a true subflow).
            self._prefect_ctx = contextvars.copy_context()
            r.maybe_start(step, trainer.raw_model.retriever)
            if r.mode == "sync":  # built inline; swap it in at this same boundary (a poll on every
                r.poll(step)      # rank, started or not: under torch.distributed it is collective)

    def finish(self, trainer) -> dict:
        """Deliver an in-flight build, then make sure the final index embeds the final weights."""
        step = trainer.step
        if self.refresher is not None:
            self.refresher.wait(step=step)
            self.refresher.close()
        self.train_index = self.active
        # Only rank 0 saves it; a sharded build needs every rank (the steps agree on all of them).
        if (self.rank0 or self.groups.active) and self.train_index.step != step:
            index, stats = self.refresh(snapshot_module(trainer.raw_model.retriever), step, "final")
            self._swap(index, stats, step)
        return self.refresher.timing() if self.refresher is not None else {}

    def close(self) -> None:
        if self.refresher is not None:
            self.refresher.close()

    # -- summaries -----------------------------------------------------------------------------
    @property
    def ok_rows(self) -> list[dict]:
        return [r for r in self.history if r.get("ok")]

    def csv_text(self) -> str:
        """plots/realm_refresh.csv: one row per refresh that was swapped in."""
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=PLOT_COLUMNS, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in self.ok_rows:
            w.writerow({k: ("" if r.get(k) is None else (round(r[k], 6) if isinstance(r[k], float) else r[k])) for k in PLOT_COLUMNS})
        return buf.getvalue()
