"""Stage body of `pretrain_retromae` (and of its plain-MLM sibling `pretrain_mlm`).

    python -m flows.pretrain_retromae                              # one process (the flow)
    torchrun --standalone --nproc_per_node=2 -m components.stages.pretrain_retromae   # what the flow
                                                                   # launches when compute.nproc=2

Outputs (rank 0): `<out>/encoder/` (HF folder + tokenizer: AutoModel / AutoModelForMaskedLM /
sentence-transformers with CLS pooling), `<out>/init_encoder/` (the same encoder before
pre-training, the "init" baseline), `<out>/model_card.md`, and `metrics/<stage>.json`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import datasets
import torch

from components.config import Params
from components.data.masking import MLMCollator, RetroMAECollator, SpecialTokens
from components.data.tokenize import load_tokenizer
from components.models.mlm import MLMModel
from components.models.retromae import RetroMAE, save_pretrained_encoder
from components.stages.common import RankZeroLogger, checkpoint_dir, torchrun_worker, write_stage_metrics
from components.training import distributed as D
from components.training.trainer import Trainer

log = logging.getLogger(__name__)

TOKENS = Path("data/tokens")


def _model_card(stage: str, params: Params, result, extra: str = "") -> str:
    sec = params.retromae
    lines = [
        f"# {stage} encoder", "",
        "Trained by retro-realm (`dvc repro " + stage + "`).",
        extra, "",
        "## Params", "```json", json.dumps(sec.model_dump(mode="json"), indent=2), "```", "",
        "## Final metrics", "```json", json.dumps({k: round(v, 5) for k, v in result.metrics.items()}, indent=2), "```", "",
        "## Load", "```python", "from transformers import AutoModel, AutoTokenizer",
        f'model = AutoModel.from_pretrained("{stage_out(stage)}/encoder")  # [CLS] pooling', "```",
    ]
    return "\n".join(lines) + "\n"


def stage_out(stage: str) -> Path:
    return Path("models") / ("retromae" if stage == "pretrain_retromae" else "mlm")


def train_encoder(stage: str, params: Params, run=None, tokens_dir: Path = TOKENS) -> dict:
    """RetroMAE (`pretrain_retromae`) or whole-word MLM with the same encoder and compute (`pretrain_mlm`)."""
    out = stage_out(stage)
    tokenizer = load_tokenizer(tokens_dir / "tokenizer")
    ids = SpecialTokens.from_tokenizer(tokenizer)
    data = datasets.load_from_disk(str(tokens_dir / "pretrain"))
    torch.manual_seed(params.compute.seed)  # the same init for RetroMAE and MLM: a fair comparison
    sec = params.retromae
    if stage == "pretrain_retromae":
        model = RetroMAE.from_params(sec, ids)
        collate = RetroMAECollator(ids, sec, seed=params.compute.seed)
    else:
        model = MLMModel.from_params(sec.encoder, ids)
        collate = MLMCollator(ids, params.mlm.mask_ratio, sec.max_len, seed=params.compute.seed)
    # Join the process group first: before it exists every torchrun rank would call itself rank 0.
    D.init_distributed(params.compute)
    if D.is_rank0():
        save_pretrained_encoder(model, tokenizer, out / "init_encoder")
    trainer = Trainer(model, data, collate, sec.train, params.compute, checkpoint_dir(stage, params, ["retromae"] if stage == "pretrain_retromae" else ["retromae", "mlm"]),
                      log_fn=RankZeroLogger(run), log_every=params.tracking.log_every, param_prefix="retromae.train")
    result = trainer.fit()
    summary = {"step": result.step, "bad_steps": result.bad_steps, "resumed_from": result.resumed_from or 0,
               "train_seconds": round(result.elapsed_s, 2), **{f"final_{k}": v for k, v in result.metrics.items()}}
    if D.is_rank0():
        save_pretrained_encoder(trainer.raw_model, tokenizer, out / "encoder")
        (out / "model_card.md").write_text(_model_card(stage, params, result,
                                                       "RetroMAE: masked auto-encoder with enhanced decoding." if stage == "pretrain_retromae"
                                                       else "Plain whole-word MLM baseline, same encoder, data and steps as RetroMAE."))
        write_stage_metrics(Path("metrics") / f"{stage}.json", summary)
    D.barrier()
    return summary


def main() -> None:
    torchrun_worker("pretrain_retromae", lambda params, run: train_encoder("pretrain_retromae", params, run))


if __name__ == "__main__":
    main()
