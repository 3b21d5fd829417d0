"""Stage body of `pretrain_retromae` (and of its plain-MLM sibling `pretrain_mlm`).

    python -m flows.pretrain_retromae                              # one process (the flow)
    torchrun --standalone --nproc_per_node=2 -m components.stages.pretrain_retromae   # what the flow
                                                                   # launches when compute.nproc=2

Outputs (rank 0), under `paths.RETROMAE_OUT` / `paths.MLM_OUT`: `encoder/` (HF folder + tokenizer,
loadable with AutoModel / AutoModelForMaskedLM, read with [CLS] pooling), `model_card.md`; the same
encoder before pre-training, the "init" baseline (`paths.INIT_ENCODER` for RetroMAE, its own out so
that `finetune_retriever@init-*` does not depend on RetroMAE's training; `init_encoder/` for MLM);
`paths.stage_metrics(stage)` and the loss curve `paths.loss_curve(stage)`.

Warm start (`warm_start.path` set): the encoder is loaded from that folder (`retromae.encoder`'s size
params are ignored, its dropout still applies) and `init_encoder/` is that encoder unchanged. With
`warm_start.head_warmup_steps`, a first phase trains only the MLM head's transform/bias (and
RetroMAE's decoder) with the encoder body frozen (`frozen_encoder_body`), on the shared Trainer with
its own checkpoints (`<checkpoint dir>/head_warmup/`, so a killed run resumes it), logged as
`head_warmup_*`; then the joint training starts from that head. `warm_start.head_lr` gives the
head and decoder their own (higher) lr in the joint phase, the body keeping `retromae.train.lr`.
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
from components.io import write_text_atomic
from components.models.encoder import frozen_encoder_body, head_param_names, save_encoder, warm_start_path
from components.models.mlm import MLMModel
from components.models.retromae import RetroMAE
from components.paths import INIT_ENCODER, MLM_OUT, RETROMAE_OUT, TOKENS, loss_curve, stage_metrics
from components.stages.common import RankZeroLogger, checkpoint_dir, torchrun_worker, write_loss_curve, write_stage_metrics
from components.training import distributed as D
from components.training.optim import LrGroup, phase_params
from components.training.trainer import TrainResult, Trainer, prefixed

log = logging.getLogger(__name__)


def _model_card(stage: str, params: Params, result, extra: str = "") -> str:
    sec = params.retromae
    lines = [
        f"# {stage} encoder", "",
        "Trained by retro-realm (`dvc repro " + stage + "`).",
        extra, "",
        *([f"Warm start: `{params.warm_start.model_dump_json()}`", ""] if params.warm_start.path is not None else []),
        "## Params", "```json", json.dumps(sec.model_dump(mode="json"), indent=2), "```", "",
        "## Final metrics", "```json", json.dumps({k: round(v, 5) for k, v in result.metrics.items()}, indent=2), "```", "",
        "## Load", "```python", "from transformers import AutoModel, AutoTokenizer",
        f'model = AutoModel.from_pretrained("{stage_out(stage)}/encoder")  # [CLS] pooling', "```",
    ]
    return "\n".join(lines) + "\n"


def stage_out(stage: str) -> Path:
    return RETROMAE_OUT if stage == "pretrain_retromae" else MLM_OUT


def _check_vocab(model, tokenizer, warm: str, tokens_dir: Path) -> None:
    """A warm-started encoder reads ids only through its own tokenizer's vocabulary."""
    have, want = len(tokenizer), model.encoder.config.vocab_size
    if have != want:
        raise ValueError(f"warm_start.path={warm}: the encoder has {want} token ids but {tokens_dir}/tokenizer has {have}; "
                         "the corpus must be tokenized with the warm start's own tokenizer (re-run the tokenize stage with it)")


def head_warmup(model, data, collate, params: Params, out_dir: Path, log_fn=None) -> TrainResult:
    """Phase 1 of a warm start: `warm_start.head_warmup_steps` steps at `warm_start.head_warmup_lr`
    (the rest of `retromae.train` for the other knobs) that move only what `frozen_encoder_body`
    leaves trainable. A random head trained jointly from step 0 sends its noise (and the decoder's)
    into [CLS]; trained first on a frozen encoder, it starts the joint phase knowing the vocabulary.
    Schedule: retromae.train.warmup_ratio of warm-up, then constant (the phase hands over to the
    joint one, whose own schedule starts again from a warm-up)."""
    ws, train = params.warm_start, params.retromae.train
    train = phase_params(train, ws.head_warmup_steps, ws.head_warmup_lr)
    with frozen_encoder_body(model) as trainable:
        log.info("head warm-up: %d steps at lr %g, encoder body frozen; training %s", train.max_steps, train.lr, ", ".join(trainable))
        trainer = Trainer(model, data, collate, train, params.compute, out_dir, log_fn=prefixed(log_fn, "head_warmup_"),
                          log_every=params.tracking.log_every, param_prefix="warm_start.head_warmup", schedule="constant",
                          progress_every=params.tracking.progress_every)
        return trainer.fit()


def head_lr_groups(model, params: Params) -> list[LrGroup]:
    """The joint phase's `warm_start.head_lr` group (MLM head transform/bias + RetroMAE's decoder);
    none when it is null: every parameter at retromae.train.lr."""
    lr = params.warm_start.head_lr
    if lr is None:
        return []
    names = set(head_param_names(model))
    log.info("joint phase: head + decoder (%d tensors) at lr %g, encoder body at %g", len(names), lr, params.retromae.train.lr)
    return [LrGroup("head", names.__contains__, lr)]


def train_encoder(stage: str, params: Params, run=None, tokens_dir: Path = TOKENS) -> dict:
    """RetroMAE (`pretrain_retromae`) or whole-word MLM with the same encoder and compute (`pretrain_mlm`)."""
    out = stage_out(stage)
    warm = warm_start_path(params)  # before any data is read: a bad warm_start.path fails first
    tokenizer = load_tokenizer(tokens_dir / "tokenizer")
    ids = SpecialTokens.from_tokenizer(tokenizer)
    data = datasets.load_from_disk(str(tokens_dir / "pretrain"))
    torch.manual_seed(params.compute.seed)  # the same init for RetroMAE and MLM: a fair comparison
    sec = params.retromae
    if stage == "pretrain_retromae":
        model = RetroMAE.from_params(sec, ids, pretrained=warm)
        collate = RetroMAECollator(ids, sec, seed=params.compute.seed)
    else:
        model = MLMModel.from_params(sec.encoder, ids, pretrained=warm)
        collate = MLMCollator(ids, params.mlm.mask_ratio, sec.max_len, seed=params.compute.seed)
    if warm is not None:
        _check_vocab(model, tokenizer, warm, tokens_dir)
        log.info("%s: warm start from %s (retromae.encoder size params ignored)", stage, warm)
    # Join the process group first: before it exists every torchrun rank would call itself rank 0.
    D.init_distributed(params.compute)
    if D.is_rank0():
        save_encoder(model, tokenizer, INIT_ENCODER if stage == "pretrain_retromae" else out / "init_encoder")
        if warm is not None and hasattr(run, "set_tags"):
            run.set_tags({"rr.warm_start": warm, "rr.head_warmup_steps": params.warm_start.head_warmup_steps})
    ckpt_root = checkpoint_dir(stage, params, ["retromae", "warm_start"] if stage == "pretrain_retromae" else ["retromae", "mlm", "warm_start"],
                               inputs=[warm] if warm is not None else [])  # the warm start by content (a hub name: by name)
    log_fn = RankZeroLogger(run)
    head = {"head_warmup_steps": 0}
    if params.warm_start.head_warmup_steps:
        res = head_warmup(model, data, collate, params, ckpt_root / "head_warmup", log_fn)
        head = {"head_warmup_steps": res.step, "head_warmup_resumed_from": res.resumed_from or 0,
                "head_warmup_seconds": round(res.elapsed_s, 2), **{f"head_warmup_final_{k}": v for k, v in res.metrics.items()}}
    trainer = Trainer(model, data, collate, sec.train, params.compute, ckpt_root,
                      log_fn=log_fn, log_every=params.tracking.log_every, param_prefix="retromae.train",
                      label="mlm (retromae.train)" if stage == "pretrain_mlm" else None,
                      lr_groups=head_lr_groups(model, params), progress_every=params.tracking.progress_every)
    result = trainer.fit()
    summary = {"step": result.step, "bad_steps": result.bad_steps, "resumed_from": result.resumed_from or 0,
               "train_seconds": round(result.elapsed_s, 2), **{f"final_{k}": v for k, v in result.metrics.items()},
               **head, **({"warm_start": warm} if warm is not None else {})}
    if D.is_rank0():
        save_encoder(trainer.raw_model, tokenizer, out / "encoder")
        write_text_atomic(out / "model_card.md", _model_card(stage, params, result,
                                                             "RetroMAE: masked auto-encoder with enhanced decoding." if stage == "pretrain_retromae"
                                                             else "Plain whole-word MLM baseline, same encoder, data and steps as RetroMAE."))
        write_loss_curve(loss_curve(stage), result.curve)
        summary = write_stage_metrics(stage_metrics(stage), summary)
    D.barrier()
    return summary


def main() -> None:
    torchrun_worker("pretrain_retromae", lambda params, run: train_encoder("pretrain_retromae", params, run))


if __name__ == "__main__":
    main()
