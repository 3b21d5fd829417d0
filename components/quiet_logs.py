"""Third-party log lines a stage's log does not need, hidden without hiding a problem.

At every model load and save, transformers draws a per-tensor progress bar ("Loading weights", "Writing
model shards": instant for these models), and when a checkpoint's keys differ from the model's it
prints a LOAD REPORT table. The pipeline loads such checkpoints on purpose about twenty times a run: an
MLM checkpoint's `cls.*` head into a bare encoder, a sentence-transformers folder without its pooler
for MLflow's model log. Its own loaders raise on the keys that would matter (encoder weights missing
from a checkpoint: components/models/encoder.py, components/models/reader.py).

`quiet_third_party_logs()` turns those two bars off and drops a load report whose every row is
expected; any other report (a missing encoder weight, a size mismatch, a conversion) and every other
warning still print. Hub downloads keep their progress bars.
"""

from __future__ import annotations

import logging
import re

# transformers' weight-copy bars; a download's bar has another description and stays
QUIET_BARS = ("Loading weights", "Writing model shards")
# MISSING keys that a load may report without anything going wrong: the pooler, which [CLS] pooling
# never reads (load_encoder drops it; a sentence-transformers folder has none)
EXPECTED_MISSING = ("pooler.",)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ROW = re.compile(r"^\s*(\S+)\s*\|\s*([A-Z_]+)\s*\|", re.M)  # "key | STATUS |", the report's table rows


def expected_load_report(message: str) -> bool:
    """Whether a transformers LOAD REPORT lists only expected keys: UNEXPECTED ones (checkpoint weights
    the model does not use, e.g. an MLM head) and MISSING ones under EXPECTED_MISSING. A report in a
    format this does not parse (no rows found) counts as unexpected, so it prints."""
    rows = [(key, status) for key, status in _ROW.findall(_ANSI.sub("", message)) if key != "Key"]
    return bool(rows) and all(status == "UNEXPECTED" or (status == "MISSING" and key.startswith(EXPECTED_MISSING))
                              for key, status in rows)


class _DropExpectedLoadReports(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("LOAD REPORT" in message and expected_load_report(message))


def _quiet_bar(factory, args, kwargs):
    if kwargs.get("desc") in QUIET_BARS:
        kwargs = {**kwargs, "disable": True}
    return factory(*args, **kwargs)


def quiet_third_party_logs() -> None:
    """Install the filter on transformers' loader logger and the progress-bar hook; bm25s's DEBUG
    lines (one per index built) off. Idempotent; a transformers without the hook keeps its bars."""
    logger = logging.getLogger("transformers.modeling_utils")
    if not any(isinstance(f, _DropExpectedLoadReports) for f in logger.filters):
        logger.addFilter(_DropExpectedLoadReports())
    try:
        from transformers.utils.logging import set_tqdm_hook
    except ImportError:
        pass
    else:
        set_tqdm_hook(_quiet_bar)
    bm25s = logging.getLogger("bm25s")
    if bm25s.level == logging.NOTSET:
        bm25s.setLevel(logging.INFO)


__all__ = ["EXPECTED_MISSING", "QUIET_BARS", "expected_load_report", "quiet_third_party_logs"]
