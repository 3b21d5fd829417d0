"""The two short warm-ups that run before REALM pre-training, each on the shared Trainer
(resumable, own checkpoints). They are there to help small models trained from scratch:

* `ict_warmup`: the Inverse Cloze Task on the retriever (ORQA), loss `models/ict.ICTModel`,
  batches `data/ict_batch.ICTCollator`. REALM warm-starts its retriever this way too; with the
  tiny preset's towers REALM collapses them without it.
* `reader_warmup`: the knowledge-augmented encoder alone learns to read a document that states
  x's hidden fact (`ReaderWarmupCollator`, `ReaderWarmupModel`). The paper's reader is a
  pre-trained BERT, which already reads its context. A small encoder pre-trained for minutes on
  one CPU does not; then p(y|x,z) does not depend on z and the retriever's gradient carries only
  noise (docs/experiments/realm_toy.md). A reader that already reads needs none
  (`realm.reader_warmup_steps: 0`).

Neither warm-up sees the held-out blocks.
"""

from __future__ import annotations

import bisect
import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from components.config import Params
from components.config_shared import batch_keys
from components.data.ict_batch import ICTCollator, ict_eligible_rows
from components.data.realm_batch import NULL_ROW, collate
from components.data.realm_query import (RealmQuery, draw_query, empty_batch_error, iter_block_rows, masked_answer,
                                         span_block_counts, unmasked_spans)
from components.data.salient_spans import TaggerLike, span_tagger_for
from components.data.special_tokens import IGNORE_INDEX, SpecialTokens
from components.data.token_spans import block_spans
from components.models.encoder import activation_checkpointing
from components.models.ict import ICTModel
from components.models.realm import KnowledgeAugmentedEncoder, knowledge_augmented_inputs
from components.models.retriever import Retriever
from components.training.optim import phase_params
from components.training.trainer import LogFn, Trainer, prefixed


def run_warmup(model: nn.Module, rows: list[int], collator, params: Params, out_dir: Path, log_fn: LogFn | None = None, *,
               name: str, steps: int, lr: float, report: tuple[str, ...]) -> dict:
    """One warm-up on the shared Trainer (resumable, own checkpoints in `out_dir`, the rest of
    `realm.train` for the other knobs), its metrics logged through `log_fn` as `{name}_*`. Its batch and
    grad_accum are the keys `batch_keys("realm.<name>")` names, the ones the params' batch-split check
    reads. Returns `{name}_steps` and `{name}_final_<m>` for each metric m in `report`."""
    prefix = f"realm.{name}"
    batch_key, accum_key = batch_keys(prefix)
    train = phase_params(params.realm.train, steps, lr, batch_size=params.value(batch_key), grad_accum=params.value(accum_key))
    trainer = Trainer(model, rows, collator, train, params.compute, out_dir, log_fn=prefixed(log_fn, f"{name}_"),
                      log_every=params.tracking.log_every, param_prefix=prefix, progress=False,
                      progress_every=params.tracking.progress_every)
    result = trainer.fit()
    return {f"{name}_steps": result.step, f"{name}_resumed_from": result.resumed_from or 0,
            **{f"{name}_final_{k}": v for k, v in result.metrics.items() if k in report}}


# ----------------------------------------------------------------------------------------------
# ICT (realm.ict_steps)
# ----------------------------------------------------------------------------------------------
def ict_warmup(retriever: Retriever, blocks, params: Params, special: SpecialTokens, out_dir: Path,
               log_fn: LogFn | None = None, exclude: set[int] = frozenset()) -> dict:
    """Train `retriever` in place with ICT for `realm.ict_steps` steps, on every block with two
    sentences except the rows in `exclude` (the held-out blocks)."""
    p = params.realm
    rows = [r for r in ict_eligible_rows(blocks) if r not in exclude]
    if len(rows) < p.ict_batch_size:
        raise ValueError(f"ICT needs at least realm.ict_batch_size={p.ict_batch_size} blocks with two sentences "
                         f"(held-out blocks excluded); found {len(rows)}: lower realm.ict_batch_size or set realm.ict_steps to 0")
    # all of the micro-batch's contexts are its negatives, so memory is saved by recomputing, never by splitting
    with activation_checkpointing(retriever, p.ict_checkpoint_every):
        return run_warmup(ICTModel(retriever), rows, ICTCollator(blocks, p, special, p.ict_mask_rate), params, out_dir,
                          log_fn, name="ict", steps=p.ict_steps, lr=p.ict_lr, report=("loss", "ict_acc"))


# ----------------------------------------------------------------------------------------------
# reader warm-up (realm.reader_warmup_steps)
# ----------------------------------------------------------------------------------------------
class SalientSpanIndex:
    """Which blocks hold which salient span (as token ids), from one pass over the corpus: finds, for
    a masked query, the blocks that state its answer about the same thing (`answer_docs`).

    Memory is one entry per (block, distinct salient span), the cost of one `eligible_rows` pass;
    a lookup intersects short posting lists, never scans the corpus."""

    def __init__(self, blocks, tagger: TaggerLike):
        cols = [c for c in ("input_ids", "word_ids", "offsets", "char_spans", "text") if c in blocks.column_names]
        self.spans_of: dict[int, set[tuple[int, ...]]] = {}
        self.rows_of: dict[tuple[int, ...], set[int]] = {}
        for r, row in iter_block_rows(blocks, cols):
            self.spans_of[r] = block_spans(row, tagger)
            for sp in self.spans_of[r]:
                self.rows_of.setdefault(sp, set()).add(r)
        self.by_len: dict[int, list[tuple[int, ...]]] = {}  # token length -> distinct spans, in a fixed order
        for sp in sorted(self.rows_of):
            self.by_len.setdefault(len(sp), []).append(sp)

    def answer_docs(self, q: RealmQuery) -> set[int]:
        """Blocks other than x's own in which the masked answer is a salient span AND that name one
        of the salient spans x shows unmasked: a statement of the hidden fact about x's subject
        (distant supervision by span match, as DPR's "answer in passage" positives)."""
        context = unmasked_spans(q, self.spans_of.get(q.source_row, set()))
        about = set().union(*(self.rows_of.get(sp, set()) for sp in context)) if context else set()
        return (self.rows_of.get(masked_answer(q), set()) & about) - {q.source_row}


def cut_around(z: list[int], answer: tuple[int, ...], n: int) -> list[int]:
    """The n tokens of z centred on the first occurrence of `answer` (z[:n] when it does not occur)."""
    if len(z) <= n:
        return z
    k = len(answer)
    at = next((i for i in range(len(z) - k + 1) if tuple(z[i:i + k]) == answer), None) if k else None
    if at is None:
        return z[:n]
    start = min(max(0, at + k // 2 - n // 2), len(z) - n)
    return z[start:start + n]


class ReaderWarmupCollator:
    """rows -> one REALM query per row with one document: `x_*` (B, Lx) and `z_*` (B, 1, Lz).

    `own_block`: z is x's own block, which holds x unmasked, so the task is to find x's context in z
    and copy the hidden span. `answer_block`: z is another block that states the hidden fact
    (`SalientSpanIndex.answer_docs`, drawn among `doc_rows`), in other words and order, so the
    reader must match x's subject and relation, not its surface; x's own block when there is none.
    With probability `reader_warmup_swap_answer` the answer is then swapped for a random salient span
    (`swap_answer`), so that reading z is the only way to predict it."""

    def __init__(self, blocks, p, special: SpecialTokens, spans: SalientSpanIndex | None = None,
                 doc_rows: set[int] | None = None):  # p: RealmParams
        self.blocks, self.lookup, self.p, self.special = blocks, blocks.select_columns(["input_ids"]), p, special
        self.spans, self.doc_rows = spans, doc_rows
        self.span_blocks = span_block_counts(blocks, p)  # realm.span_min/max_other_blocks: the queries REALM trains on
        self.unmaskable = torch.tensor(sorted({*special.special, special.pad, special.cls, special.sep, special.mask}))

    def document(self, q: RealmQuery, rng: np.random.Generator) -> int:
        answer_block = self.spans is not None and self.p.reader_warmup_doc == "answer_block"
        docs = self.spans.answer_docs(q) if answer_block else set()
        docs = sorted(docs if self.doc_rows is None else docs & self.doc_rows)
        return int(docs[rng.integers(len(docs))]) if docs else q.source_row

    def swap_answer(self, q: RealmQuery, z: list[int], rng: np.random.Generator) -> tuple[RealmQuery, list[int]]:
        """Replace the hidden answer, in x's labels and everywhere in z, by another salient span of the
        corpus with as many tokens. The new fact is in no training block, so the only way to predict
        it is to read z: memorising the training blocks (what a reader does otherwise, reading
        nothing on blocks it has not seen) stops paying."""
        answer = masked_answer(q)
        pool = self.spans.by_len.get(len(answer), []) if self.spans is not None else []  # sorted
        # uniform over the pool without the answer, by index: no per-example copy of a corpus-sized list
        at = bisect.bisect_left(pool, answer)
        skip = at < len(pool) and pool[at] == answer
        if len(pool) - skip == 0:
            return q, z
        i = int(rng.integers(len(pool) - skip))
        new = pool[i + 1 if skip and i >= at else i]
        labels = list(q.labels)
        for pos, t in zip(q.masked_positions, new):
            labels[pos] = t
        n, out, i = len(answer), [], 0
        while i < len(z):
            if tuple(z[i:i + n]) == answer:
                out.extend(new)
                i += n
            else:
                out.append(z[i])
                i += 1
        return dataclasses.replace(q, labels=labels), out

    def examples(self, rows: list[int], rng: np.random.Generator, seed: int = 0) -> list[tuple[RealmQuery, list[int]]]:
        """(query, document tokens) per row that yields a query (`draw_query`: a row that draws none draws again)."""
        out = []
        for r in rows:
            q = draw_query(self.blocks[int(r)], self.p, rng, seed=seed, mask_token_id=self.special.mask, row=int(r),
                           span_blocks=self.span_blocks)
            if q is None:
                continue
            z = [int(t) for t in self.lookup[self.document(q, rng)]["input_ids"]]
            q, z = self.swap_answer(q, z, rng) if rng.random() < self.p.reader_warmup_swap_answer else (q, z)
            if self.p.reader_warmup_doc_len:
                z = cut_around(z, masked_answer(q), self.p.reader_warmup_doc_len)
            out.append((q, z))
        return out

    def mask_more(self, x: torch.Tensor, labels: torch.Tensor, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`reader_warmup_mask_ratio` of x's other (non-special, unmasked) tokens masked too, as targets."""
        ratio = self.p.reader_warmup_mask_ratio
        free = (labels == IGNORE_INDEX) & ~torch.isin(x, self.unmaskable)  # (B, Lx)
        pick = free & torch.from_numpy(rng.random(tuple(x.shape)) < ratio)
        return x.masked_fill(pick, self.special.mask), torch.where(pick, x, labels)

    def __call__(self, rows: list[int], generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        seed = generator.initial_seed() if generator is not None else 0
        rng = np.random.default_rng(seed)
        examples = self.examples(rows, rng, seed)
        if not examples:
            raise empty_batch_error(rows, "realm.reader_warmup")
        slots = np.asarray([[NULL_ROW, i] for i in range(len(examples))], dtype=np.int64).reshape(len(examples), 2)
        # only the reader reads here: no document-tower input (doc_input body)
        batch = collate([q for q, _ in examples], slots, [z for _, z in examples], self.p.model_copy(update={"doc_input": "body"}),
                        self.special)
        x, labels = batch["x_input_ids"], batch["x_labels"]
        if self.p.reader_warmup_mask_ratio:
            x, labels = self.mask_more(x, labels, rng)
        return {"x_input_ids": x, "x_attention_mask": batch["x_attention_mask"], "x_labels": labels,
                "z_input_ids": batch["z_input_ids"][:, 1:], "z_attention_mask": batch["z_attention_mask"][:, 1:]}  # drop the null slot


class ReaderWarmupModel(nn.Module):
    """Masked-token cross-entropy of the knowledge-augmented encoder reading `[CLS] x [SEP] z [SEP]`."""

    def __init__(self, reader: KnowledgeAugmentedEncoder):
        super().__init__()
        self.knowledge_augmented_encoder = reader

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        labels = batch["x_labels"]
        mask_batch, mask_pos = (labels != IGNORE_INDEX).nonzero(as_tuple=True)  # (M,), (M,)
        targets = labels[mask_batch, mask_pos]  # (M,)
        reader = self.knowledge_augmented_encoder
        ids, mask, types = knowledge_augmented_inputs(batch["x_input_ids"], batch["x_attention_mask"], batch["z_input_ids"],
                                                      batch["z_attention_mask"], reader.pad_token_id)  # (B, 1, L)
        log_py = reader.masked_log_probs(ids, mask, types, mask_batch, mask_pos)[:, 0]  # (M, V)
        loss = F.nll_loss(log_py, targets) if targets.numel() else log_py.sum() * 0.0
        return {"loss": loss, "reader_acc": (log_py.argmax(-1) == targets).float().mean().nan_to_num(0.0).detach(),
                "num_tokens": mask.sum().detach()}  # the tokens the reader reads: the progress line's tokens/s


def reader_warmup(reader: KnowledgeAugmentedEncoder, blocks, rows: list[int], params: Params, special: SpecialTokens,
                  out_dir: Path, log_fn: LogFn | None = None) -> dict:
    """Train `reader` in place for `realm.reader_warmup_steps` steps on the `realm.reader_warmup_doc`
    task. The retriever is untouched. `rows` must leave out the held-out blocks; they are also the
    only documents the `answer_block` task reads."""
    p = params.realm
    spans = SalientSpanIndex(blocks, span_tagger_for(p)) if p.reader_warmup_doc == "answer_block" or p.reader_warmup_swap_answer else None
    collator = ReaderWarmupCollator(blocks, p, special, spans, set(rows))
    return run_warmup(ReaderWarmupModel(reader), rows, collator, params, out_dir, log_fn,
                      name="reader_warmup", steps=p.reader_warmup_steps, lr=p.reader_warmup_lr,
                      report=("loss", "reader_acc"))
