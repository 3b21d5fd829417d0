"""Stage `pretrain_mlm`: the plain whole-word-MLM baseline, same encoder, data and steps as RetroMAE.

    python -m flows.pretrain_mlm            # what `dvc repro pretrain_mlm` runs
Switch it off with `mlm.enabled: false` (the stage then only writes a marker; evaluate skips the row).
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.io import write_text_atomic
from components.paths import MLM_ENCODER, MLM_OUT, TOKENS, loss_curve, stage_metrics
from components.stages.common import write_stage_metrics
from components.stages.pretrain_retromae import train_encoder
from flows._runtime import params_from_env
from flows._torchrun import run_training
from flows import run_main
from flows._model_card import model_card
from flows._stage import Artifact, Dataset, Model, run_stage

STAGE = "pretrain_mlm"


@task(cache_policy=NO_CACHE, name="train-mlm")
def train(params, run) -> dict:
    return run_training(STAGE, "components.stages.pretrain_mlm", params, run, lambda p, r: train_encoder(STAGE, p, r))


@flow(name=STAGE, log_prints=True)
def pretrain_mlm_flow() -> dict:
    params = params_from_env()
    if not params.mlm.enabled:
        write_text_atomic(MLM_OUT / "DISABLED", "mlm.enabled is false: no MLM baseline was trained\n")
        write_stage_metrics(stage_metrics(STAGE), {"enabled": False})
        write_text_atomic(loss_curve(STAGE), "step,loss\n")  # a declared out: no rows, no curve drawn
        print(f"{STAGE}: disabled (mlm.enabled: false)")
        return {"enabled": False}
    return run_stage(STAGE, ["retromae", "mlm", "warm_start"], train, params=params, inputs=[Dataset(TOKENS / "pretrain", "pretrain_blocks")],
                     artifacts=[Artifact(MLM_OUT / "encoder", "encoder"), Artifact(stage_metrics(STAGE))],
                     models=[Model(MLM_ENCODER, "mlm-encoder", task="fill-mask", card=model_card)])


if __name__ == "__main__":
    run_main(pretrain_mlm_flow, heartbeat=False)
