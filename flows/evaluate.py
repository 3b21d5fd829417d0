"""Stage `evaluate`: every system on the same held-out data, one table (metrics/eval.json).

    python -m flows.evaluate                # what `dvc repro evaluate` runs
    dvc metrics show && dvc plots show plots/recall_at_k.csv

Where users look: the table is the Prefect artifacts `eval-table` (Markdown: rows and paired
comparisons) and `eval-rows` (a table), beside the link `mlflow-pipeline-run` to the MLflow parent
run; in MLflow, each system's numbers are also metrics of the logged model it measures
(`retromae` -> retromae-encoder, `ft:retromae` -> ft-retromae-retriever, `qa:realm` -> qa-realm-reader).
"""

from __future__ import annotations

import os

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.paths import CORPUS, METRICS
from components.stages.evaluate import evaluate
from components.tracking import ENV_PARENT, is_server
from flows._stage import Artifact, Dataset, attach_metrics, run_stage

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


def mlflow_run_url(uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI (for the embedded store: the UI `mlflow ui` serves by default),
    in the model-training view (MLflow 3.17's UI follows its GenAI / Model training toggle, which
    this parameter sets, over the experiment's `mlflow.experimentKind` tag)."""
    base = uri.rstrip("/") if is_server(uri) else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def publish(run, out: dict) -> None:
    """The table as Prefect artifacts (Markdown + table), the link to the MLflow pipeline run, and
    each system's metrics on the MLflow model it measures."""
    from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

    run.log_text(out["report"], "results.md")  # table + comparisons
    digest = run.client.get_run(run.run_id).data.tags.get("rr.data.test_data.md5", "")
    attach_metrics(run, _model_metrics(out), dataset=("test_data", digest[:16]))
    create_markdown_artifact(out["report"], key="eval-table", description="retro-realm evaluation: every system, paired comparisons")
    cols = sorted({k for r in out["rows"] for k in r} - {"dataset", "system"})
    create_table_artifact([{"dataset": r["dataset"], "system": r["system"], **{k: r.get(k) for k in cols}} for r in out["rows"]],
                          key="eval-rows", description="metrics/eval.json as rows")
    parent = os.environ.get(ENV_PARENT) or run.run_id
    exp = run.client.get_run(run.run_id).info.experiment_id
    create_link_artifact(mlflow_run_url(run.uri, exp, parent), link_text="MLflow pipeline run" if parent != run.run_id else "MLflow evaluate run",
                         key="mlflow-pipeline-run", description=f"MLflow run {parent} ({run.uri})")


@flow(name=STAGE, log_prints=True)
def evaluate_flow() -> dict:
    out = run_stage(STAGE, ["evaluate"], run_eval, inputs=[Dataset(CORPUS / "beir", "test_data")], metrics=_metrics,
                    log_more=publish,
                    artifacts=[Artifact(METRICS / "eval", "eval"),  # per-query files, HTML table, comparisons.csv, PNGs
                               Artifact(METRICS / "eval.json")],
                    quiet=True)  # the stage prints the table itself
    return out["table"]


if __name__ == "__main__":
    evaluate_flow()
