"""What every training stage body shares: checkpoint folders keyed by what they were trained on,
rank-0 MLflow logging (resumed through MLFLOW_RUN_ID under torchrun), and the torchrun entry."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from components.config import Params, load_params
from components.io import tree_digest, write_json_atomic
from components.paths import CHECKPOINTS, CORPUS, stage_metrics
from components.quiet_logs import quiet_third_party_logs
from components.training.memory import peak_rss_mb

log = logging.getLogger(__name__)

# the item of a foreach / matrix stage (`retromae-32` of `finetune_retriever@retromae-32`): its flow
# sets it, and torchrun's ranks inherit it
ENV_STAGE_ITEM = "RR_STAGE_ITEM"


def corpus_digest(corpus_dir: str | os.PathLike = CORPUS) -> str:
    card = Path(corpus_dir) / "data_card.json"
    return json.loads(card.read_text())["digest"] if card.exists() else "none"


CODE_ROOTS = ("components", "flows")  # the project's code, under the repo root (REPO_ROOT)
REPO_ROOT = Path(__file__).resolve().parents[2]


def code_digest(root: Path | None = None) -> str:
    """sha256 over every .py file of `components/` and `flows/` under `root` (default: this
    checkout), path and bytes, in sorted order."""
    root = REPO_ROOT if root is None else root
    tops = "\n".join(f"{top}\0{tree_digest(root / top, 'sha256', '*.py')[0]}" for top in CODE_ROOTS)
    return hashlib.sha256(tops.encode()).hexdigest()


def checkpoint_dir(stage: str, params: Params, sections: list[str], corpus_dir: str | os.PathLike = CORPUS,
                   inputs: list[str | os.PathLike] = ()) -> Path:
    """`checkpoints/<stage>/<digest>`: a resume only ever continues a run of the same code, params,
    data and start. A change to any of them starts a fresh folder, so a stage that DVC reruns
    because its code or an upstream model changed never resumes the stale run's final checkpoint.

    `sections`: the params sections the stage reads; `inputs`: the folders it starts from (an
    upstream stage's model, e.g. models/retromae/encoder), by content, so a change upstream that no
    section of this stage names (warm_start for REALM, code, ...) still counts. The code is all of
    `components/` and `flows/` (CODE_ROOTS): an edit anywhere invalidates an interrupted run, never a
    finished stage (DVC decides that). `compute.nproc` is left out on purpose: a run may resume on
    a different number of processes."""
    compute = params.compute.model_dump(mode="json")
    compute.pop("nproc", None)
    starts = [tree_digest(p)[0] if Path(p).exists() else None for p in inputs]  # by content, not by path
    blob = json.dumps({"params": params.section_digest(*sections, "data", "tokenize"), "compute": compute,
                       "corpus": corpus_digest(corpus_dir), "code": code_digest(), "inputs": starts}, sort_keys=True)
    return CHECKPOINTS / stage / hashlib.sha256(blob.encode()).hexdigest()[:12]


@contextmanager
def shared_phase(folder: Path, what: str, wait_log_s: float = 60.0) -> Iterator[Path]:
    """A training phase that several stages run identically (the same params, code, data and start,
    so `checkpoint_dir` gives them one folder): bm25's and realm's readers share the own-paragraph
    phase, REALM's two arms their warm-ups. Inside, one stage at a time trains into `folder`; a stage
    that comes later (or waited here while another trained) resumes the finished phase from its last
    checkpoint instead of training it again (`Trainer.fit` returns at once, weights, RNG, final
    metrics and loss curve restored).

    The lock is an flock on `folder/.lock`, held by rank 0 only, so the process group must exist
    before (`D.init_distributed`). The other ranks wait at a barrier, so under torchrun a wait longer
    than the process group's timeout (gloo 30 min, NCCL 10 min by default) fails the stage. flock
    needs a filesystem that honours it across the machines that share `checkpoints/` (local disk
    does; NFS mounted with `nolock` does not)."""
    import time

    from components.training import distributed as D

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not D.is_dist():
        raise RuntimeError(f"{what}: shared_phase under torchrun needs the process group first (D.init_distributed)")
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644) if D.is_rank0() else None
    try:
        if fd is not None:
            t0, last = time.monotonic(), None
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:  # polled, so a long wait keeps saying so
                    if last is None or time.monotonic() - last >= wait_log_s:
                        log.info("%s: another stage is training the same phase in %s; waiting (%.0f s so far), "
                                 "then resuming its result", what, folder, time.monotonic() - t0)
                        last = time.monotonic()
                    time.sleep(0.5)
        D.barrier()
        yield folder
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def write_loss_curve(path: str | os.PathLike, curve: list[tuple[int, float]]) -> Path:
    """`step,loss` per logged window (`TrainResult.curve`, which spans resumes): a pre-training
    stage's DVC out, drawn by `dvc plots show` and by evaluate's training-curve figure, so no DVC
    output depends on the MLflow store."""
    from components.io import write_text_atomic

    return write_text_atomic(path, "\n".join(["step,loss", *(f"{s},{v!r}" for s, v in curve)]) + "\n")


class RankZeroLogger:
    """`log_fn(metrics, step)` for the Trainer: logs only on rank 0, through a StageRun."""

    def __init__(self, run):
        self.run = run

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log_metrics(metrics, step)


class MetricRecorder(RankZeroLogger):
    """A RankZeroLogger that also keeps every logged window, for the summary (`tail_mean`)."""

    def __init__(self, run):
        super().__init__(run)
        self.windows: list[tuple[int, dict]] = []

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        self.windows.append((step, dict(metrics)))
        super().__call__(metrics, step)

    def tail_mean(self, key: str, max_steps: int, frac: float = 0.1) -> float | None:
        """Mean of `key` over the last `frac` of the steps: less noisy than the last window."""
        import numpy as np

        lo = max_steps - max(1, int(round(frac * max_steps)))
        vals = [m[key] for s, m in self.windows if s > lo and key in m]
        return float(np.mean(vals)) if vals else None


def write_stage_metrics(path: str | os.PathLike, metrics: dict) -> dict:
    """The small JSON that `dvc metrics show` reads (declared `cache: false` in dvc.yaml): `metrics`
    plus this process's `peak_rss_mb`, so a memory regression shows in `dvc metrics diff`. Returns
    what it wrote, the summary the stage then returns (and MLflow logs)."""
    out = {**metrics, "peak_rss_mb": round(peak_rss_mb(), 1)}
    write_json_atomic(path, {k: (round(v, 6) if isinstance(v, float) else v) for k, v in out.items()})
    return out


def skip_stage(stage: str, out: Path, reason: str) -> dict:
    """A stage with nothing to train (its start or inputs missing, switched off): a `SKIPPED` note
    as its output folder, so DVC finds the outs it declares, and the reason as its summary."""
    from components.io import write_text_atomic
    from components.training import distributed as D

    log.warning("%s: skipped: %s", stage, reason)
    if not D.is_rank0():
        return {"skipped": reason}
    write_text_atomic(out / "SKIPPED", reason + "\n")
    return write_stage_metrics(stage_metrics(stage), {"skipped": reason})


def finish_stage(stage: str, summary: dict, save: Callable[[], None]) -> dict:
    """Rank 0 saves the outputs (`save()`), then writes the stage summary; every rank waits for it."""
    from components.training import distributed as D

    if D.is_rank0():
        save()
        summary = write_stage_metrics(stage_metrics(stage), summary)
    D.barrier()
    return summary


def item_worker(group: str, body: Callable[[Params, object], dict]) -> None:
    """`torchrun_worker` for a foreach / matrix stage: its item from $RR_STAGE_ITEM."""
    torchrun_worker(f"{group}@{os.environ[ENV_STAGE_ITEM]}", body)


def torchrun_worker(stage: str, body: Callable[[Params, object], dict]) -> None:
    """Entry point inside each torchrun process: rank 0 resumes the stage's MLflow run.

    The `with` block flushes rank 0's buffered metrics and ends the run: FINISHED, or FAILED (KILLED
    on Ctrl-C) when the body raises. The flow that launched torchrun ends the run once more when
    torchrun returns, so the final status is the flow's.
    """
    from components.tracking import ENV_RUN, StageRun
    from components.training import distributed as D

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_third_party_logs()
    params = load_params(os.environ.get("RR_PARAMS", "params.yaml"))
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 and os.environ.get(ENV_RUN):
        with StageRun.resume(stage, params) as run:
            body(params, run)
    else:
        body(params, None)
    D.cleanup()
