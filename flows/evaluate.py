"""Stage `evaluate`: every system on the same held-out data, one table (metrics/eval.json).

    python -m flows.evaluate                # what `dvc repro evaluate` runs
    dvc metrics show && dvc plots show plots/recall_at_k.csv
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.paths import CORPUS, METRICS
from components.stages.evaluate import evaluate
from flows._stage import Artifact, Dataset, run_stage

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


@flow(name=STAGE, log_prints=True)
def evaluate_flow() -> dict:
    out = run_stage(STAGE, ["evaluate"], run_eval, inputs=[Dataset(CORPUS / "beir", "test_data")], metrics=_metrics,
                    log_more=lambda run, out: run.log_text(out["report"], "results.md"),  # table + comparisons
                    artifacts=[Artifact(METRICS / "eval", "eval"),  # per-query files, HTML table, comparisons.csv, PNGs
                               Artifact(METRICS / "eval.json")],
                    quiet=True)  # the stage prints the table itself
    return out["table"]


if __name__ == "__main__":
    evaluate_flow()
