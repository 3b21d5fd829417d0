"""Launch a training stage body in this process, or under torchrun (one process per GPU).

Only the training flows import this, so the data stages' code dependencies stay free of
`training/distributed.py`.
"""

from __future__ import annotations

import json
import os

from components.config import Params
from components.paths import stage_metrics
from components.tracking import ENV_RUN
from components.training.distributed import run_streaming, torchrun_command


def run_training(stage: str, module: str, params: Params, run, body) -> dict:
    """Run a training stage body in this process, or under torchrun when compute.nproc > 1.

    Under torchrun, no Prefect flow runs inside the ranks: the ranks are plain processes, rank 0
    resumes this stage's MLflow run through MLFLOW_RUN_ID, and their output streams into the
    Prefect log line by line.
    """
    if params.compute.nproc == 1:
        return body(params, run)
    try:
        from prefect import get_run_logger

        emit = get_run_logger().info
    except Exception:  # noqa: BLE001 - outside a flow run
        emit = print
    cmd = torchrun_command(module, [], params.compute.nproc)
    env = {ENV_RUN: run.run_id, "MLFLOW_TRACKING_URI": run.uri, "RR_PARAMS": os.environ.get("RR_PARAMS", "params.yaml")}
    emit("$ " + " ".join(cmd))
    rc = run_streaming(cmd, env=env, log=emit)
    if rc != 0:
        raise RuntimeError(f"{stage}: torchrun exited with {rc}; the last checkpoint is kept, rerun to resume")
    return json.loads(stage_metrics(stage).read_text())
