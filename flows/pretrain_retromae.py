"""Stage `pretrain_retromae`: RetroMAE pre-training of the retrieval encoder.

    python -m flows.pretrain_retromae       # what `dvc repro pretrain_retromae` runs
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.stages.pretrain_retromae import train_encoder
from components.tracking import StageRun
from flows._runtime import METRICS, RETROMAE_OUT, TOKENS, params_from_env, prefect_tags, run_training

STAGE = "pretrain_retromae"


@task(cache_policy=NO_CACHE, name="train-retromae")
def train(params, run) -> dict:
    return run_training(STAGE, "components.stages.pretrain_retromae", params, run,
                        lambda p, r: train_encoder(STAGE, p, r))


@flow(name=STAGE, log_prints=True)
def pretrain_retromae_flow() -> dict:
    params = params_from_env()
    with StageRun(STAGE, params, ["retromae"], extra_tags=prefect_tags()) as run:
        run.log_dataset(TOKENS / "pretrain", name="pretrain_blocks")
        summary = train(params, run)
        run.log_metrics_now({k: v for k, v in summary.items() if isinstance(v, (int, float))})
        run.log_artifact(RETROMAE_OUT / "encoder", artifact_path="encoder")  # HF format (safetensors)
        run.log_artifact(RETROMAE_OUT / "model_card.md")
        run.log_artifact(METRICS / f"{STAGE}.json")
        print(f"{STAGE}: {summary}")
        return summary


if __name__ == "__main__":
    pretrain_retromae_flow()
