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

from components.stages.pretrain_realm import train_realm
from components.tracking import StageRun
from flows._runtime import RETROMAE_OUT, TOKENS, params_from_env, prefect_tags, run_training

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
    return run_training(STAGE, "components.stages.pretrain_realm", params, run,
                        lambda p, r: train_realm(p, r, refresh_wrapper=prefect_refresh_wrapper))


@flow(name=STAGE, log_prints=True)
def pretrain_realm_flow() -> dict:
    params = params_from_env()
    with StageRun(STAGE, params, ["realm"], extra_tags=prefect_tags()) as run:
        run.log_dataset(TOKENS / "blocks", name="retrieval_blocks")
        if (RETROMAE_OUT / "encoder").is_dir():
            run.log_dataset(RETROMAE_OUT / "encoder", name="retromae_encoder")
        summary = train(params, run)  # logs the retriever, reader, final index and card itself
        run.log_metrics_now({k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
                            step=int(summary.get("step", 0)))
        print(f"{STAGE}: {summary}")
        return summary


if __name__ == "__main__":
    pretrain_realm_flow()
