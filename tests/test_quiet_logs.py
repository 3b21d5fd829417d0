"""components/quiet_logs.py against real transformers loads: an expected load report (an MLM
checkpoint's head, unused by a bare encoder) is dropped, one that names a missing encoder weight
prints; the weight-copy bars are off and other bars are not."""

from __future__ import annotations

import logging

import pytest
from safetensors.torch import load_file, save_file

from components.models.realm import tiny_bert_config
from components.quiet_logs import _DropExpectedLoadReports, expected_load_report, quiet_third_party_logs

LOADER_LOGGER = "transformers.modeling_utils"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def loader_log():
    """What transformers' loader logger passes on to its handlers (its library root does not
    propagate to pytest's): the filter runs on the logger, before any handler."""
    logger = logging.getLogger(LOADER_LOGGER)
    records, filters = _Records(), list(logger.filters)
    # a stage module imported earlier in this process installed it
    logger.filters[:] = [f for f in filters if not isinstance(f, _DropExpectedLoadReports)]
    logger.addHandler(records)
    yield records
    logger.removeHandler(records)
    logger.filters[:] = filters


def _reports(records: _Records) -> list[str]:
    return [m for m in records.messages if "LOAD REPORT" in m]


@pytest.fixture
def mlm_folder(tmp_path):
    from transformers import BertForMaskedLM

    BertForMaskedLM(tiny_bert_config()).save_pretrained(tmp_path / "mlm")
    return tmp_path / "mlm"


def test_an_mlm_heads_load_report_is_dropped_and_only_with_the_filter(loader_log, mlm_folder):
    from transformers import AutoModel

    AutoModel.from_pretrained(mlm_folder, add_pooling_layer=False)
    (report,) = _reports(loader_log)  # without the filter transformers prints it: the test can fail
    assert "UNEXPECTED" in report and expected_load_report(report)

    quiet_third_party_logs()
    quiet_third_party_logs()  # idempotent: one filter
    assert sum(isinstance(f, _DropExpectedLoadReports) for f in logging.getLogger(LOADER_LOGGER).filters) == 1
    AutoModel.from_pretrained(mlm_folder, add_pooling_layer=False)
    assert len(_reports(loader_log)) == 1


def test_a_missing_encoder_weight_still_prints(loader_log, mlm_folder):
    from transformers import AutoModelForMaskedLM

    weights = mlm_folder / "model.safetensors"
    tensors = load_file(weights)
    gone = next(k for k in tensors if "encoder.layer.0.attention.self.query.weight" in k)
    del tensors[gone]
    save_file(tensors, weights, metadata={"format": "pt"})
    quiet_third_party_logs()
    AutoModelForMaskedLM.from_pretrained(mlm_folder)
    (report,) = _reports(loader_log)
    assert "MISSING" in report and "attention.self.query.weight" in report and not expected_load_report(report)


@pytest.mark.parametrize("table, expected", [
    ("Key | Status |\n---+---+\ncls.predictions.bias | UNEXPECTED |\n", True),
    ("Key | Status |\n---+---+\npooler.dense.weight | MISSING |\npooler.dense.bias | MISSING |\n", True),
    ("Key | Status |\n---+---+\ncls.predictions.bias | UNEXPECTED |\nembeddings.word_embeddings.weight | MISSING |\n", False),
    ("Key | Status |\n---+---+\nclassifier.weight | MISMATCH |\n", False),
    ("a report in a format this does not parse", False),
])
def test_expected_load_report_reads_each_row(table, expected):
    assert expected_load_report("\x1b[1mBertModel LOAD REPORT\x1b[0m from: x\n" + table) is expected


def test_the_weight_copy_bars_are_off_and_other_bars_stay():
    """The hook quiet_third_party_logs gives transformers' tqdm: it disables the two weight-copy bars
    and passes any other bar (a hub download's) through unchanged, to whichever factory transformers
    picked (tqdm, or its empty shim when progress bars are off)."""
    from transformers.utils.logging import set_tqdm_hook

    previous = set_tqdm_hook(None)
    try:
        quiet_third_party_logs()
        hook = set_tqdm_hook(previous)
    finally:
        set_tqdm_hook(previous)
    made = lambda *args, **kwargs: kwargs  # noqa: E731 - a factory that shows what it was given
    for desc in ("Loading weights", "Writing model shards"):
        assert hook(made, (range(2),), {"desc": desc}) == {"desc": desc, "disable": True}
    assert hook(made, (range(2),), {"desc": "model.safetensors"}) == {"desc": "model.safetensors"}


def test_the_bar_hook_waits_for_transformers_to_be_imported():
    """In a process that has not imported transformers, quieting it imports nothing; the hook is
    installed when transformers' logging module is first imported."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    code = textwrap.dedent("""
        import sys
        from components.quiet_logs import quiet_third_party_logs
        quiet_third_party_logs()
        quiet_third_party_logs()
        print("transformers" in sys.modules)
        from transformers.utils import logging
        print(logging._tqdm_hook.__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "_quiet_bar"]


def test_a_loader_may_expect_what_it_builds(loader_log, tmp_path):
    """load_mlm_encoder on a bare encoder (MiniLM's shape: no MLM head) builds the head and warns
    itself; HF's report of the missing head is dropped then, and prints outside `expect_missing`."""
    from transformers import AutoModelForMaskedLM, BertModel

    from components.models.encoder import load_mlm_encoder
    from components.quiet_logs import expect_missing

    BertModel(tiny_bert_config()).save_pretrained(tmp_path / "bare")
    quiet_third_party_logs()
    load_mlm_encoder(tmp_path / "bare")
    assert _reports(loader_log) == []
    AutoModelForMaskedLM.from_pretrained(tmp_path / "bare")
    (report,) = _reports(loader_log)
    assert "cls.predictions" in report
    with expect_missing("cls."):
        assert expected_load_report(report)
    assert not expected_load_report(report)


def test_a_reader_from_an_encoder_folder_logs_no_report(loader_log, mlm_folder):
    """SpanReader from REALM's knowledge-augmented encoder (an MLM folder): the unused MLM head and
    the fresh span head are both expected."""
    from components.models.reader import SpanReader

    quiet_third_party_logs()
    SpanReader.from_pretrained(mlm_folder)
    assert _reports(loader_log) == []
