"""Embedding blocks: every row of a corpus through an encoder, in length order, into (N, d) float32
in the caller's order, and from there a fresh MIPS index.

    emb, stats = embed_blocks(lambda b: encoder(**b), blocks, batch_size=64, collate=collate)
    index, stats = embed_and_build(lambda b: snapshot.encode_passage(**b), blocks, ids, batch_size=64, collate=collate)

`embed_blocks` is the one embed of blocks and passages: REALM's index refresh
(`components.index.refresh`, `components.index.shard`) and dense evaluation (`components.eval.dense`)
both go through it. `embed_and_build` (= `embed_blocks` + `BlockIndex.build`) is the body of each
refresh.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from components.index.faiss_index import BlockIndex
from components.models.encoder import longest_first, unsort_rows
from components.progress import ProgressClock, count_line

log = logging.getLogger(__name__)


def _is_hf_dataset(obj: Any) -> bool:
    return hasattr(obj, "column_names") and hasattr(obj, "__getitem__") and hasattr(obj, "__len__")


def row_length(row: Any) -> int:
    """Tokens of one block row, the key `length_order` sorts by: a dict's `input_ids` (+ `title_ids`),
    a (title, body) pair's total, else `len(row)` (a token list; a text's characters)."""
    if isinstance(row, dict):
        return sum(len(row[k]) for k in ("input_ids", "title_ids") if row.get(k) is not None)
    if isinstance(row, tuple):
        return sum(len(part) for part in row)
    return len(row)


def length_order(blocks: Any, length: Callable[[Any], int] | None = row_length) -> np.ndarray:
    """Row positions (N,), `encoder.longest_first` by `length(row)`. Batches cut from this order pad
    each row to a similar width instead of the longest in a random mix (a corpus of 128-token
    blocks embedded at ~256). An HF `Dataset` is measured from its Arrow `input_ids` / `title_ids`
    columns without reading rows. `length=None`: 0..N-1."""
    if length is None:
        return np.arange(len(blocks))
    if _is_hf_dataset(blocks) and length is row_length:
        import pyarrow.compute as pc

        cols = [c for c in ("input_ids", "title_ids") if c in blocks.column_names]
        lens = np.zeros(len(blocks), dtype=np.int64)
        if cols:
            table = blocks.select_columns(cols).with_format("arrow")[:]  # respects a select()'s indices
            for c in cols:
                lens += pc.fill_null(pc.list_value_length(table[c]), 0).to_numpy().astype(np.int64)
    else:
        lens = np.fromiter((length(r) for r in blocks), dtype=np.int64, count=len(blocks))
    return longest_first(lens)


def take_rows(blocks: Any, positions: np.ndarray) -> Any:
    """The rows at `positions`, in that order: an HF `Dataset` through `select` (no rows read),
    else a list."""
    if _is_hf_dataset(blocks) and hasattr(blocks, "select"):
        return blocks.select(positions)
    return [blocks[int(i)] for i in positions]


def _iter_batches(blocks: Any, batch_size: int) -> Iterator[list]:
    """Lists of up to `batch_size` rows. An HF `Dataset` is read by slices (one Arrow read per
    batch, not one per row)."""
    for start in range(0, len(blocks), batch_size):
        if _is_hf_dataset(blocks):
            cols = blocks[start : start + batch_size]  # dict of column -> list
            names = list(cols)
            yield [dict(zip(names, vals)) for vals in zip(*(cols[c] for c in names))]
        else:
            yield list(blocks[start : start + batch_size])


def _count_tokens(rows: list, batch: Any) -> int:
    """Real (non-pad) tokens: the attention mask's sum if the batch has one, else input_ids lengths."""
    if isinstance(batch, dict) and "attention_mask" in batch:
        return int(torch.as_tensor(batch["attention_mask"]).sum())
    if rows and isinstance(rows[0], dict) and "input_ids" in rows[0]:
        return sum(len(r["input_ids"]) for r in rows)
    return 0


def embed_blocks(
    encode_fn: Callable[[Any], torch.Tensor | np.ndarray],
    blocks: Iterable,
    batch_size: int,
    collate: Callable[[list], Any] | None = None,
    *,
    progress: bool = True,
    desc: str = "embed blocks",
    log_every: int = 0,
    log_every_s: float | None = None,
    length: Callable[[Any], int] | None = row_length,
) -> tuple[np.ndarray, dict]:
    """Embed every block: `encode_fn(collate(rows))` -> (B, d), stacked to (N, d) float32 in the
    order of `blocks`.

    Length bucketing: the rows are embedded longest first (`length_order` by `length(row)`), so a
    batch pads to its own longest row, not to the longest of a random mix; the rows go back to
    their own order before returning. With an attention mask padding changes nothing but float
    noise (kernels of another width sum in another order). `length=None`: batches in the given
    order (the reference the tests and bench/bench_embed_sort.py compare with).

    `blocks` is any iterable of rows or an HF `Dataset`; `collate=None` hands `encode_fn` the list
    of rows. Runs under `torch.inference_mode()`. Returns `(embeddings, stats)` with stats
    `n_blocks, n_tokens, dim, seconds, blocks_per_s, tokens_per_s`. A progress line goes to
    `logging` (INFO) after every `log_every` blocks (0: none by count) and whenever `log_every_s`
    seconds (None: `components.progress.PROGRESS_EVERY_S`) passed since the last one, whatever
    tqdm (`progress`) shows.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not (_is_hf_dataset(blocks) or hasattr(blocks, "__getitem__")):
        blocks = list(blocks)  # a generator: sorting needs every row
    order = length_order(blocks, length)  # (N,) position of the i-th row embedded
    if (order != np.arange(len(order))).any():
        blocks = take_rows(blocks, order)
    total = len(blocks)
    chunks: list[np.ndarray] = []
    n_tokens = n_done = 0
    clock = ProgressClock(log_every, log_every_s)
    with torch.inference_mode(), tqdm(total=total, desc=desc, unit="block", disable=not progress, mininterval=5) as bar:
        for rows in _iter_batches(blocks, batch_size):
            batch = collate(rows) if collate is not None else rows
            out = encode_fn(batch)  # (B, d)
            if isinstance(out, torch.Tensor):
                out = out.detach().to(device="cpu", dtype=torch.float32).numpy()
            out = np.asarray(out, dtype=np.float32)
            if out.ndim != 2 or out.shape[0] != len(rows):
                raise ValueError(f"encode_fn returned shape {out.shape} for a batch of {len(rows)} blocks; want (B, d)")
            chunks.append(out)
            n_tokens += _count_tokens(rows, batch)
            n_done += len(rows)
            bar.update(len(rows))
            if clock.due(n_done):
                log.info("%s", count_line(desc, n_done, total, clock.elapsed()))
    seconds = clock.elapsed()
    if not chunks:
        raise ValueError("no blocks to embed")
    emb = unsort_rows(np.concatenate(chunks, axis=0), order)  # (N, d) back in the caller's order
    return emb, embed_stats(emb.shape[0], n_tokens, emb.shape[1], seconds)


def embed_stats(n_blocks: int, n_tokens: int, dim: int, seconds: float) -> dict:
    """What `embed_blocks` (and the sharded embed) report: sizes, seconds and throughput."""
    return {"n_blocks": int(n_blocks), "n_tokens": int(n_tokens), "dim": int(dim), "seconds": seconds,
            "blocks_per_s": n_blocks / max(seconds, 1e-9), "tokens_per_s": n_tokens / max(seconds, 1e-9)}


def embed_and_build(
    encode_fn: Callable[[Any], torch.Tensor | np.ndarray],
    blocks: Iterable,
    ids: Any,
    *,
    batch_size: int,
    collate: Callable[[list], Any] | None = None,
    index_type: str = "auto",
    step: int | None = None,
    progress: bool = False,
    log_every: int = 0,
    **build_kwargs: Any,
) -> tuple[BlockIndex, dict]:
    """embed_blocks + BlockIndex.build: a fresh index of every block, the body of each refresh
    (an `AsyncRefresher` build_fn).

    `ids`: one block id per block, in order (e.g. `dataset["block_id"]`). `build_kwargs` go to
    `build_index` (auto_flat_max, use_gpu, nprobe, ...). Stats: the embed stats plus
    `build_seconds` and `index_type`. `log_every`: see `embed_blocks` (a line a minute regardless).
    """
    emb, stats = embed_blocks(encode_fn, blocks, batch_size, collate, progress=progress, log_every=log_every)
    index = BlockIndex.build(emb, ids, index_type, step=step, **build_kwargs)  # type: ignore[arg-type]
    return index, {**stats, "build_seconds": index.meta["build_seconds"], "index_type": index.index_type}
