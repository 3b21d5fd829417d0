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
RETROMAE_OUT = MODELS / "retromae"             # pretrain_retromae: encoder/ (+ init_encoder/)
RETROMAE_ENCODER = RETROMAE_OUT / "encoder"
INIT_ENCODER = RETROMAE_OUT / "init_encoder"   # the encoder before pre-training (the `init` row)
MLM_OUT = MODELS / "mlm"                       # pretrain_mlm: encoder/
MLM_ENCODER = MLM_OUT / "encoder"
REALM_OUT = MODELS / "realm"                   # pretrain_realm: retriever/, knowledge_augmented_encoder/, index/
FINETUNE_OUT = MODELS / "finetune"             # finetune: retriever/<start>/, open_qa/<system>/
FINETUNE_RETRIEVERS = FINETUNE_OUT / "retriever"  # one fine-tuned bi-encoder per starting encoder
FINETUNE_OPEN_QA = FINETUNE_OUT / "open_qa"       # one retriever + reader per open-QA system
METRICS = Path("metrics")
PLOTS = Path("plots")
# Outside DVC's outs, so a killed stage's checkpoints survive `dvc repro` resetting its outputs.
CHECKPOINTS = Path(os.environ.get("RR_CHECKPOINT_ROOT", "checkpoints"))

# What each dvc.yaml stage declares under `outs` (metrics and plots files aside).
STAGE_OUTS: dict[str, list[Path]] = {
    "prepare_corpus": [CORPUS],
    "tokenize": [TOKENS],
    "pretrain_retromae": [RETROMAE_OUT],
    "pretrain_mlm": [MLM_OUT],
    "pretrain_realm": [REALM_OUT],
    "finetune": [FINETUNE_OUT],
    "evaluate": [METRICS / "eval"],
}


def stage_metrics(stage: str) -> Path:
    """metrics/<stage>.json: the stage summary that dvc.yaml declares as its metrics file."""
    return METRICS / f"{stage}.json"
