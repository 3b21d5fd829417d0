"""The shared trainer (RetroMAE, MLM baseline, REALM, fine-tuning): one loop, resumable, DDP-ready.

    trainer = Trainer(model, dataset, collate_fn, p.retromae.train, p.compute, "runs/retromae",
                      log_fn=lambda m, s: mlflow.log_metrics(m, step=s), param_prefix="retromae.train")
    result = trainer.fit()          # resumes from runs/retromae/checkpoints/ when it can

    # N processes: python -m torch.distributed.run --standalone --nproc_per_node=2 -m <stage module>

Contract with the model: `model(batch)` takes the collated dict (tensors moved to the device) and
returns a dict of scalar tensors with `loss` and optionally `num_tokens` (used for tokens/s; without
it the batch's `attention_mask` sum is used, else tokens/s is not logged). Every other scalar is
logged as a metric, averaged over accumulation micro-batches, the steps since the last log and ranks.
Metric keys must be the same on every rank (they are all-reduced as one vector).

Contract with the data: `dataset` is map-style (`len`, `[i]`: a list or an HF `datasets.Dataset`).
`collate_fn(rows)` or `collate_fn(rows, generator=...)`: when the signature has a parameter named
`generator`, it gets a `torch.Generator` seeded from (seed, step, rank, micro-batch), so random
masking is identical after a resume. Do not draw from the global RNG in collate_fn.

Data order: an epoch-seeded permutation (compute.seed + epoch), cut into global batches of
`train.batch_size`; rank r takes its contiguous share, split into `grad_accum` micro-batches. The
data position is the optimiser step, so a resumed run sees exactly the batches it would have seen.

Steps: `step` counts optimiser steps taken *or skipped*. A non-finite loss (or non-finite gradient
norm, except fp16 overflow which GradScaler handles) skips the update, counts a bad step and moves
on to the next batch; `train.max_bad_steps` consecutive bad steps (at least 1) stop the run with
`NonFiniteLossError`, without writing a checkpoint, so the last good one stays the newest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import logging
import os
import random
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm.auto import tqdm

from components.config import ComputeParams, TrainParams
from components.progress import PROGRESS_EVERY_S, progress_line
from components.training import checkpoint as ckpt
from components.training import distributed as D
from components.training import memory
from components.training.precision import AMP_DTYPES, resolve_precision

LogFn = Callable[[dict[str, float], int], Any]

log = logging.getLogger(__name__)


def prefixed(log_fn: LogFn | None, prefix: str) -> LogFn | None:
    """`log_fn` with `prefix` put before every metric name: several trainings of one stage (a
    warm-up phase, one fine-tuning per start) log into the same run without colliding."""
    if log_fn is None:
        return None
    return lambda metrics, step: log_fn({f"{prefix}{k}": v for k, v in metrics.items()}, step)


def phase_params(train: TrainParams, steps: int, lr: float, **update: Any) -> TrainParams:
    """A short training phase's knobs: `train` with its own steps and lr, checkpointing at least
    once within the phase (so a killed phase resumes)."""
    return train.model_copy(update={"max_steps": steps, "lr": lr,
                                    "checkpoint_every": max(1, min(train.checkpoint_every, steps)), **update})


class NonFiniteLossError(RuntimeError):
    """Too many consecutive NaN/inf steps; the newest checkpoint is the last good one."""


@dataclass
class TrainResult:
    step: int  # optimiser steps done (== train.max_steps on success)
    metrics: dict[str, float]  # the last logged metrics ({} if nothing was trained)
    bad_steps: int  # skipped NaN/inf steps, over the whole run including before a resume
    resumed_from: int | None  # step of the checkpoint resumed from
    checkpoint: Path | None  # the final checkpoint folder
    elapsed_s: float = 0.0


@dataclass
class Hooks:
    """Callables run on EVERY rank (guard rank-0-only work with `distributed.is_rank0()`).

    on_train_start(step, trainer): after resuming, before the first step (REALM: build the index).
    on_step_end(step, trainer): after each optimiser step and its checkpoint (REALM: refresh_index).
    on_checkpoint(step, path): after a checkpoint folder is committed.
    """

    on_train_start: list[Callable[[int, "Trainer"], Any]] = field(default_factory=list)
    on_step_end: list[Callable[[int, "Trainer"], Any]] = field(default_factory=list)
    on_checkpoint: list[Callable[[int, Path], Any]] = field(default_factory=list)

    @classmethod
    def coerce(cls, hooks: "Hooks | Mapping[str, Any] | None") -> "Hooks":
        if hooks is None:
            return cls()
        if isinstance(hooks, cls):
            return hooks
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(hooks) - names
        if unknown:
            raise ValueError(f"unknown hook(s) {sorted(unknown)}; known: {sorted(names)}")
        return cls(**{k: list(v) if isinstance(v, (list, tuple)) else [v] for k, v in hooks.items()})


# ----------------------------------------------------------------------------------------------
# pure helpers (unit-tested on their own)
# ----------------------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def mix_seed(*parts: int) -> int:
    """A well-spread 63-bit seed from ints (seed, step, rank, ...): nearby tuples get unrelated streams."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


SCHEDULES = ("linear", "constant")


def lr_at(step: int, train: TrainParams, schedule: str = "linear") -> float:
    """LR for the optimiser step with 0-based index `step`: linear warmup, then linear decay to 0
    (`linear`) or train.lr to the end (`constant`, for a short phase that hands over to another).

    Warmup reaches train.lr at step == warmup; the last step (max_steps - 1) still gets a non-zero
    LR, so no step is wasted at lr 0.
    """
    w = train.warmup_steps()
    if step < w:
        return train.lr * (step + 1) / w
    if schedule == "constant":
        return train.lr
    return train.lr * max(0.0, (train.max_steps - step) / max(1, train.max_steps - w))


def micro_batch_size(train: TrainParams, world_size: int, prefix: str = "train") -> int:
    """Per-rank micro batch = batch_size / (world_size * grad_accum); must divide exactly."""
    div = world_size * train.grad_accum
    if train.batch_size % div:
        raise ValueError(
            f"{prefix}.batch_size={train.batch_size} (the global batch per optimiser step) must be divisible "
            f"by world_size ({world_size}) x {prefix}.grad_accum ({train.grad_accum}) = {div}; "
            f"pick {prefix}.batch_size as a multiple of {div}"
        )
    return train.batch_size // div


_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm, nn.RMSNorm)


@dataclass(frozen=True)
class LrGroup:
    """Parameters trained at their own base lr (e.g. a fresh head beside a pre-trained body).

    The schedule scales it as it scales train.lr: the group keeps `lr / train.lr` as its `lr_scale`
    (in the optimiser state, so a resume keeps it). Logged as `lr_<name>`."""

    name: str
    selects: Callable[[str], bool]  # a parameter's name in model.named_parameters() -> in this group
    lr: float


def param_groups(model: nn.Module, weight_decay: float, lr_groups: Sequence[LrGroup] = (),
                 base_lr: float | None = None) -> list[dict]:
    """AdamW groups: decay for weight matrices/embeddings, none for biases and norm weights; and
    that split again for each `lr_groups` entry (the first that selects a parameter wins), with its
    `lr_scale` = group lr / `base_lr`. Without lr_groups: the two groups, both at scale 1.

    A tied weight is one parameter, listed once (under the name it is first reached by).
    """
    if lr_groups and not base_lr:
        raise ValueError("lr_groups need base_lr (train.lr) to turn each group's lr into a scale")
    keys = [("", 1.0)] + [(g.name, g.lr / base_lr) for g in lr_groups]
    split = {k: ([], []) for k, _ in keys}
    seen = set()
    for mname, module in model.named_modules():
        is_norm = isinstance(module, _NORM_TYPES) or "norm" in type(module).__name__.lower()
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{mname}.{name}" if mname else name
            group = next((g.name for g in lr_groups if g.selects(full)), "")
            decay, no_decay = split[group]
            (no_decay if is_norm or name.endswith("bias") or p.ndim < 2 else decay).append(p)
    out = []
    for key, scale in keys:
        decay, no_decay = split[key]
        if key and not (decay or no_decay):
            raise ValueError(f"lr group {key!r} selects no trainable parameter")
        out += [{"params": decay, "weight_decay": weight_decay, "lr_scale": scale, "group": key},
                {"params": no_decay, "weight_decay": 0.0, "lr_scale": scale, "group": key}]
    return out


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


# ----------------------------------------------------------------------------------------------
# the trainer
# ----------------------------------------------------------------------------------------------
class Trainer:
    def __init__(
        self,
        model: nn.Module,
        dataset: Sequence | Any,
        collate_fn: Callable,
        train: TrainParams,
        compute: ComputeParams,
        out_dir: str | os.PathLike,
        log_fn: LogFn | None = None,
        hooks: Hooks | Mapping[str, Any] | None = None,
        *,
        log_every: int = 1,
        param_prefix: str = "train",
        find_unused_parameters: bool = False,
        progress: bool = True,
        lr_groups: Sequence[LrGroup] = (),
        schedule: str = "linear",
        progress_every: int | None = None,
        label: str | None = None,
    ):
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1 (got {log_every})")
        if progress_every is not None and progress_every < 0:
            raise ValueError(f"progress_every must be >= 0 (got {progress_every})")
        self.train, self.compute = train, compute
        self.out_dir = Path(out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.log_fn, self.log_every, self.prefix = log_fn, log_every, param_prefix
        # what progress lines call this loop: the params path by default; a loop that borrows another's
        # params (the MLM baseline trains with retromae.train) names itself, errors still name the params
        self.label = label or param_prefix
        self.hooks = Hooks.coerce(hooks)
        self.progress = progress
        # tracking.progress_every; None: about ten lines a run. 0: no progress lines.
        self.progress_every = max(1, train.max_steps // 10) if progress_every is None else progress_every
        self._last_progress_t = time.perf_counter()
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}; known: {SCHEDULES}")
        self.schedule, self.lr_groups = schedule, tuple(lr_groups)

        self.rank, self.world_size, self.local_rank, self.device = D.init_distributed(compute)
        self.precision = resolve_precision(compute.precision, self.device)
        if self.rank == 0 and compute.precision != self.precision:
            log.info("%s: compute.precision=%s runs as %s on %s", param_prefix, compute.precision, self.precision, self.device)
        self.micro_batch = micro_batch_size(train, self.world_size, param_prefix)
        self.dataset, self.collate_fn = dataset, collate_fn
        self.sampler = StepSampler(
            len(dataset), train.batch_size, self.world_size, self.rank, train.grad_accum, compute.seed
        )

        self.raw_model = model.to(self.device)
        self.model: nn.Module = self.raw_model
        if self.world_size > 1:
            self.model = DDP(
                self.raw_model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=find_unused_parameters,
            )
        self.optimizer = torch.optim.AdamW(
            param_groups(self.raw_model, train.weight_decay, self.lr_groups, train.lr),
            lr=train.lr,
            betas=(train.adam_beta1, train.adam_beta2),
            eps=train.adam_eps,
            # the fused kernel on CPU too: 3x faster than the per-tensor loop (bench/bench_precision.py),
            # which took a third of a REALM reader warm-up step (three MiniLM-sized modules) in a profile
            fused=self.device.type in ("cuda", "cpu"),
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.amp_dtype = AMP_DTYPES.get(self.precision)  # None: fp32
        self.heap = memory.HeapTrimmer(compute.malloc_trim_every)

        self.step = 0
        self.bad_steps = 0
        self.consecutive_bad = 0
        self.resumed_from: int | None = None
        self.last_metrics: dict[str, float] = {}
        self.last_checkpoint: Path | None = None

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        """Train to `train.max_steps`, resuming from the newest good checkpoint if there is one."""
        t_start = time.perf_counter()
        # Same dropout stream for a given seed whatever ran before; a resume overrides it below.
        seed_everything(self.compute.seed + self.rank)
        self._resume()
        for fn in self.hooks.on_train_start:
            fn(self.step, self)
        if self.step >= self.train.max_steps:
            return self._result(t_start)

        batches = self._batches()
        pbar = tqdm(
            total=self.train.max_steps, initial=self.step, desc=self.label, file=sys.stderr, dynamic_ncols=True,
            disable=not (self.progress and self.is_rank0 and sys.stderr.isatty()),
        )  # fmt: skip
        self._reset_window()
        self.raw_model.train()
        first_step, t_loop = self.step, time.perf_counter()
        try:
            while self.step < self.train.max_steps:
                self._train_step(batches)
                self.step += 1
                self.heap.after_step(self.step)
                pbar.update(1)
                if self.step % self.log_every == 0 or self.step == self.train.max_steps:
                    self._log()
                    pbar.set_postfix(loss=f"{self.last_metrics.get('loss', float('nan')):.4f}")
                if self._progress_due(first_step):
                    self._log_progress(first_step, t_loop)
                if self.step % self.train.checkpoint_every == 0 or self.step == self.train.max_steps:
                    self.save_checkpoint()
                for fn in self.hooks.on_step_end:
                    fn(self.step, self)
        finally:
            pbar.close()
        return self._result(t_start)

    def _progress_due(self, first_step: int) -> bool:
        # the first step too: a slow loop says at once that it started, and how fast it goes; and at
        # least every PROGRESS_EVERY_S, so a loop of slow steps is never silent for long
        every = self.progress_every
        return bool(every) and self.is_rank0 and (
            self.step % every == 0 or self.step == self.train.max_steps or self.step == first_step + 1
            or time.perf_counter() - self._last_progress_t >= PROGRESS_EVERY_S)

    def _log_progress(self, first_step: int, t_loop: float) -> None:
        """One INFO line through `logging` (a non-TTY terminal, the Prefect flow-run log, torchrun's
        rank 0 output); `extra["rr_progress"]` carries the numbers for handlers that want them."""
        done = self.step - first_step
        per_step = (time.perf_counter() - t_loop) / max(1, done)
        eta = per_step * (self.train.max_steps - self.step)
        info = {"prefix": self.label, "step": self.step, "max_steps": self.train.max_steps, "eta_s": eta,
                "loss": self.last_metrics.get("loss"), "tokens_per_s": self.last_metrics.get("tokens_per_s")}
        log.info("%s", progress_line(self.label, self.step, self.train.max_steps, self.last_metrics, eta),
                 extra={"rr_progress": info})
        self._last_progress_t = time.perf_counter()

    def _result(self, t_start: float) -> TrainResult:
        if self.last_checkpoint is None and self.step > 0:
            found = [p for s, p in ckpt.list_checkpoints(self.ckpt_dir) if s == self.step]
            self.last_checkpoint = found[0] if found else None
        return TrainResult(
            step=self.step,
            metrics=dict(self.last_metrics),
            bad_steps=self.bad_steps,
            resumed_from=self.resumed_from,
            checkpoint=self.last_checkpoint,
            elapsed_s=time.perf_counter() - t_start,
        )

    def _batches(self):
        data = MicroBatches(
            self.dataset, self.collate_fn, self.sampler, self.step, self.train.max_steps, self.compute.seed
        )
        if self.train.num_workers == 0:
            return (data[i] for i in range(len(data)))
        # batch_size=None: items are already batches. Own generator: creating the iterator must
        # not draw from the global RNG (that would shift dropout after a resume).
        return iter(torch.utils.data.DataLoader(
            data, batch_size=None, shuffle=False, num_workers=self.train.num_workers,
            pin_memory=self.device.type == "cuda", generator=torch.Generator().manual_seed(self.compute.seed),
        ))  # fmt: skip

    # ------------------------------------------------------------------------------------------
    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def _train_step(self, batches) -> None:
        try:
            self._train_step_inner(batches)
        except torch.OutOfMemoryError as e:
            self.optimizer.zero_grad(set_to_none=True)
            p = self.prefix
            raise torch.OutOfMemoryError(
                f"out of memory at step {self.step} (per-rank micro batch {self.micro_batch}, "
                f"{p}.grad_accum={self.train.grad_accum}, precision={self.precision}). Lower the memory per "
                f"micro-batch: raise {p}.grad_accum (same global batch) or lower {p}.batch_size; lower the "
                f"stage's max_len (sequence length); or set compute.precision=bf16 (fp16 on GPUs without bf16). "
                f"Original error: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from e

    def _train_step_inner(self, batches) -> None:
        accum = self.train.grad_accum
        step_sums: dict[str, torch.Tensor] = {}
        for micro in range(accum):
            batch = to_device(next(batches), self.device)
            # DDP: all-reduce gradients only on the last micro-batch.
            sync = micro == accum - 1 or self.world_size == 1
            with (contextlib.nullcontext() if sync else self.model.no_sync()), self._autocast():
                out = self.model(batch)
            if not isinstance(out, Mapping) or "loss" not in out:
                raise TypeError("model(batch) must return a dict of scalar tensors with a 'loss' key")
            loss = out["loss"].float()
            self.scaler.scale(loss / accum).backward()
            for k, v in out.items():
                v = torch.as_tensor(v, device=self.device).detach().float()
                if k == "num_tokens":
                    self._win_tokens += v
                    self._have_tokens = True
                else:
                    step_sums[k] = step_sums.get(k, 0.0) + v / accum
            if "num_tokens" not in out and isinstance(batch, Mapping) and "attention_mask" in batch:
                self._win_tokens += batch["attention_mask"].sum()
                self._have_tokens = True

        lr = lr_at(self.step, self.train, self.schedule)
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        self.scaler.unscale_(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        max_norm = self.train.max_grad_norm if self.train.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).float()

        # The one host sync per step: was the loss (on any rank) or the gradient non-finite?
        flags = torch.stack([~torch.isfinite(step_sums["loss"]), ~torch.isfinite(grad_norm)]).float()
        loss_bad, grad_bad = (bool(x) for x in D.all_reduce_(flags, op="max").tolist())
        fp16 = self.scaler.is_enabled()
        bad = loss_bad or (grad_bad and not fp16)  # fp16 overflow: GradScaler skips and lowers the scale
        if bad:
            self.bad_steps += 1
            self.consecutive_bad += 1
            if fp16:
                self.scaler.update()
        else:
            self.consecutive_bad = 0
            self.scaler.step(self.optimizer)  # skips by itself on fp16 overflow
            self.scaler.update()
            if not grad_bad:
                for k, v in step_sums.items():
                    self._win_sums[k] = self._win_sums.get(k, 0.0) + v
                self._win_sums["grad_norm"] = self._win_sums.get("grad_norm", 0.0) + grad_norm
                self._win_good += 1
        self.optimizer.zero_grad(set_to_none=True)
        self._win_steps += 1

        if bad and self.consecutive_bad >= max(1, self.train.max_bad_steps):
            last = ckpt.list_checkpoints(self.ckpt_dir)
            raise NonFiniteLossError(
                f"{self.consecutive_bad} consecutive steps with a non-finite "
                f"{'loss' if loss_bad else 'gradient norm'} (last at step {self.step + 1}; "
                f"{self.prefix}.max_bad_steps={self.train.max_bad_steps}). No checkpoint was written for them; "
                f"the newest checkpoint is {last[-1][1] if last else 'none'}. "
                f"Try a lower {self.prefix}.lr, {self.prefix}.max_grad_norm > 0, or compute.precision=fp32."
            )

    # ------------------------------------------------------------------------------------------
    def _reset_window(self) -> None:
        self._win_sums: dict[str, torch.Tensor | float] = {}
        self._win_tokens = torch.zeros((), device=self.device)
        self._have_tokens = False
        self._win_good = 0
        self._win_steps = 0
        self._win_t0 = time.perf_counter()

    def _log(self) -> None:
        """Reduce the window's metrics across ranks (one sync), hand them to log_fn on rank 0."""
        keys = sorted(self._win_sums)
        vec = torch.stack([torch.as_tensor(self._win_sums[k], device=self.device) for k in keys] + [self._win_tokens])
        vals = D.all_reduce_(vec.float(), op="sum").tolist()
        elapsed = max(time.perf_counter() - self._win_t0, 1e-9)
        metrics: dict[str, float] = {}
        if self._win_good:
            metrics = {k: v / (self.world_size * self._win_good) for k, v in zip(keys, vals)}
        metrics["lr"] = lr_at(self.step - 1, self.train, self.schedule)
        for g in self.lr_groups:
            metrics[f"lr_{g.name}"] = metrics["lr"] * g.lr / self.train.lr
        metrics["bad_steps"] = float(self.bad_steps)
        metrics["samples_per_s"] = self._win_steps * self.train.batch_size / elapsed
        if self._have_tokens:
            metrics["tokens_per_s"] = vals[-1] / elapsed
        metrics["rss_mb"] = memory.rss_mb()  # this rank's host memory: a leak shows as a rising curve
        self.last_metrics = metrics
        if self.log_fn is not None and self.is_rank0:
            self.log_fn(metrics, self.step)
        self._reset_window()

    # ------------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            # The schedule is a pure function of the step; recorded so a resume can check it.
            "scheduler": {"kind": "linear_warmup_linear_decay" if self.schedule == "linear" else "linear_warmup_constant",
                          "last_step": self.step, "lr_scales": {g.name: g.lr / self.train.lr for g in self.lr_groups},
                          "warmup_steps": self.train.warmup_steps(), "max_steps": self.train.max_steps},
            "scaler": self.scaler.state_dict(),
            "bad_steps": self.bad_steps,
            "consecutive_bad": self.consecutive_bad,
        }  # fmt: skip

    def save_checkpoint(self) -> Path:
        """Write `checkpoints/step-N/` atomically (rank 0 writes the shared files, each rank its RNG)."""
        tmp = self.ckpt_dir / f".tmp-{ckpt.step_dirname(self.step)}"
        if self.is_rank0:
            ckpt.begin_checkpoint(self.ckpt_dir, self.step)
        D.barrier()
        if self.is_rank0:
            ckpt.write_model(tmp, self.raw_model)
            ckpt.write_state(tmp, self._state())
        ckpt.write_rng(tmp, self.rank)
        D.barrier()
        final = self.ckpt_dir / ckpt.step_dirname(self.step)
        if self.is_rank0:
            extra = {"world_size": self.world_size, "precision": self.precision, "param_prefix": self.prefix}
            final = ckpt.commit_checkpoint(tmp, self.step, extra)
            ckpt.prune_checkpoints(self.ckpt_dir, self.train.keep_checkpoints)
        D.barrier()
        self.last_checkpoint = final
        for fn in self.hooks.on_checkpoint:
            fn(self.step, final)
        return final

    def _resume(self) -> None:
        """Load the newest checkpoint that verifies (rank 0 picks, every rank loads the same one)."""
        step = -1
        if self.is_rank0:
            ckpt.remove_stale_tmp(self.ckpt_dir)
            path = ckpt.latest_checkpoint(self.ckpt_dir, quarantine=True)
            step = ckpt.read_meta(path)["step"] if path is not None else -1
        step = D.broadcast_int(step, self.device)
        if step < 0:
            return
        path = self.ckpt_dir / ckpt.step_dirname(step)
        state = ckpt.load_state(path)
        ckpt.load_model_weights(path, self.raw_model)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler.is_enabled() and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        rng = ckpt.load_rng(path, self.rank)
        if rng is not None:
            ckpt.set_rng_state(rng)
        else:
            warnings.warn(f"{path}: no RNG state for rank {self.rank} (world size changed?); dropout will differ",
                          ckpt.CheckpointWarning, stacklevel=2)  # fmt: skip
        self.step = int(state["step"])
        self.bad_steps = int(state.get("bad_steps", 0))
        self.consecutive_bad = int(state.get("consecutive_bad", 0))
        self.resumed_from = self.step
        self.last_checkpoint = path
        D.barrier()


__all__ = [
    "Hooks",
    "LrGroup",
    "MicroBatches",
    "NonFiniteLossError",
    "StepSampler",
    "TrainResult",
    "Trainer",
    "lr_at",
    "micro_batch_size",
    "mix_seed",
    "param_groups",
    "seed_everything",
    "to_device",
]
