"""Third-party log lines a stage's log does not need, hidden without hiding a problem.

At every model load and save, transformers draws a per-tensor progress bar ("Loading weights", "Writing
model shards": instant for these models), and when a checkpoint's keys differ from the model's it
prints a LOAD REPORT table. The pipeline loads such checkpoints on purpose about twenty times a run: an
MLM checkpoint's `cls.*` head into a bare encoder, a sentence-transformers folder without its pooler
for MLflow's model log. Its own loaders raise on the keys that would matter (encoder weights missing
from a checkpoint: components/models/encoder.py, components/models/reader.py).

`quiet_third_party_logs()` turns those two bars off and drops a load report whose every row is
expected (`expect_missing` adds what a loader builds itself). Any other report (a missing encoder
weight, a size mismatch, a conversion) and every other warning still print; hub downloads keep their
progress bars.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import logging
import re
import sys
from typing import Iterator

# transformers' weight-copy bars; a download's bar has another description and stays
QUIET_BARS = ("Loading weights", "Writing model shards")
# MISSING keys that a load may report without anything going wrong: the pooler, which [CLS] pooling
# never reads (load_encoder drops it; a sentence-transformers folder has none)
EXPECTED_MISSING = ("pooler.",)

TF_LOGGING = "transformers.utils.logging"  # where transformers' tqdm and its hook live
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ROW = re.compile(r"^\s*(\S+)\s*\|\s*([A-Z_]+)\s*\|", re.M)  # "key | STATUS |", the report's table rows

_missing_ok: list[str] = []  # prefixes `expect_missing` adds while a caller loads


@contextlib.contextmanager
def expect_missing(*prefixes: str) -> Iterator[None]:
    """Within: MISSING keys under `prefixes` count as expected too. For a loader that builds those weights
    itself and says so (a fresh span head, an MLM head built on a bare encoder)."""
    _missing_ok.extend(prefixes)
    try:
        yield
    finally:
        del _missing_ok[len(_missing_ok) - len(prefixes):]


def expected_load_report(message: str) -> bool:
    """Whether a transformers LOAD REPORT lists only expected keys: UNEXPECTED ones (checkpoint weights
    the model does not use, e.g. an MLM head) and MISSING ones under EXPECTED_MISSING (or `expect_missing`'s
    prefixes). A report in a format this does not parse (no rows found) counts as unexpected, so it prints."""
    missing_ok = EXPECTED_MISSING + tuple(_missing_ok)
    rows = [(key, status) for key, status in _ROW.findall(_ANSI.sub("", message)) if key != "Key"]
    return bool(rows) and all(status == "UNEXPECTED" or (status == "MISSING" and key.startswith(missing_ok))
                              for key, status in rows)


class _DropExpectedLoadReports(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("LOAD REPORT" in message and expected_load_report(message))


def _quiet_bar(factory, args, kwargs):
    if kwargs.get("desc") in QUIET_BARS:
        kwargs = {**kwargs, "disable": True}
    return factory(*args, **kwargs)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` right after the module `name` is first imported, so that a process that
    never loads transformers (a data stage) does not import it to quiet it (tests/test_stage_startup.py)."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once, and out of the way of the finders asked below
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            exec_module, then = spec.loader.exec_module, self.then

            def exec_then(module):
                exec_module(module)
                then(module)

            spec.loader.exec_module = exec_then  # this spec's own loader instance
        return spec


def _hook_bars(tf_logging) -> None:
    if hasattr(tf_logging, "set_tqdm_hook"):  # transformers >= 5; older ones keep their bars
        tf_logging.set_tqdm_hook(_quiet_bar)


def quiet_third_party_logs() -> None:
    """Install the filter on transformers' loader logger and the progress-bar hook (now if transformers
    is loaded, else when it is); bm25s's DEBUG lines (one per index built) off. Idempotent."""
    logger = logging.getLogger("transformers.modeling_utils")
    if not any(isinstance(f, _DropExpectedLoadReports) for f in logger.filters):
        logger.addFilter(_DropExpectedLoadReports())
    if TF_LOGGING in sys.modules:
        _hook_bars(sys.modules[TF_LOGGING])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(TF_LOGGING, _hook_bars))
    bm25s = logging.getLogger("bm25s")
    if bm25s.level == logging.NOTSET:
        bm25s.setLevel(logging.INFO)


__all__ = ["EXPECTED_MISSING", "QUIET_BARS", "expect_missing", "expected_load_report", "quiet_third_party_logs"]
