"""Launch a training stage body in this process, or under torchrun (one process per GPU, on one
node or `compute.nnodes`).

Only the training flows import this, so the data stages' code dependencies stay free of
`training/distributed.py`.

On several nodes the flow runs on node 0 and launches its torchrun; every other node runs the
same torchrun without a flow (no Prefect, no MLflow run: only global rank 0 logs):

    RR_STAGE_MODULE=components.stages.pretrain_realm RR_RDZV_ENDPOINT=node0:29400 RR_RDZV_ID=<id> \
        python -m flows._torchrun --join

(infra/prefect/k8s-gpu-multinode-job-template.yaml runs that on pods 1..N-1 of an indexed Job.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from components.config import Params
from components.paths import stage_metrics
from components.tracking import ENV_RUN
from components.training.distributed import launch_command, run_streaming

ENV_STAGE_MODULE = "RR_STAGE_MODULE"  # the stage body a joining node launches


def run_training(stage: str, module: str, params: Params, run, body) -> dict:
    """Run a training stage body in this process, or under torchrun when compute.nproc > 1 or
    compute.nnodes > 1 (this node's launcher; the others `--join` the same rendezvous).

    Under torchrun, no Prefect flow runs inside the ranks: the ranks are plain processes, rank 0
    resumes this stage's MLflow run through MLFLOW_RUN_ID, and their output streams into the
    Prefect log line by line.
    """
    if params.compute.nproc == 1 and params.compute.nnodes == 1:
        return body(params, run)
    try:
        from prefect import get_run_logger

        emit = get_run_logger().info
    except Exception:  # noqa: BLE001 - outside a flow run
        emit = print
    cmd = launch_command(params.compute, module, run_id=run.run_id)
    env = {ENV_RUN: run.run_id, "MLFLOW_TRACKING_URI": run.uri, "RR_PARAMS": os.environ.get("RR_PARAMS", "params.yaml")}
    emit("$ " + " ".join(cmd))
    rc = run_streaming(cmd, env=env, log=emit)
    if rc != 0:
        raise RuntimeError(f"{stage}: torchrun exited with {rc}; the last checkpoint is kept, rerun to resume")
    return json.loads(stage_metrics(stage).read_text())


def join(argv: list[str] | None = None) -> int:
    """A node other than the flow's: launch $RR_STAGE_MODULE's torchrun into the same rendezvous
    (params from $RR_PARAMS, default params.yaml) and return its exit code."""
    from components.config import load_params

    ap = argparse.ArgumentParser(description=join.__doc__)
    ap.add_argument("--join", action="store_true", required=True)
    ap.add_argument("--module", default=os.environ.get(ENV_STAGE_MODULE))
    a = ap.parse_args(argv)
    if not a.module:
        ap.error(f"--module or ${ENV_STAGE_MODULE} names the stage body (e.g. components.stages.pretrain_realm)")
    params_path = os.environ.get("RR_PARAMS", "params.yaml")
    params = load_params(params_path)
    if params.compute.nnodes < 2:
        ap.error(f"compute.nnodes={params.compute.nnodes}: nothing to join on one node")
    pods = os.environ.get("RR_NNODES")  # the job's pod count (the k8s template); it must match params
    if pods and int(pods) != params.compute.nnodes:
        ap.error(f"the job has {pods} nodes but compute.nnodes={params.compute.nnodes}")
    cmd = launch_command(params.compute, a.module)
    print("$ " + " ".join(cmd), flush=True)
    return run_streaming(cmd, env={"RR_PARAMS": params_path}, log=print)


if __name__ == "__main__":
    sys.exit(join())
