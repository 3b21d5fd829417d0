"""Atomic, verifiable, pickle-free training checkpoints.

Layout (one folder per optimiser step, newest `keep` kept):

    out_dir/checkpoints/step-000010/
        model.safetensors     weights (tied weights stored once; safetensors cannot run code)
        trainer_state.pt      optimizer + scheduler + scaler + counters (torch.save, plain tensors/containers)
        rng-rank{R}.pt        each rank's torch/cuda/numpy/python RNG state
        meta.json             written LAST: step, world size, the sha256 and size of every file above

A checkpoint is written to `.tmp-step-000010/` and renamed into place, so a folder named `step-*`
is always complete; a kill mid-write leaves only a `.tmp-*` folder, removed on the next start. The
folder, its manifest and their checks are `components.io`'s (`begin_dir`, `write_manifest`,
`commit_dir`, `verify_manifest`). Every `torch.load` here uses `weights_only=True`: a pickle that
tries to run code (or reference any non-tensor class) is refused with `CheckpointError`, never
executed.

    from components.training.checkpoint import latest_checkpoint, load_model_weights
    load_model_weights(latest_checkpoint("runs/retromae/checkpoints"), model)
"""

from __future__ import annotations

import os
import pickle
import random
import re
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from components.io import (MANIFEST, ManifestError, begin_dir, commit_dir, read_manifest, remove_dir, remove_leftovers,
                           temp_sibling, verify_manifest, write_manifest)

FORMAT = "retro-realm-checkpoint/2"  # /2: the manifest's entries are {sha256, bytes}
MODEL_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
META_FILE = MANIFEST
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or holds something we refuse to load."""


class CheckpointWarning(UserWarning):
    """A newer checkpoint was skipped because it failed verification."""


def step_dirname(step: int) -> str:
    return f"step-{step:06d}"


def rng_filename(rank: int) -> str:
    return f"rng-rank{rank}.pt"


# ----------------------------------------------------------------------------------------------
# listing / verifying / choosing
# ----------------------------------------------------------------------------------------------
def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of every committed `step-*` folder under `root`, oldest first (unverified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Return the checkpoint's meta.json if every listed file exists with its recorded sha256."""
    try:
        meta = read_manifest(path)
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{path}: {META_FILE} is not a {FORMAT} manifest (format {meta.get('format')!r})")
        return verify_manifest(path, meta, required=(MODEL_FILE, STATE_FILE))
    except ManifestError as e:
        raise CheckpointError(str(e)) from None


def read_meta(path: str | os.PathLike) -> dict:
    """meta.json of a checkpoint folder, unverified (use `verify_checkpoint` to check hashes)."""
    try:
        return read_manifest(path)
    except ManifestError as e:
        raise CheckpointError(str(e)) from None


def _quarantine(path: Path) -> Path:
    target = path.with_name(f"corrupt-{path.name}")
    if target.exists():
        target = path.with_name(f"corrupt-{path.name}-{int(time.time())}")
    os.replace(path, target)
    return target


def latest_checkpoint(root: str | os.PathLike, quarantine: bool = False) -> Path | None:
    """Newest checkpoint under `root` that verifies; None if there is none.

    Each newer one that fails verification is reported with a `CheckpointWarning` (and, with
    `quarantine=True`, renamed to `corrupt-step-*` so a later save of that step cannot collide).
    """
    for step, path in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            moved = f"; moved to {_quarantine(path).name}" if quarantine else ""
            warnings.warn(f"skipping corrupt checkpoint step {step}: {e}{moved}", CheckpointWarning, stacklevel=2)
    return None


def remove_stale_tmp(root: str | os.PathLike) -> list[Path]:
    """Delete the `.tmp-*` / `.old-*` entries a killed run left behind (call only when no save is in flight)."""
    return remove_leftovers(root)


def prune_checkpoints(root: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the `keep` newest `step-*` folders; returns what was deleted."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (got {keep})")
    old = [p for _, p in list_checkpoints(root)[:-keep]]
    for p in old:
        remove_dir(p)  # renamed aside first: a crash mid-delete never leaves a half `step-N` to resume from
    return old


# ----------------------------------------------------------------------------------------------
# writing: begin (rank 0) -> each rank writes its files -> commit (rank 0)
# ----------------------------------------------------------------------------------------------
def begin_checkpoint(root: str | os.PathLike, step: int) -> Path:
    """Create an empty `.tmp-step-N/` under `root` (removing a leftover of the same name)."""
    return begin_dir(Path(root) / step_dirname(step), unique=False)


def tmp_path(root: str | os.PathLike, step: int) -> Path:
    """Where step N is written before its commit: every rank writes its files into it."""
    return temp_sibling(Path(root) / step_dirname(step))


def write_model(folder: Path, model: torch.nn.Module) -> None:
    # save_model (not save_file) drops the duplicate names of tied weights instead of failing.
    save_model(model, str(folder / MODEL_FILE))


def write_state(folder: Path, state: dict[str, Any]) -> None:
    torch.save(state, folder / STATE_FILE)


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors/ints only (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
    }  # fmt: skip
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_rng(folder: Path, rank: int) -> None:
    torch.save(rng_state(), folder / rng_filename(rank))


def commit_checkpoint(tmp: Path, step: int, extra: dict | None = None) -> Path:
    """Hash every file in `tmp`, write meta.json last, then atomically rename to `step-N/`
    (replacing one of that step, e.g. a quarantined-then-retrained step)."""
    meta = {"format": FORMAT, "step": step, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(extra or {})}
    write_manifest(tmp, meta)
    return commit_dir(tmp, tmp.parent / step_dirname(step))


def save_checkpoint(
    root: str | os.PathLike, step: int, model: torch.nn.Module, state: dict[str, Any], extra: dict | None = None
) -> Path:
    """Single-process save: model + state + this process's RNG, committed atomically."""
    tmp = begin_checkpoint(root, step)
    write_model(tmp, model)
    write_state(tmp, state)
    write_rng(tmp, 0)
    return commit_checkpoint(tmp, step, extra)


# ----------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------
def load_tensor_file(path: str | os.PathLike) -> Any:
    """`torch.load(weights_only=True)`, with a refused pickle reported as a `CheckpointError`."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"refusing to load {path}: it is not a plain tensor file (weights_only=True rejected it: "
            f"{str(e).splitlines()[0]}). Nothing in it was executed. If you did not create this file, "
            "delete the checkpoint folder and do not trust its other files."
        ) from None


def load_model_weights(path: str | os.PathLike, model: torch.nn.Module, strict: bool = True) -> None:
    """Copy the checkpoint's weights into `model` in place (ties and devices are kept)."""
    f = Path(path) / MODEL_FILE if Path(path).is_dir() else Path(path)
    if not f.is_file():
        raise CheckpointError(f"no model weights at {f}")
    try:
        missing, unexpected = load_model(model, str(f), strict=strict)
    except RuntimeError as e:
        raise CheckpointError(f"{f}: weights do not fit this model: {e}") from None
    if strict and (missing or unexpected):  # pragma: no cover - load_model(strict=True) already raises
        raise CheckpointError(f"{f}: missing {missing}, unexpected {unexpected}")


def load_state(path: str | os.PathLike) -> dict[str, Any]:
    state = load_tensor_file(Path(path) / STATE_FILE)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}/{STATE_FILE}: expected a dict, got {type(state).__name__}")
    return state


def load_rng(path: str | os.PathLike, rank: int) -> dict[str, Any] | None:
    f = Path(path) / rng_filename(rank)
    return load_tensor_file(f) if f.is_file() else None
