"""params.yaml as a file: its name, reading one (a malformed file is a `ParamsError` naming it), its
one layout rule (the shared `trainer` group under each stage's trainer block, `inherit_trainer`),
the repo's own copy, whose values fill the keys a section built in code is not given
(`components.config_shared.Section`), and `--set key=value` overrides (`parse_overrides`, each value
read by `override_value`).
"""

from __future__ import annotations

import copy
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

PARAMS_FILE = "params.yaml"
DEFAULT_FILE = Path(__file__).resolve().parents[1] / PARAMS_FILE  # the repo's params.yaml: the default's values
# The trainer knobs every training stage shares are written once, in the top-level `trainer` group; each
# stage's block (a `TrainParams`) holds its own keys and may override any shared one.
TRAINER = "trainer"
TRAIN_BLOCKS = ("retromae.train", "realm.train", "finetune.train", "finetune.qa_train")
# Keys params.yaml no longer has, each with why. An old params.yaml (or `dvc exp run -S`) that still sets
# one stops with `removed_key_message`, not a bare "unknown key", so the user learns what to write instead.
# Issue 29 made `warm_start.path` the one way to start from a pre-trained model.
REMOVED_KEYS = {
    "retromae.encoder.init": "the encoder is built from retromae.encoder's sizes unless warm_start.path is set",
    "retromae.encoder.pretrained_path": "warm_start.path's encoder is what every stage starts from",
    "tokenize.tokenizer": "a WordPiece is trained on the corpus unless warm_start.path is set, whose own tokenizer is then used",
    "tokenize.pretrained_path": "warm_start.path's own tokenizer is used",
    "finetune.retrieval_pretrained_path": "fine-tuning starts from the pipeline's encoders, `init` being warm_start.path's "
                                          "unchanged; evaluate's warm-start:* row is it off the shelf",
}


def removed_key_message(key: str) -> str | None:
    """What to tell a user whose params still set `key` (dotted), or None when it was never removed."""
    why = REMOVED_KEYS.get(key)
    return None if why is None else (
        f"removed; use warm_start.path instead and delete this key ({why}). warm_start.path takes a local HF "
        "folder, a hub name or package:<python_package>/<subfolder>")


class ParamsError(ValueError):
    """A params file is malformed. The message names the file and the dotted key."""


@lru_cache(maxsize=1)
def default_params() -> dict:
    """The repo's params.yaml, its trainer blocks filled from the `trainer` group (`inherit_trainer`)."""
    return inherit_trainer(read_yaml(DEFAULT_FILE))


def _block(raw: dict, dotted: str) -> dict | None:
    node: Any = raw
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def inherit_trainer(raw: dict) -> dict:
    """`raw` with every trainer block of `TRAIN_BLOCKS` filled from the `trainer` group: the block's own
    keys win (a per-stage override), the group gives the rest. The group itself stays, for validation."""
    shared = raw.get(TRAINER)
    if not isinstance(shared, dict):
        return raw  # absent or malformed: validation names `trainer`
    out = copy.deepcopy(raw)
    for dotted in TRAIN_BLOCKS:
        block = _block(out, dotted)
        if block is not None:  # absent or malformed: validation names it
            for key, value in shared.items():
                block.setdefault(key, copy.deepcopy(value))
    return out


def inherited_keys(raw: dict) -> dict[str, str]:
    """{`<block>.<key>`: `trainer.<key>`} for each key a trainer block takes from the group (not set in it)."""
    shared = raw.get(TRAINER)
    if not isinstance(shared, dict):
        return {}
    return {f"{dotted}.{key}": f"{TRAINER}.{key}" for dotted in TRAIN_BLOCKS if (block := _block(raw, dotted)) is not None
            for key in shared if key not in block}


def read_yaml(path: Path) -> dict:
    if not path.exists():
        raise ParamsError(f"{path}: params file not found (run from the repo root, or pass its path)")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from None
    except UnicodeDecodeError as e:
        raise ParamsError(f"{path}: not UTF-8 text (byte {e.start}); save the file as UTF-8") from None
    except (ValueError, RecursionError) as e:  # a scalar YAML cannot build: 2001-02-30, an int over 4300 digits
        raise ParamsError(f"{path}: a value cannot be read ({type(e).__name__}: {str(e)[:120]}); quote it if it is a string") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: top level must be a mapping of sections, got {type(raw).__name__}")
    return raw


# PyYAML reads YAML 1.1, where a float needs a dot: "5e-5" alone is the string '5e-5'. dvc exp run -S
# (Hydra's grammar) reads it as a number, and so does every `key=value` override of ours.
_EXPONENT_FLOAT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+")


def override_value(text: str) -> Any:
    """The value of a command-line `key=value` override: YAML, with 5e-5 a float as in `dvc exp run -S`."""
    value = yaml.safe_load(text)
    return float(value) if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value) else value


def parse_overrides(items: list[str]) -> dict:
    """`--set key=value` items as {dotted key: value}. DVC's `+key=value` / `++key=value` (a key params.yaml
    does not hold yet) are taken too: apply_param_overrides adds the `+` itself where it is needed."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        out[key.lstrip("+")] = override_value(value)
    return out
