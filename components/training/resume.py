"""A Trainer's checkpoint: what it holds besides the weights (the optimiser, the schedule, the fp16
scaler, the bad-step counts, each rank's RNG), writing it atomically, and resuming from the newest
one that verifies. The files and their integrity checks are `checkpoint.py`'s.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from components.io import explain_full_disk
from components.training import checkpoint as ckpt
from components.training import distributed as D

if TYPE_CHECKING:
    from components.training.trainer import Trainer


# What `Trainer._log` measures of the machine in a window (throughput, memory), not of the model: left
# out of checkpoints and of shared phases' summaries, so two identical runs write identical files.
MACHINE_METRICS = ("samples_per_s", "tokens_per_s", "rss_mb")


def model_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if k not in MACHINE_METRICS}


def trainer_state(trainer: "Trainer") -> dict[str, Any]:
    """Everything a resume needs besides the weights and the RNG (those are files of their own)."""
    return {
        "step": trainer.step,
        "optimizer": trainer.optimizer.state_dict(),
        # The schedule is a pure function of the step; recorded so a resume can check it.
        "scheduler": {"kind": "linear_warmup_linear_decay" if trainer.schedule == "linear" else "linear_warmup_constant",
                      "last_step": trainer.step, "lr_scales": {g.name: g.lr / trainer.train.lr for g in trainer.lr_groups},
                      "warmup_steps": trainer.train.warmup_steps(), "max_steps": trainer.train.max_steps},
        "scaler": trainer.scaler.state_dict(),
        "bad_steps": trainer.bad_steps,
        "consecutive_bad": trainer.consecutive_bad,
        # the last logged window, so a resume of a finished run (a shared phase) reports what the run
        # ended with; not what the machine measured, which would make two identical runs' checkpoints differ
        "metrics": model_metrics(trainer.last_metrics),
        "curve": [[s, v] for s, v in trainer.curve],  # the loss curve a resumed run writes whole
    }  # fmt: skip


def save_trainer_checkpoint(trainer: "Trainer") -> Path:
    """Write `checkpoints/step-N/` atomically (rank 0 writes the shared files, each rank its RNG)."""
    tmp = ckpt.tmp_path(trainer.ckpt_dir, trainer.step)
    if trainer.is_rank0:
        ckpt.begin_checkpoint(trainer.ckpt_dir, trainer.step)
    D.barrier()
    with explain_full_disk(tmp, f"checkpoint of step {trainer.step}"):
        if trainer.is_rank0:
            ckpt.write_model(tmp, trainer.raw_model)
            ckpt.write_state(tmp, trainer_state(trainer))
        ckpt.write_rng(tmp, trainer.rank)
    D.barrier()
    final = trainer.ckpt_dir / ckpt.step_dirname(trainer.step)
    if trainer.is_rank0:
        extra = {"world_size": trainer.world_size, "precision": trainer.precision, "param_prefix": trainer.prefix}
        final = ckpt.commit_checkpoint(tmp, trainer.step, extra)
        ckpt.prune_checkpoints(trainer.ckpt_dir, trainer.train.keep_checkpoints)
    D.barrier()
    trainer.last_checkpoint = final
    for fn in trainer.hooks.on_checkpoint:
        fn(trainer.step, final)
    return final


def resume_trainer(trainer: "Trainer") -> None:
    """Load the newest checkpoint that verifies (rank 0 picks, every rank loads the same one)."""
    step = -1
    if trainer.is_rank0:
        ckpt.remove_stale_tmp(trainer.ckpt_dir)
        path = ckpt.latest_checkpoint(trainer.ckpt_dir, quarantine=True)
        step = ckpt.read_meta(path)["step"] if path is not None else -1
    step = D.broadcast_int(step, trainer.device)
    if step < 0:
        return
    path = trainer.ckpt_dir / ckpt.step_dirname(step)
    state = ckpt.load_state(path)
    ckpt.load_model_weights(path, trainer.raw_model)
    trainer.optimizer.load_state_dict(state["optimizer"])
    if trainer.scaler.is_enabled() and state.get("scaler"):
        trainer.scaler.load_state_dict(state["scaler"])
    rng = ckpt.load_rng(path, trainer.rank)
    if rng is not None:
        ckpt.set_rng_state(rng)
    else:
        warnings.warn(f"{path}: no RNG state for rank {trainer.rank} (world size changed?); dropout will differ",
                      ckpt.CheckpointWarning, stacklevel=3)  # fmt: skip
    trainer.step = int(state["step"])
    trainer.bad_steps = int(state.get("bad_steps", 0))
    trainer.consecutive_bad = int(state.get("consecutive_bad", 0))
    trainer.last_metrics = dict(state.get("metrics", {}))
    trainer.curve = [(int(s), float(v)) for s, v in state.get("curve", []) if s <= trainer.step]
    trainer.resumed_from = trainer.step
    trainer.last_checkpoint = path
    D.barrier()
