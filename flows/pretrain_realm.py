"""Stage `pretrain_realm`: REALM pre-training with an asynchronously refreshed index.

    python -m flows.pretrain_realm          # what `dvc repro pretrain_realm` runs

Each `refresh_index` (initial, every `realm.refresh_every` steps, final) runs as a Prefect subflow
named `refresh_index` of this flow, also when it runs in the background refresh thread: the stage
body captures the training thread's context and runs the wrapper inside it, so the subflow's parent
is the training task run. Under torchrun (compute.nproc > 1) no Prefect runs in the ranks: each
refresh is a plain call and an MLflow child run only.
"""

from __future__ import annotations

from typing import Callable

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.paths import REALM_OUT, RETROMAE_ENCODER, TOKENS
from components.stages.pretrain_realm import train_realm
from flows._torchrun import run_training
from flows._stage import Dataset, Model, run_stage

STAGE = "pretrain_realm"


def prefect_refresh_wrapper(body: Callable[..., dict], *, step: int, reason: str) -> dict:
    """Run one refresh as the subflow `refresh_index(step, reason) -> stats` (version, timings,
    staleness, recall). Only small values cross Prefect; the index itself stays in memory."""

    @flow(name="refresh_index", flow_run_name=f"refresh_index-{reason}-step{step}", log_prints=True,
          validate_parameters=False, persist_result=False)
    def refresh_index(step: int, reason: str) -> dict:
        from prefect.runtime import flow_run

        return body(tags={"prefect.flow_run_id": str(flow_run.get_id())})

    return refresh_index(step=step, reason=reason)


@task(cache_policy=NO_CACHE, name="train-realm")
def train(params, run) -> dict:
    summary = run_training(STAGE, "components.stages.pretrain_realm", params, run,
                           lambda p, r: train_realm(p, r, refresh_wrapper=prefect_refresh_wrapper))
    return summary


def _metrics(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@flow(name=STAGE, log_prints=True)
def pretrain_realm_flow() -> dict:
    # The body logs the retriever, reader, final index and card itself (its artifacts).
    return run_stage(STAGE, ["realm"], train, metrics=_metrics, step=lambda summary: int(summary.get("step", 0)),
                     inputs=[Dataset(TOKENS / "blocks", "retrieval_blocks"),
                             Dataset(RETROMAE_ENCODER, "retromae_encoder", optional=True)],
                     models=[Model(REALM_OUT / "retriever", "realm-retriever", "sentence_transformers"),
                             Model(REALM_OUT / "knowledge_augmented_encoder", "realm-knowledge-augmented-encoder", task="fill-mask")])


if __name__ == "__main__":
    pretrain_realm_flow()
