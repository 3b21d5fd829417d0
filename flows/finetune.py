"""Stage `finetune`: a DPR bi-encoder from each starting encoder, and one open-QA reader per retrieval system.

    python -m flows.finetune                # what `dvc repro finetune` runs
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.paths import CORPUS, FINETUNE_OPEN_QA, FINETUNE_OUT, FINETUNE_RETRIEVERS, stage_metrics
from components.stages.finetune import finetune
from flows._torchrun import run_training
from flows._stage import Artifact, Dataset, Model, register, run_stage

STAGE = "finetune"


@task(cache_policy=NO_CACHE, name="finetune-retrievers-and-readers")
def train(params, run) -> dict:
    return run_training(STAGE, "components.stages.finetune", params, run, finetune)


def models(params) -> list[Model]:
    """ft-<start>-retriever (sentence-transformers) per start, qa-<system>-reader (a pyfunc: question
    + context(s) -> answer span, flows/_reader_model.py) per system."""
    ft = params.finetune
    return ([Model(FINETUNE_RETRIEVERS / name, f"ft-{name}-retriever", "sentence_transformers") for name in ft.retrieval_inits]
            + [Model(FINETUNE_OPEN_QA / system / "reader", f"qa-{system}-reader", "python_function")
               for system in ft.qa_systems])


def register_retriever(run, ids: dict[str, str]) -> None:
    """tracking.registry_start's retriever -> tracking.registry_name@registry_alias."""
    name = f"ft-{run.params.tracking.registry_start}-retriever"
    if name in ids:
        register(run, ids[name])


@flow(name=STAGE, log_prints=True)
def finetune_flow() -> dict:
    return run_stage(STAGE, ["finetune"], train, inputs=[Dataset(CORPUS / "beir", "train_questions")],
                     artifacts=[*(Artifact(FINETUNE_OUT / sub, sub, optional=True) for sub in ("retriever", "open_qa")),
                                Artifact(stage_metrics(STAGE))],
                     models=models, on_models=register_retriever)


if __name__ == "__main__":
    finetune_flow()
