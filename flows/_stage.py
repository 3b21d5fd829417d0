"""The one shape of a stage flow: open the stage's MLflow run, log its inputs, run the body, log
its metrics and outputs, print a line. Each flow in flows/ states only what differs:

    @flow(name="tokenize", log_prints=True)
    def tokenize_flow() -> dict:
        return run_stage("tokenize", ["tokenize"], lambda params, run: tokenize_and_pack(...),
                         inputs=[Dataset(CORPUS, "corpus")], artifacts=[Artifact(TOKENS / "tokenize_card.json")])

Call it inside the `@flow` function, so the body's `@task`s run in that flow.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

from components.config import Params
from components.tracking import StageRun
from flows._runtime import params_from_env, prefect_tags


@dataclass(frozen=True)
class Dataset:
    """A file or folder logged as an MLflow dataset (with its md5) under `name`."""
    path: os.PathLike
    name: str
    optional: bool = False  # log it only when it exists


@dataclass(frozen=True)
class Artifact:
    """A file or folder logged as an MLflow artifact (a large one as a reference)."""
    path: os.PathLike
    artifact_path: str | None = None
    optional: bool = False  # log it only when it exists


def numbers(summary: dict) -> dict[str, float]:
    """The summary's numeric values (bools count, as 0/1): what most stages log as metrics."""
    return {k: v for k, v in summary.items() if isinstance(v, (int, float))}


def _present(item: Dataset | Artifact) -> bool:
    return not item.optional or os.path.exists(item.path)


def run_stage(stage: str, sections: list[str], body: Callable[[Params, StageRun], dict], *,
              params: Params | None = None, inputs: Sequence[Dataset] = (), outputs: Sequence[Dataset] = (),
              metrics: Callable[[dict], dict[str, float]] = numbers, step: Callable[[dict], int] | None = None,
              log_more: Callable[[StageRun, dict], None] | None = None, artifacts: Sequence[Artifact] = (),
              report: Callable[[dict], str] | None = None, quiet: bool = False) -> dict:
    """Run `body(params, run)` inside the stage's MLflow run and return what it returned.

    In order: `inputs` as input datasets, the body, `outputs` as output datasets, `metrics(result)`
    at `step(result)` (0 by default), `log_more(run, result)`, `artifacts`, then the printed line
    `report(result)` (default "<stage>: <result>"; none with `quiet`). `sections` are the params
    sections the run logs and digests; `params` defaults to RR_PARAMS (else params.yaml).
    """
    params = params if params is not None else params_from_env()
    with StageRun(stage, params, sections, extra_tags=prefect_tags()) as run:
        for d in filter(_present, inputs):
            run.log_dataset(d.path, name=d.name)
        result = body(params, run)
        for d in filter(_present, outputs):
            run.log_dataset(d.path, name=d.name, context="output")
        run.log_metrics_now(metrics(result), step=step(result) if step is not None else 0)
        if log_more is not None:
            log_more(run, result)
        for a in filter(_present, artifacts):
            run.log_artifact(a.path, artifact_path=a.artifact_path)
        if not quiet:
            print(report(result) if report is not None else f"{stage}: {result}")
        return result
