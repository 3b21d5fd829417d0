"""Stage `pretrain_retromae`: RetroMAE pre-training of the retrieval encoder.

    python -m flows.pretrain_retromae       # what `dvc repro pretrain_retromae` runs
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.paths import INIT_ENCODER, RETROMAE_ENCODER, RETROMAE_OUT, TOKENS, stage_metrics
from components.stages.pretrain_retromae import train_encoder
from flows._torchrun import run_training
from flows import run_main
from flows._model_card import model_card
from flows._stage import Artifact, Dataset, Model, run_stage

STAGE = "pretrain_retromae"


@task(cache_policy=NO_CACHE, name="train-retromae")
def train(params, run) -> dict:
    return run_training(STAGE, "components.stages.pretrain_retromae", params, run,
                        lambda p, r: train_encoder(STAGE, p, r))


@flow(name=STAGE, log_prints=True)
def pretrain_retromae_flow() -> dict:
    return run_stage(STAGE, ["retromae", "warm_start"], train, inputs=[Dataset(TOKENS / "pretrain", "pretrain_blocks")],
                     artifacts=[Artifact(RETROMAE_OUT / "encoder", "encoder"),  # HF format (safetensors)
                                Artifact(RETROMAE_OUT / "model_card.md"), Artifact(stage_metrics(STAGE))],
                     models=[Model(RETROMAE_ENCODER, "retromae-encoder", task="fill-mask", card=model_card),
                             Model(INIT_ENCODER, "init-encoder", task="fill-mask", card=model_card)])


if __name__ == "__main__":
    run_main(pretrain_retromae_flow, heartbeat=False)
