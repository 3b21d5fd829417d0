"""The optimiser side of training: the lr schedule (`lr_at`), AdamW's parameter groups
(`param_groups`: no decay for biases and norms, `LrGroup` for parameters at their own lr), and a short
phase's knobs (`phase_params`). Pure functions of their inputs, unit-tested on their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from components.config_shared import TrainParams


def phase_params(train: TrainParams, steps: int, lr: float, **update: Any) -> TrainParams:
    """A short training phase's knobs: `train` with its own steps and lr, checkpointing at least
    once within the phase (so a killed phase resumes)."""
    return train.model_copy(update={"max_steps": steps, "lr": lr,
                                    "checkpoint_every": max(1, min(train.checkpoint_every, steps)), **update})


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
