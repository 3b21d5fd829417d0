"""Params set the way `dvc exp run -S` sets them: a preset (`--preset`) or dotted overrides (`--set`)
written into params.yaml by DVC's own `-S` code, so comments and layout stay and `dvc status` and
`dvc.lock` see every value a stage runs with.

    apply_param_overrides(preset_switch("small"))                # params/small.yaml, other presets' keys reset
    apply_param_overrides({"retromae.train.max_steps": 200})    # validated first: a bad key writes nothing
    apply_param_overrides({"realm.train.weight_decay": 0.0})    # a key not in the file yet: `-S +key=value`
    apply_param_overrides({"realm.train.weight_decay": UNSET})  # removed (`-S ~key`): `trainer`'s again

A key params.yaml does not hold yet, e.g. a per-stage override of a shared `trainer` key, is written
the way `dvc exp run` needs it spelled: `-S +realm.train.weight_decay=0.0` (DVC refuses a plain
`-S key=value` for a key that is not in the file).

The pipeline flow (flows/pipeline.py) calls these before `dvc repro`.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path
from typing import Any

import yaml

from components.config import UNSET, load_params
from components.config_file import PARAMS_FILE, ParamsError, read_yaml

PRESETS_DIR = Path("params")
log = logging.getLogger(__name__)


def preset_overrides(preset: str) -> dict[str, Any]:
    """A preset (`paper`, or a path like `params/paper.yaml`) as the dotted keys it sets."""
    path = Path(preset) if preset.endswith((".yaml", ".yml")) else PRESETS_DIR / f"{preset}.yaml"
    if not path.is_file():
        have = sorted(f.stem for f in PRESETS_DIR.glob("*.yaml"))
        raise ParamsError(f"preset {preset!r}: {path} not found (presets: {have})")
    return _leaves(yaml.safe_load(path.read_text(encoding="utf-8")) or {})


def _leaves(node: dict, prefix: str = "") -> dict[str, Any]:
    """A nested params dict as its dotted keys: `{"a": {"b": 1}}` -> `{"a.b": 1}`."""
    out: dict[str, Any] = {}
    for k, v in node.items():
        out.update(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _committed_params() -> dict | None:
    """params.yaml as committed at HEAD (the default a preset switch starts from), or None outside
    a git checkout."""
    try:
        text = subprocess.run(["git", "show", f"HEAD:{PARAMS_FILE}"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return yaml.safe_load(text) or {}


def preset_switch(preset: str) -> dict[str, Any]:
    """What `--preset` writes into params.yaml: the preset's keys, and every key that another preset
    names reset to its committed value, so presets switch instead of stacking (`tiny` then `small`
    is small, not small over tiny's world). A key the committed file does not hold (a preset's
    per-stage override of a `trainer` key) is reset by removing it (`UNSET`). `default` writes only
    the reset."""
    own = {} if preset == "default" else preset_overrides(preset)
    base = _committed_params()
    if base is None:
        log.warning("--preset %s: not a git checkout, so the keys other presets set keep their current values", preset)
        return own
    named = set().union(*(preset_overrides(str(f)).keys() for f in sorted(PRESETS_DIR.glob("*.yaml"))))
    committed = _leaves(base)
    reset = {key: committed.get(key, UNSET) for key in sorted(named - own.keys())}
    return {**reset, **own}


def _hydra_value(v: Any) -> str:
    """A Python value in Hydra's override grammar, as `dvc exp run -S key=VALUE` reads it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, list):
        return "[" + ",".join(_hydra_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(x)}" for k, x in v.items()) + "}"
    raise ParamsError(f"cannot write {v!r} ({type(v).__name__}) into {PARAMS_FILE}")


def _holds(raw: dict, dotted: str) -> bool:
    node: Any = raw
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def set_params_args(overrides: dict[str, Any], current: dict | None = None) -> list[str]:
    """The `-S` arguments of `dvc exp run` that set `overrides` in a params file holding `current`:
    `key=value`; `+key=value` for a key `current` does not hold (Hydra's append: DVC refuses to set a
    missing key otherwise); `~key` removes one (`UNSET`). Without `current`, every key is taken as held."""
    args = []
    for k, v in overrides.items():
        if v is UNSET:
            args.append(f"~{k}")
        else:
            args.append(f"{'' if current is None or _holds(current, k) else '+'}{k}={_hydra_value(v)}")
    return args


def apply_param_overrides(overrides: dict | None, path: str = PARAMS_FILE) -> bool:
    """Write dotted overrides into params.yaml with DVC's own `dvc exp run -S` code (a round-trip
    edit: comments, key order and layout stay). Validated first: a bad key writes nothing. `UNSET`
    removes a key (one the file does not hold is left alone)."""
    if not overrides:
        return False
    from dvc.utils.hydra import apply_overrides

    load_params(path, overrides=overrides)  # raises ParamsError naming the key if invalid
    current = read_yaml(Path(path))
    todo = {k: v for k, v in overrides.items() if v is not UNSET or _holds(current, k)}
    if todo:
        apply_overrides(path, set_params_args(todo, current))
    return bool(todo)
