"""Stage `evaluate`: every system on the same held-out data, one table (metrics/eval.json).

    python -m flows.evaluate                # what `dvc repro evaluate` runs
    dvc metrics show && dvc plots show plots/recall_at_k.csv

Where users look: the table is the Prefect artifacts `eval-table` (Markdown: rows and paired
comparisons) and `eval-rows` (a table), beside the link `mlflow-pipeline-run` to the MLflow parent
run, on the pipeline's flow run (flows/pipeline.py; on this flow run when it runs outside one).
In MLflow, each system's numbers are also metrics of the logged model it measures (`retromae` ->
retromae-encoder, `ft:retromae` -> ft-retromae-retriever, `qa:realm` -> qa-realm-reader).
"""

from __future__ import annotations

import os

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.paths import CORPUS, METRICS
from components.stages.evaluate import evaluate
from components.tracking import ENV_PARENT
from flows import run_main
from flows._stage import Artifact, Dataset, attach_metrics, mlflow_run_url, publish_eval_artifacts, run_stage

STAGE = "evaluate"


@task(cache_policy=NO_CACHE, name="evaluate-all-systems")
def run_eval(params, run) -> dict:
    return evaluate(params, run)


def _metrics(out: dict) -> dict:
    """<set>.<system>.<metric> for every number of the table (not timings or counts), and
    cmp.<set>.<A> vs <B>.<metric>.{delta,p_value} for every paired comparison."""
    table = {f"{row['dataset']}.{row['system']}.{key}": v for row in out["rows"] for key, v in row.items()
             if isinstance(v, (int, float)) and key not in ("seconds",) and not key.startswith("n_")}
    for c in out.get("comparisons", []):
        base = f"cmp.{c['dataset']}.{c['a']} vs {c['b']}.{c['metric']}"
        table.update({f"{base}.delta": c["delta"], f"{base}.p_value": c["p_value"]})
    return table


def model_of(system: str) -> str | None:
    """The logged model an eval row measures (None: BM25, mean pooling of the warm start, ...)."""
    kind, _, name = system.partition(":")
    if not name:
        return {"init": "init-encoder", "retromae": "retromae-encoder", "mlm": "mlm-encoder",
                "realm": "realm-retriever"}.get(system)
    return {"ft": f"ft-{name}-retriever", "qa": f"qa-{name}-reader"}.get(kind)


def _model_metrics(out: dict) -> dict[str, dict[str, float]]:
    by_model: dict[str, dict[str, float]] = {}
    for row in out["rows"]:
        name = model_of(row["system"])
        if name:
            by_model.setdefault(name, {}).update({f"{row['dataset']}.{k}": v for k, v in row.items()
                                                  if isinstance(v, (int, float)) and k != "seconds" and not k.startswith("n_")})
    return by_model


def publish(run, out: dict) -> None:
    """Each system's metrics on the MLflow model it measures, the report as an MLflow artifact; the
    Prefect artifacts here only for a stage run outside a pipeline run (`dvc repro evaluate`), since
    a pipeline run publishes them on its own flow run, linked to its MLflow parent run."""
    run.log_text(out["report"], "results.md")  # table + comparisons
    digest = run.client.get_run(run.run_id).data.tags.get("rr.data.test_data.md5", "")
    attach_metrics(run, _model_metrics(out), dataset=("test_data", digest[:16]))
    if not os.environ.get(ENV_PARENT):
        exp = run.client.get_run(run.run_id).info.experiment_id
        publish_eval_artifacts(out["report"], out["rows"], mlflow_run_url(run.uri, exp, run.run_id), "MLflow evaluate run",
                               f"MLflow run {run.run_id} ({run.uri})")


@flow(name=STAGE, log_prints=True)
def evaluate_flow() -> dict:
    out = run_stage(STAGE, ["evaluate"], run_eval, inputs=[Dataset(CORPUS / "beir", "test_data")], metrics=_metrics,
                    log_more=publish,
                    artifacts=[Artifact(METRICS / "eval", "eval"),  # per-query files, HTML table, comparisons.csv, PNGs
                               Artifact(METRICS / "eval.json")],
                    quiet=True)  # the stage prints the table itself
    return out["table"]


if __name__ == "__main__":
    run_main(evaluate_flow, heartbeat=False)
