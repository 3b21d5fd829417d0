"""params.yaml as a file: its name, reading one (a malformed file is a `ParamsError` naming it), and
the repo's own copy, whose values fill the keys a section built in code is not given
(`components.config_shared.Section`).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

PARAMS_FILE = "params.yaml"
DEFAULT_FILE = Path(__file__).resolve().parents[1] / PARAMS_FILE  # the repo's params.yaml: the default's values


class ParamsError(ValueError):
    """A params file is malformed. The message names the file and the dotted key."""


@lru_cache(maxsize=1)
def default_params() -> dict:
    return read_yaml(DEFAULT_FILE)


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
