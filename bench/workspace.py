"""A scratch workspace for a bench or study run: a fresh clone of this checkout's HEAD, so the
checkout is never touched and every run is committed code, with the checkout's .venv linked in."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fresh_clone(dest: Path) -> Path:
    """Replace `dest` with a clone of HEAD whose `.venv` is the checkout's; returns `dest`."""
    subprocess.run(["rm", "-rf", str(dest)], check=True)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True)
    os.symlink(ROOT / ".venv", dest / ".venv")  # the corpora ship in the clone (corpora/)
    return dest
