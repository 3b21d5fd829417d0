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
masking is identical after a resume. Do not draw from the global RNG in collate_fn. The data position is
the optimiser step (`batches.py`); what a checkpoint holds and how a run resumes is `resume.py`.

Steps: `step` counts optimiser steps taken *or skipped*. A non-finite loss (or non-finite gradient
norm, except fp16 overflow which GradScaler handles) skips the update, counts a bad step and moves
on to the next batch; `train.max_bad_steps` consecutive bad steps (at least 1) stop the run with
`NonFiniteLossError`, without writing a checkpoint, so the last good one stays the newest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm.auto import tqdm

from components.config_shared import ComputeParams, TrainParams, batch_keys
from components.models.encoder import set_attention_dropout, set_length_chunk_tokens
from components.models.ops.dropout import fast_dropout_masks, use_fast_dropout
from components.progress import PROGRESS_EVERY_S, progress_line
from components.training import checkpoint as ckpt
from components.training import distributed as D
from components.training import memory
from components.training.batches import MicroBatches, StepSampler, micro_batch_size, seed_everything, to_device
from components.training.hooks import Hooks
from components.training.optim import SCHEDULES, LrGroup, lr_at, param_groups
from components.training.precision import AMP_DTYPES, resolve_precision
from components.training.resume import resume_trainer, save_trainer_checkpoint

LogFn = Callable[[dict[str, float], int], Any]

log = logging.getLogger(__name__)


def prefixed(log_fn: LogFn | None, prefix: str) -> LogFn | None:
    """`log_fn` with `prefix` put before every metric name: several trainings of one stage (a
    warm-up phase, one fine-tuning per start) log into the same run without colliding."""
    if log_fn is None:
        return None
    return lambda metrics, step: log_fn({f"{prefix}{k}": v for k, v in metrics.items()}, step)


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
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) of every logged window, resumes included


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
        if compute.attention_dropout is not None:  # before DDP wraps it: every rank trains the same graph
            n = set_attention_dropout(self.raw_model, compute.attention_dropout)
            if self.rank == 0:
                log.info("%s: compute.attention_dropout=%s on %d attention layers", param_prefix, compute.attention_dropout, n)
        if fast_dropout_masks(compute.dropout_masks, self.device):  # before DDP too: a module swap, no new parameters
            n = use_fast_dropout(self.raw_model)
            if self.rank == 0:
                log.info("%s: compute.dropout_masks=%s: %d dropout modules draw fast masks", param_prefix,
                         compute.dropout_masks, n)
        if compute.length_chunk_tokens:  # how the towers run, not what they compute: no parameter changes
            n = set_length_chunk_tokens(self.raw_model, compute.length_chunk_tokens)
            if self.rank == 0 and n:
                log.info("%s: compute.length_chunk_tokens=%d on %d modules", param_prefix, compute.length_chunk_tokens, n)
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
        self.curve: list[tuple[int, float]] = []  # (step, loss) per logged window; checkpointed, so it spans resumes
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
        resume_trainer(self)
        for fn in self.hooks.on_train_start:
            fn(self.step, self)
        if self.step >= self.train.max_steps:  # a finished run resumed: left as training leaves it
            self.raw_model.train()
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
            curve=list(self.curve),
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
            batch_key, accum_key = batch_keys(self.prefix)
            raise torch.OutOfMemoryError(
                f"out of memory at step {self.step} (per-rank micro batch {self.micro_batch}, "
                f"{accum_key}={self.train.grad_accum}, precision={self.precision}). Lower the memory per "
                f"micro-batch: raise {accum_key} (same global batch) or lower {batch_key}; lower the "
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
        # (throughputs and rss_mb are resume.MACHINE_METRICS: keep a new measurement of the machine there)
        self.last_metrics = metrics
        if "loss" in metrics:
            self.curve.append((self.step, float(metrics["loss"])))
        if self.log_fn is not None and self.is_rank0:
            self.log_fn(metrics, self.step)
        self._reset_window()

    # ------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Write `checkpoints/step-N/` atomically (rank 0 writes the shared files, each rank its RNG)."""
        return save_trainer_checkpoint(self)


__all__ = ["Hooks", "LogFn", "NonFiniteLossError", "TrainResult", "Trainer", "prefixed"]
