"""What each optimiser step trains on: data order, micro-batches and seeds, pure functions of (seed,
step, rank, micro-batch) so that a resumed or re-launched run sees exactly the batches it would have.

Data order: an epoch-seeded permutation (compute.seed + epoch), cut into global batches of
`train.batch_size`; rank r takes its contiguous share, split into `grad_accum` micro-batches
(`StepSampler`). `MicroBatches` collates them; a `collate_fn` with a `generator` parameter gets a
`torch.Generator` seeded by `mix_seed(seed, step, rank, micro)`, so random masking is identical
after a resume.
"""

from __future__ import annotations

import hashlib
import inspect
import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from components.config_shared import TrainParams, batch_split_error


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def mix_seed(*parts: int) -> int:
    """A well-spread 63-bit seed from ints (seed, step, rank, ...): nearby tuples get unrelated streams."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def micro_batch_size(train: TrainParams, world_size: int, phase: str = "train") -> int:
    """Per-rank micro batch = batch_size / (world_size * grad_accum); must divide exactly (the error
    names phase's own keys: `batch_keys`)."""
    if why := batch_split_error(phase, train.batch_size, train.grad_accum, world_size):
        raise ValueError(why)
    return train.batch_size // (world_size * train.grad_accum)


class StepSampler:
    """Which dataset rows a (step, micro-batch) gets on this rank; a pure function of its inputs."""

    def __init__(self, num_rows: int, batch_size: int, world_size: int, rank: int, grad_accum: int, seed: int):
        if num_rows < batch_size:
            raise ValueError(f"dataset has {num_rows} rows, fewer than one global batch (batch_size={batch_size})")
        self.num_rows, self.batch_size, self.seed = num_rows, batch_size, seed
        self.rank, self.grad_accum = rank, grad_accum
        self.per_rank = batch_size // world_size
        self.micro = self.per_rank // grad_accum
        self.steps_per_epoch = num_rows // batch_size  # the remainder of each permutation is dropped
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.num_rows, generator=g)
        return self._perm

    def indices(self, step: int, micro: int) -> list[int]:
        epoch, pos = divmod(step, self.steps_per_epoch)
        start = pos * self.batch_size + self.rank * self.per_rank + micro * self.micro
        return self._permutation(epoch)[start : start + self.micro].tolist()


def _wants_generator(collate_fn: Callable) -> bool:
    try:
        p = inspect.signature(collate_fn).parameters.get("generator")
    except (TypeError, ValueError):
        return False
    return p is not None and p.kind is not inspect.Parameter.POSITIONAL_ONLY


class MicroBatches(torch.utils.data.Dataset):
    """Item i = collated micro-batch i of the run from `start_step` (step-major, micro-minor).

    Map-style so `num_workers > 0` collates in workers and still gives the same batches in order.
    """

    def __init__(self, dataset, collate_fn, sampler: StepSampler, start_step: int, max_steps: int, seed: int):
        self.dataset, self.collate_fn, self.sampler = dataset, collate_fn, sampler
        self.start_step, self.max_steps, self.seed = start_step, max_steps, seed
        self.accum = sampler.grad_accum
        self.with_generator = _wants_generator(collate_fn)

    def __len__(self) -> int:
        return max(0, self.max_steps - self.start_step) * self.accum

    def _rows(self, idx: list[int]) -> list:
        if hasattr(self.dataset, "__getitems__"):  # HF datasets: one columnar read, then rows
            return list(self.dataset.__getitems__(idx))
        return [self.dataset[i] for i in idx]

    def __getitem__(self, i: int):
        step, micro = divmod(i, self.accum)
        step += self.start_step
        rows = self._rows(self.sampler.indices(step, micro))
        if not self.with_generator:
            return self.collate_fn(rows)
        g = torch.Generator().manual_seed(mix_seed(self.seed, step, self.sampler.rank, micro))
        return self.collate_fn(rows, generator=g)


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
