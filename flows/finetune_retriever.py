"""Stage `finetune_retriever@<start>-<size>`: a DPR bi-encoder from one start on `size` training questions.

    python -m flows.finetune_retriever --item retromae-32   # what `dvc repro finetune_retriever@retromae-32` runs
"""

from __future__ import annotations

import argparse
import os

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.paths import CORPUS, retriever_item, retriever_out, stage_metrics
from components.stages.common import ENV_STAGE_ITEM
from components.stages.finetune_retriever import GROUP, finetune_retriever
from flows import run_main
from flows._stage import Artifact, Dataset, Model, register, run_stage
from flows._torchrun import run_training


@task(cache_policy=NO_CACHE, name="finetune-retriever")
def train(params, run) -> dict:
    return run_training(run.stage, "components.stages.finetune_retriever", params, run, finetune_retriever)


@flow(name=GROUP, log_prints=True)
def finetune_retriever_flow(item: str) -> dict:
    os.environ[ENV_STAGE_ITEM] = item  # the body (and torchrun's ranks) read it
    start, size = retriever_item(item)
    stage, out = f"{GROUP}@{item}", retriever_out(start, size)

    def models(params) -> list[Model]:
        """ft-<start>-retriever (sentence-transformers): the largest size only, the table's ft:<start> row."""
        wanted = size == params.finetune.largest_size() and (out / "config.json").exists()
        return [Model(out, f"ft-{start}-retriever", "sentence_transformers")] if wanted else []

    def on_models(run, ids: dict[str, str]) -> None:
        """tracking.registry_start's retriever -> tracking.registry_name@registry_alias."""
        if start == run.params.tracking.registry_start and ids:
            register(run, next(iter(ids.values())))

    return run_stage(stage, ["finetune"], train, inputs=[Dataset(CORPUS / "beir", "train_questions")],
                     artifacts=[Artifact(stage_metrics(stage))], models=models, on_models=on_models)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--item", required=True, help="<start>-<size>, e.g. retromae-32 or init-all")
    finetune_retriever_flow(ap.parse_args(argv).item)


if __name__ == "__main__":
    run_main(main, heartbeat=False)
