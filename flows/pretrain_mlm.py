"""Stage `pretrain_mlm`: the plain whole-word-MLM baseline, same encoder, data and steps as RetroMAE.

    python -m flows.pretrain_mlm            # what `dvc repro pretrain_mlm` runs
Switch it off with `mlm.enabled: false` (the stage then only writes a marker; evaluate skips the row).
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.io import write_text_atomic
from components.stages.common import write_stage_metrics
from components.stages.pretrain_retromae import train_encoder
from components.tracking import StageRun
from flows._runtime import METRICS, MLM_OUT, TOKENS, params_from_env, prefect_tags, run_training

STAGE = "pretrain_mlm"


@task(cache_policy=NO_CACHE, name="train-mlm")
def train(params, run) -> dict:
    return run_training(STAGE, "components.stages.pretrain_mlm", params, run, lambda p, r: train_encoder(STAGE, p, r))


@flow(name=STAGE, log_prints=True)
def pretrain_mlm_flow() -> dict:
    params = params_from_env()
    if not params.mlm.enabled:
        write_text_atomic(MLM_OUT / "DISABLED", "mlm.enabled is false: no MLM baseline was trained\n")
        write_stage_metrics(METRICS / f"{STAGE}.json", {"enabled": False})
        print(f"{STAGE}: disabled (mlm.enabled: false)")
        return {"enabled": False}
    with StageRun(STAGE, params, ["retromae", "mlm"], extra_tags=prefect_tags()) as run:
        run.log_dataset(TOKENS / "pretrain", name="pretrain_blocks")
        summary = train(params, run)
        run.log_metrics_now({k: v for k, v in summary.items() if isinstance(v, (int, float))})
        run.log_artifact(MLM_OUT / "encoder", artifact_path="encoder")
        run.log_artifact(METRICS / f"{STAGE}.json")
        print(f"{STAGE}: {summary}")
        return summary


if __name__ == "__main__":
    pretrain_mlm_flow()
