"""Stage `pretrain_realm@<arm>`: REALM pre-training with an asynchronously refreshed index.

    python -m flows.pretrain_realm --arm refreshed   # what `dvc repro pretrain_realm@refreshed` runs
    python -m flows.pretrain_realm --arm stale       # the stale-index arm (realm.stale_factor x fewer refreshes)

`dvc repro pretrain_realm` runs both arms.

Each `refresh_index` (initial, every `realm.refresh_every` steps, final) runs as a Prefect subflow
named `refresh_index` of this flow, also when it runs in the background refresh thread: the stage
body captures the training thread's context and runs the wrapper inside it, so the subflow's parent
is the training task run. Under torchrun (compute.nproc > 1) no Prefect runs in the ranks: each
refresh is a plain call and an MLflow child run only.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.config_stages import REALM_ARMS
from components.paths import REALM_ARM_OUT, RETROMAE_ENCODER, TOKENS
from components.stages.common import ENV_STAGE_ITEM
from components.stages.pretrain_realm import arm_files, train_realm
from flows import run_main
from flows._torchrun import run_training
from flows._model_card import model_card
from flows._stage import Artifact, Dataset, Model, run_stage

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
    arm = os.environ[ENV_STAGE_ITEM]
    return run_training(run.stage, "components.stages.pretrain_realm", params, run,
                        lambda p, r: train_realm(p, r, refresh_wrapper=prefect_refresh_wrapper, arm=arm))


def _metrics(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@flow(name=STAGE, log_prints=True)
def pretrain_realm_flow(arm: str = "refreshed") -> dict:
    os.environ[ENV_STAGE_ITEM] = arm  # the body (and torchrun's ranks) read it
    out, name = REALM_ARM_OUT[arm], "realm" if arm == "refreshed" else f"realm-{arm}"
    _, summary_file, plot = arm_files(arm)
    return run_stage(f"{STAGE}@{arm}", ["realm"], train, metrics=_metrics, step=lambda summary: int(summary.get("step", 0)),
                     inputs=[Dataset(TOKENS / "blocks", "retrieval_blocks"),
                             Dataset(RETROMAE_ENCODER, "retromae_encoder", optional=True)],
                     models=[Model(out / "retriever", f"{name}-retriever", "sentence_transformers"),
                             Model(out / "knowledge_augmented_encoder", f"{name}-knowledge-augmented-encoder", task="fill-mask",
                                   card=model_card)],
                     artifacts=[*(Artifact(out / sub, sub) for sub in ("retriever", "knowledge_augmented_encoder")),
                                Artifact(out / "index" / "final", "index_final"), Artifact(out / "model_card.md"),
                                Artifact(plot), Artifact(summary_file)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", choices=REALM_ARMS, default="refreshed", help="refreshed (models/realm) or stale (models/realm-stale)")
    pretrain_realm_flow(ap.parse_args(argv).arm)


if __name__ == "__main__":
    run_main(main, heartbeat=False)
