"""The DAG's folders, relative to the workspace root (the repo, or a worker's checkout).

They are wiring that `dvc.yaml` owns (each stage's deps and outs), not knobs, so they are not in
params.yaml. Flows, stages and tests all take them from here; `tests/test_dvc_stages.py` checks
that `dvc.yaml` names the same folders.
"""

from __future__ import annotations

import os
from pathlib import Path

CORPUS = Path("data/corpus")                   # prepare_corpus: parquet + BEIR layout + qa
TOKENS = Path("data/tokens")                   # tokenize: tokenizer, pre-training and retrieval blocks
MODELS = Path("models")
RETROMAE_OUT = MODELS / "retromae"             # pretrain_retromae: encoder/
RETROMAE_ENCODER = RETROMAE_OUT / "encoder"
# pretrain_retromae's second out, the encoder before pre-training (the `init` row): apart from
# models/retromae so that finetune_retriever@init-* does not depend on RetroMAE's training
INIT_OUT = MODELS / "init"
INIT_ENCODER = INIT_OUT / "encoder"
MLM_OUT = MODELS / "mlm"                       # pretrain_mlm: encoder/
MLM_ENCODER = MLM_OUT / "encoder"
REALM_OUT = MODELS / "realm"                   # pretrain_realm@refreshed: retriever/, knowledge_augmented_encoder/, index/
REALM_STALE_OUT = MODELS / "realm-stale"       # pretrain_realm@stale: the same, refreshed realm.stale_factor x less often
REALM_ARM_OUT = {"refreshed": REALM_OUT, "stale": REALM_STALE_OUT}
REALM_SYSTEM_OUT = {"realm": REALM_OUT, "realm-stale": REALM_STALE_OUT}  # zero-shot / open-QA system -> its arm
# in each arm's folder when realm.ict_steps > 0: the retriever after ICT, before any REALM step (the `ict` row)
ICT_RETRIEVER = "ict_retriever"
FINETUNE_OUT = MODELS / "finetune"             # retriever/<start>-<size>/, open_qa/<system>/
FINETUNE_RETRIEVERS = FINETUNE_OUT / "retriever"  # finetune_retriever@<start>-<size>: one bi-encoder each
FINETUNE_OPEN_QA = FINETUNE_OUT / "open_qa"       # finetune_reader@<system>: one retriever + reader each
METRICS = Path("metrics")
PLOTS = Path("plots")
# Outside DVC's outs, so a killed stage's checkpoints survive `dvc repro` resetting its outputs.
CHECKPOINTS = Path(os.environ.get("RR_CHECKPOINT_ROOT", "checkpoints"))



def retriever_out(start: str, size: int | str) -> Path:
    """finetune_retriever@<start>-<size>'s bi-encoder."""
    return FINETUNE_RETRIEVERS / f"{start}-{size}"


def retriever_item(item: str) -> tuple[str, int | str]:
    """A finetune_retriever stage's item, split: `retromae-32` -> ("retromae", 32); `init-all` -> ("init", "all")."""
    start, sep, size = item.rpartition("-")
    if not sep or not start or not (size == "all" or size.isdigit()):
        raise ValueError(f"finetune_retriever: item {item!r} is not <start>-<size> (e.g. retromae-32, init-all)")
    return start, (size if size == "all" else int(size))


def reader_out(system: str) -> Path:
    """finetune_reader@<system>'s retriever + reader."""
    return FINETUNE_OPEN_QA / system


# What each dvc.yaml stage declares under `outs` (metrics and plots files aside), by the stage's
# name (`<group>@<item>` for a foreach / matrix stage).
def stage_outs(stage: str) -> list[Path]:
    group, _, item = stage.partition("@")
    if group == "pretrain_realm":
        return [REALM_ARM_OUT[item]]
    if group == "finetune_retriever":
        return [retriever_out(*retriever_item(item))]
    if group == "finetune_reader":
        return [reader_out(item)]
    return {"prepare_corpus": [CORPUS], "tokenize": [TOKENS], "pretrain_retromae": [RETROMAE_OUT, INIT_OUT],
            "pretrain_mlm": [MLM_OUT], "evaluate": [METRICS / "eval"]}[group]


def loss_curve(stage: str) -> Path:
    """plots/loss_<stage>.csv: a pre-training stage's loss per logged step (`step,loss`), a DVC out
    that `dvc plots show` draws and evaluate's training-curve figure reads (REALM's refreshed arm is
    plots/loss_pretrain_realm.csv, the stale arm plots/loss_pretrain_realm_stale.csv)."""
    return PLOTS / f"loss_{stage.removesuffix('@refreshed').replace('@', '_')}.csv"


def stage_metrics(stage: str) -> Path:
    """metrics/<stage>.json: the stage summary that dvc.yaml declares as its metrics file (`@` -> `_`:
    metrics/finetune_retriever_retromae-32.json)."""
    return METRICS / f"{stage.replace('@', '_')}.json"
