"""Stage `finetune_reader@<system>`: one open-QA reader over one retrieval system's top k.

    python -m flows.finetune_reader --item realm-stale   # what `dvc repro finetune_reader@realm-stale` runs
"""

from __future__ import annotations

import argparse
import os

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.paths import CORPUS, reader_out, stage_metrics
from components.stages.common import ENV_STAGE_ITEM
from components.stages.finetune_reader import GROUP, finetune_reader
from flows import run_main
from flows._stage import Artifact, Dataset, Model, run_stage
from flows._torchrun import run_training


@task(cache_policy=NO_CACHE, name="finetune-reader")
def train(params, run) -> dict:
    return run_training(run.stage, "components.stages.finetune_reader", params, run, finetune_reader)


@flow(name=GROUP, log_prints=True)
def finetune_reader_flow(item: str) -> dict:
    os.environ[ENV_STAGE_ITEM] = item  # the body (and torchrun's ranks) read it
    stage, out = f"{GROUP}@{item}", reader_out(item)

    def models(params) -> list[Model]:
        """qa-<system>-reader: a pyfunc, question + context(s) -> answer span (flows/_reader_model.py)."""
        return [Model(out / "reader", f"qa-{item}-reader", "python_function")] if (out / "reader").is_dir() else []

    return run_stage(stage, ["finetune"], train, inputs=[Dataset(CORPUS / "qa", "train_questions", optional=True)],
                     artifacts=[Artifact(out, "open_qa", optional=True), Artifact(stage_metrics(stage))], models=models)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--item", required=True, help="the open-QA system: bm25, realm or realm-stale")
    finetune_reader_flow(ap.parse_args(argv).item)


if __name__ == "__main__":
    run_main(main, heartbeat=False)
