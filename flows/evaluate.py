"""Stage `evaluate`: every system on the same held-out data, one table (metrics/eval.json).

    python -m flows.evaluate                # what `dvc repro evaluate` runs
    dvc metrics show && dvc plots show plots/recall_at_k.csv
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.eval.report import results_table
from components.stages.evaluate import evaluate
from components.tracking import StageRun
from flows._runtime import CORPUS, METRICS, params_from_env, prefect_tags

STAGE = "evaluate"


@task(cache_policy=NO_CACHE, name="evaluate-all-systems")
def run_eval(params, run) -> dict:
    return evaluate(params, run)


@flow(name=STAGE, log_prints=True)
def evaluate_flow() -> dict:
    params = params_from_env()
    with StageRun(STAGE, params, ["evaluate"], extra_tags=prefect_tags()) as run:
        run.log_dataset(CORPUS / "beir", name="test_data")
        out = run_eval(params, run)
        flat = {}
        for row in out["rows"]:
            for key, v in row.items():
                if isinstance(v, (int, float)) and key not in ("seconds",) and not key.startswith("n_"):
                    flat[f"{row['dataset']}.{row['system']}.{key}"] = v
        run.log_metrics_now(flat)
        run.log_text(results_table(out["rows"]), "results.md")
        run.log_artifact(METRICS / "eval", artifact_path="eval")  # per-query files, HTML table, PNG figures
        run.log_artifact(METRICS / "eval.json")
        return out["table"]


if __name__ == "__main__":
    evaluate_flow()
