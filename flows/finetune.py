"""Stage `finetune`: a DPR bi-encoder from each starting encoder, and one open-QA reader per retrieval system.

    python -m flows.finetune                # what `dvc repro finetune` runs
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.paths import CORPUS, FINETUNE_OUT, stage_metrics
from components.stages.finetune import finetune
from flows._torchrun import run_training
from flows._stage import Artifact, Dataset, run_stage

STAGE = "finetune"


@task(cache_policy=NO_CACHE, name="finetune-retrievers-and-readers")
def train(params, run) -> dict:
    return run_training(STAGE, "components.stages.finetune", params, run, finetune)


@flow(name=STAGE, log_prints=True)
def finetune_flow() -> dict:
    return run_stage(STAGE, ["finetune"], train, inputs=[Dataset(CORPUS / "beir", "train_questions")],
                     artifacts=[*(Artifact(FINETUNE_OUT / sub, sub, optional=True) for sub in ("retriever", "open_qa")),
                                Artifact(stage_metrics(STAGE))])


if __name__ == "__main__":
    finetune_flow()
