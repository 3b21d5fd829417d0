"""Live progress without a TTY: every training loop logs `step, loss, tokens/s, ETA` every
`tracking.progress_every` steps through standard logging, and a stage flow forwards those lines
to its Prefect flow-run log (checked against a real local Prefect API)."""

from __future__ import annotations

import logging
import re
import types

import pytest
import torch

from components import progress
from components.progress import ProgressClock, count_line, format_duration, progress_line
from components.training.trainer import Trainer
from tests.conftest import tiny_params
from tests.scripts.tiny_train import TinyLM, fixed_mask_collate, make_rows

P = tiny_params()
LINE = re.compile(r"^test\.train step (\d+)/(\d+) \(\d+%\) loss \d+\.\d{4} tokens/s \d+ eta \d+(s|m\d\ds)$")


def _trainer(tmp_path, max_steps: int, progress_every: int | None, label: str | None = None) -> Trainer:
    torch.manual_seed(0)
    train = P.retromae.train.model_copy(update=dict(batch_size=8, lr=3e-3, max_steps=max_steps, grad_accum=1,
                                                    warmup_ratio=0.2, checkpoint_every=100, num_workers=0))
    return Trainer(TinyLM(dropout=0.0), make_rows(), fixed_mask_collate, train, P.compute, tmp_path, param_prefix="test.train",
                   progress=False, progress_every=progress_every, label=label)


def test_format_duration_and_line():
    assert [format_duration(s) for s in (0.4, 59, 61, 3599, 7620)] == ["0s", "59s", "1m01s", "59m59s", "2h07m"]
    assert progress_line("realm.train", 50, 200, {"loss": 3.21044, "tokens_per_s": 1234.4}, 80) == \
        "realm.train step 50/200 (25%) loss 3.2104 tokens/s 1234 eta 1m20s"
    assert progress_line("x", 1, 3, {}, 2) == "x step 1/3 (33%) loss n/a eta 2s"


def test_count_line():
    assert count_line("embed blocks", 12800, 650000, 15.24) == "embed blocks 12800/650000 (1%) blocks/s 840 eta 12m39s"
    assert count_line("open-qa", 5, None, 2.0, unit="questions") == "open-qa 5 questions/s 2"


def test_progress_clock_by_count_by_time_and_at_the_end(monkeypatch):
    """One line each time the count passes another `every` (a jump of several counts once), one
    at the loop's end once it has spoken, and one per call when the time limit is 0 s."""
    clock = ProgressClock(every=3, every_s=1e9)
    assert [d for d in (1, 2, 3, 4, 8, 9, 10) if clock.due(d, final=d == 10)] == [3, 8, 9, 10]
    quiet = ProgressClock(every=0, every_s=1e9)
    assert not [d for d in range(1, 6) if quiet.due(d, final=d == 5)]  # nothing said, nothing to close
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.0)  # read when a clock starts: what tests patch
    slow = ProgressClock(every=100)
    assert all(slow.due(d) for d in range(1, 4)) and slow.lines == 3
    slow.t0 -= 10.0  # 10 s for the first unit: 20 s for the two left
    assert slow.eta(1, 3) == pytest.approx(20.0, abs=0.5)
    with pytest.raises(ValueError, match="every must be >= 0"):
        ProgressClock(every=-1)


def test_every_n_steps_plus_first_and_last_without_a_tty(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="components.training.trainer")
    _trainer(tmp_path, max_steps=7, progress_every=3).fit()
    lines = [r.getMessage() for r in caplog.records if hasattr(r, "rr_progress")]
    assert [int(LINE.match(m).group(1)) for m in lines] == [1, 3, 6, 7], lines
    info = [r.rr_progress for r in caplog.records if hasattr(r, "rr_progress")]
    assert info[-1]["step"] == info[-1]["max_steps"] == 7 and info[-1]["eta_s"] == 0


def test_a_loop_that_borrows_params_names_itself_and_errors_name_the_params(tmp_path, caplog):
    """The MLM baseline trains with retromae.train: its progress lines say which loop runs, while
    the params it reads keep their own path (bad-step and OOM messages, the checkpoint's record)."""
    caplog.set_level(logging.INFO, logger="components.training.trainer")
    t = _trainer(tmp_path, max_steps=2, progress_every=1, label="mlm (test.train)")
    t.fit()
    lines = [r.getMessage() for r in caplog.records if hasattr(r, "rr_progress")]
    assert lines and all(m.startswith("mlm (test.train) step ") for m in lines), lines
    assert t.prefix == "test.train"


def test_slow_steps_log_by_time_whatever_the_step_cadence(tmp_path, caplog, monkeypatch):
    """A loop whose steps are slower than PROGRESS_EVERY_S logs every step, though `progress_every`
    would wait for step 1000: no training loop stays silent for more than that long."""
    from components.training import trainer as T

    monkeypatch.setattr(T, "PROGRESS_EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="components.training.trainer")
    _trainer(tmp_path, max_steps=5, progress_every=1000).fit()
    assert [r.rr_progress["step"] for r in caplog.records if hasattr(r, "rr_progress")] == [1, 2, 3, 4, 5]


def test_progress_every_zero_is_silent_and_none_is_about_ten_lines(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="components.training.trainer")
    _trainer(tmp_path / "a", max_steps=4, progress_every=0).fit()
    assert not [r for r in caplog.records if hasattr(r, "rr_progress")]
    _trainer(tmp_path / "b", max_steps=20, progress_every=None).fit()
    steps = [r.rr_progress["step"] for r in caplog.records if hasattr(r, "rr_progress")]
    assert steps == [1, *range(2, 21, 2)]


def test_realm_probe_logs_progress_lines(caplog, monkeypatch):
    """evaluate_mlm (the REALM stage's held-out probe) logs the trainer's progress line every
    `progress_every` batches, and by time when it is slow (here: every batch)."""
    from components.eval import realm_probes

    class Stub(torch.nn.Module):  # REALM's output contract, no model behind it
        retriever = None

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, batch):
            return {"num_masked": torch.tensor(4.0), "num_tokens": torch.tensor(40.0), "mlm_acc": torch.tensor(0.5), "loss": torch.tensor(2.0)}

    class Collator:
        def batch(self, queries, search, retriever):
            return {}

    caplog.set_level(logging.INFO, logger="components.eval.realm_probes")
    queries, index = list(range(10)), types.SimpleNamespace(search=None)  # 5 batches of 2
    out = realm_probes.evaluate_mlm(Stub(), Collator(), queries, index, batch_size=2, progress_every=2)
    assert out == {"mlm_acc": 0.5, "loss": 2.0, "tokens": 20.0}
    lines = [r.getMessage() for r in caplog.records if r.name == "components.eval.realm_probes"]
    assert [int(re.search(r"step (\d+)/5 ", m).group(1)) for m in lines] == [2, 4, 5], lines
    assert all(re.fullmatch(r"realm\.probe\.mlm step \d/5 \(\d+%\) loss 2\.0000 tokens/s \d+ eta \d+s", m) for m in lines), lines
    caplog.clear()
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.0)  # a slow probe: a line each batch, whatever the count
    realm_probes.evaluate_mlm(Stub(), Collator(), queries, index, batch_size=2)
    assert len([r for r in caplog.records if r.name == "components.eval.realm_probes"]) == 5


def test_tracking_progress_every_is_a_param(params):
    assert params.tracking.progress_every == 50  # params.yaml
    from components.config_shared import TrackingParams

    with pytest.raises(Exception):
        TrackingParams.model_validate({**params.tracking.model_dump(), "progress_every": -1})


@pytest.mark.servers
def test_progress_lines_reach_the_prefect_flow_run_log(shared_prefect_api, tmp_path):
    """A flow (as a stage flow: flows._runtime imported) trains; its flow-run log on the API holds
    the progress lines, and its progress artifact ends at 100%."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId
    from prefect.runtime import flow_run

    from flows._stage import training_progress

    @flow(name="progress-probe", persist_result=False)
    def train_flow() -> str:
        with training_progress("progress-probe"):
            _trainer(tmp_path, max_steps=5, progress_every=2).fit()
        return str(flow_run.get_id())

    run_id = train_flow()

    async def fetch():
        import asyncio

        async with get_client() as client:
            for _ in range(40):  # the API log handler sends in the background
                logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
                if sum("test.train step" in entry.message for entry in logs) >= 4:
                    break
                await asyncio.sleep(0.5)
            arts = await client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
            return logs, arts

    import asyncio

    logs, arts = asyncio.run(fetch())
    lines = [entry.message for entry in logs if "test.train step" in entry.message]
    assert [int(re.search(r"step (\d+)/", m).group(1)) for m in lines] == [1, 2, 4, 5], lines
    progress = [a for a in arts if a.type == "progress"]
    assert progress and float(progress[0].data) == 100.0, [(a.type, a.data) for a in arts]
