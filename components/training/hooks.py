"""The Trainer's hooks: what a stage runs inside the loop (REALM builds its index before the first
step and refreshes it after a step) without the loop knowing about indexes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from components.training.trainer import Trainer


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
