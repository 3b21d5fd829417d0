"""Stage `finetune`: DPR bi-encoder fine-tuning and the open-QA reader.

    python -m flows.finetune                # what `dvc repro finetune` runs
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.stages.finetune import finetune
from components.tracking import StageRun
from flows._runtime import CORPUS, FINETUNE_OUT, METRICS, params_from_env, prefect_tags, run_training

STAGE = "finetune"


@task(cache_policy=NO_CACHE, name="finetune-retriever-and-reader")
def train(params, run) -> dict:
    return run_training(STAGE, "components.stages.finetune", params, run, finetune)


@flow(name=STAGE, log_prints=True)
def finetune_flow() -> dict:
    params = params_from_env()
    with StageRun(STAGE, params, ["finetune"], extra_tags=prefect_tags()) as run:
        run.log_dataset(CORPUS / "beir", name="train_questions")
        summary = train(params, run)
        run.log_metrics_now({k: v for k, v in summary.items() if isinstance(v, (int, float))})
        for sub in ("retriever", "open_qa"):
            if (FINETUNE_OUT / sub).exists():
                run.log_artifact(FINETUNE_OUT / sub, artifact_path=sub)
        run.log_artifact(METRICS / f"{STAGE}.json")
        print(f"{STAGE}: {summary}")
        return summary


if __name__ == "__main__":
    finetune_flow()
