"""Stage body of `pretrain_realm`: REALM pre-training with an asynchronously refreshed MIPS index.

    python -m flows.pretrain_realm                                   # one process (the flow)
    torchrun --standalone --nproc_per_node=2 -m components.stages.pretrain_realm   # what the flow
                                                                     # launches when compute.nproc=2

One run, in order (Guu et al. 2020, sec. 3.4; ORQA, Lee et al. 2019, for ICT):

1. `retriever` init (`realm.retriever_init`): `retromae` = towers from models/retromae/encoder;
   `ict` = random towers; `random`. For `retromae` and `ict`, then `realm.ict_steps` of the Inverse
   Cloze Task (a sentence vs its block, in-batch negatives, the sentence removed from the block
   with probability `ict_mask_rate`): REALM's own warm start, here on top of RetroMAE's. The
   `knowledge_augmented_encoder` starts from models/retromae/encoder (masked-LM weights) when it
   exists, else random; `realm.reader_warmup_steps` then train it alone to read (`ReaderWarmupCollator`:
   another block stating x's hidden fact, the answer swapped for a random span half the time).
   REALM's reader is pre-trained BERT, which already reads; ours has had a minute of RetroMAE.
   Neither warm-up sees the held-out blocks.
2. Training examples: `make_query` (salient-span masking) over the retrieval blocks. The collate
   embeds each batch's queries with the live query tower and searches the CURRENT index (slot 0 =
   `null_document`, the source block excluded); REALM.forward rescores the K candidates with
   gradients into both towers.
3. `refresh_index(snapshot, step) -> version` every `realm.refresh_every` steps: snapshot the
   retriever at the step boundary, re-embed every block with `passage_inputs` (the exact input
   REALM's rescoring sees), build the index, publish it to an `IndexStore` in the checkpoint
   folder, and swap it in at a later step boundary. `refresh_mode: async` builds in a background
   thread while training continues on the old index (why a thread: components/index/refresh.py).
   Each refresh is an MLflow child run (step, version, seconds, blocks/s, tokens/s, index size,
   staleness, probe recall) and, under the Prefect flow, a `refresh_index` subflow.
4. At the end: wait for an in-flight refresh, rebuild from the final weights when the current
   index is older than the last step, and write models/realm/ (retriever/,
   knowledge_augmented_encoder/, index/first/, index/final/, model_card.md, realm_config.json),
   metrics/pretrain_realm.json and plots/realm_refresh.csv.

Probe quality over time, with the snapshot's query tower against each new index (`run_probes`):
* `recall_at_k` / `mean_rank` (MLflow `probe_*`): the dev questions (data/corpus/beir), doc level;
  without dev questions, the held-out set below.
* `heldout_recall_at_k` / `heldout_mean_rank`: fixed masked queries (one per distinct span among
  `realm.heldout_draws` draws) of `realm.heldout_queries` blocks that never give a training query;
  gold = the OTHER blocks that contain the masked answer (what REALM's reader can use), the
  query's own block left out of the ranking as in training.
  Also the held-out masked-token accuracy at step 0 and at the end (`eval_mlm_acc*`).
* `heldout_entity_recall_at_k` / `heldout_entity_mean_rank`: the same queries, gold = those blocks
  that also name one of x's other salient spans (the gold *document*: about what x is about, and
  holding the answer), not a block that mentions the same value in passing.
Staleness: overlap@k of the top-k for `staleness_probes` fixed training queries under the previous
index vs the new one. `refresh_every: 0` never refreshes during training (the stale-index ablation,
bench/realm_refresh_ablation.py); the final index is still rebuilt from the final weights.

Multi-process (torchrun): every rank builds the same index itself from its (DDP-identical) weights;
only rank 0 publishes, logs and probes. Chosen over "rank 0 builds, the others load": that needs a
filesystem shared by all nodes plus polling or a barrier, and sharding the embedding over ranks
would need collectives from the refresh thread, which would race DDP's all-reduces on the same
process group. Ranks run in parallel, so the wall time of a refresh is the same either way.

Resume: the shared Trainer restores weights/optimizer/RNG; `on_train_start` then removes any
half-written index (`cleanup_partial`) and builds a new version from the RESUMED weights, so an
index from a killed run is never used. In async mode the step at which a new index lands depends
on timing, so batches (not the loss trajectory's statistics) can differ between runs; sync mode is
deterministic.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import csv
import dataclasses
import io
import json
import logging
import os
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from components.config import Params, RealmParams
from components.data.realm_batch import (
    IGNORE_INDEX, NULL_ROW, RealmQuery, SpecialTokens, build_batch, collate, collate_queries, make_query, passage_inputs,
    salient_token_spans,
)
from components.index.faiss_index import BlockIndex, IndexStore, resolve_index_type
from components.index.refresh import AsyncRefresher, RefreshResult, embed_blocks, snapshot_module, staleness
from components.io import atomic_dir, write_json_atomic, write_text_atomic
from components.models.realm import REALM, REALM_CONFIG, KnowledgeAugmentedEncoder, Retriever, knowledge_augmented_inputs
from components.stages.common import RankZeroLogger, checkpoint_dir, torchrun_worker, write_stage_metrics
from components.training import distributed as D
from components.training.trainer import Trainer

log = logging.getLogger(__name__)

STAGE = "pretrain_realm"
TOKENS = Path("data/tokens")
CORPUS = Path("data/corpus")
RETROMAE_ENCODER = Path("models/retromae/encoder")
OUT = Path("models/realm")
METRICS_FILE = Path("metrics") / f"{STAGE}.json"
PLOT_FILE = Path("plots/realm_refresh.csv")
PLOT_COLUMNS = ["step", "version", "recall_at_k", "mean_rank", "heldout_recall_at_k", "heldout_mean_rank",
                "heldout_entity_recall_at_k", "heldout_entity_mean_rank", "staleness",
                "refresh_seconds", "reason",
                "swap_step", "blocks_per_s", "tokens_per_s", "index_size"]
RANK_DEPTH = 1000  # mean gold rank is exact up to this depth; a gold doc not found counts as depth + 1

# body(tags=None) -> dict; a wrapper runs it (e.g. as a Prefect subflow) and returns its result.
RefreshWrapper = Callable[..., dict]


def plain_wrapper(body: Callable[..., dict], *, step: int, reason: str) -> dict:
    """The refresh wrapper without an orchestrator (tests, torchrun ranks)."""
    return body()


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------
def _rows_of(batch_cols: dict) -> list[dict]:
    names = list(batch_cols)
    return [dict(zip(names, vals)) for vals in zip(*(batch_cols[c] for c in names))]


def _iter_block_rows(blocks, columns: list[str], batch: int = 1000):
    sub = blocks.select_columns(columns)
    for start in range(0, len(sub), batch):
        for i, row in enumerate(_rows_of(sub[start:start + batch])):
            yield start + i, row


def eligible_rows(blocks, p: RealmParams, mask_token_id: int, seed: int) -> list[int]:
    """Rows for which `make_query` yields a query (salient-span mode: the block has a usable span)."""
    cols = [c for c in ("input_ids", "word_ids", "offsets", "char_spans", "text", "block_id") if c in blocks.column_names]
    rng = np.random.default_rng(seed)
    return [r for r, row in _iter_block_rows(blocks, cols) if make_query(row, p, rng, mask_token_id=mask_token_id, row=r)]


def fixed_queries(blocks, rows: list[int], p: RealmParams, special: SpecialTokens, seed: int,
                  draws: int = 1) -> list[RealmQuery]:
    """Masked queries per row, the same for a given seed (probes and held-out evaluation): `draws`
    masks drawn per row, of which the distinct answers are kept (one query per span)."""
    rng = np.random.default_rng(seed)
    out = []
    for r in rows:
        seen: set[tuple[int, ...]] = set()
        for _ in range(draws):
            q = make_query(blocks[int(r)], p, rng, mask_token_id=special.mask, row=int(r))
            if q is not None and (answer := masked_answer(q)) not in seen:
                seen.add(answer)
                out.append(q)
    return out


@dataclass
class Probes:
    """Recall probes: query inputs `[CLS] q [SEP]`, the gold keys of each, and per query the row to
    leave out of its ranking (a held-out masked query's own block: REALM never retrieves it either)."""

    kind: str  # "dev_questions" | "heldout_masked"
    x: dict[str, torch.Tensor]  # x_input_ids, x_attention_mask (Q, Lx)
    gold: list[set[str]]  # doc ids (level "doc") or block ids (level "block")
    level: str = "doc"  # "doc" | "block": which key of a retrieved row is matched against `gold`
    exclude: list[int] | None = None  # (Q,) row left out of each query's ranking; None: none

    def __len__(self) -> int:
        return len(self.gold)


def dev_question_probes(corpus_dir: Path, tokenizer, p: RealmParams, special: SpecialTokens, doc_ids: set[str]) -> Probes | None:
    """data/corpus/beir/{queries.jsonl, qrels/dev.tsv} -> Probes; None when absent or empty."""
    qfile, qrels = corpus_dir / "beir" / "queries.jsonl", corpus_dir / "beir" / "qrels" / "dev.tsv"
    if not (qfile.is_file() and qrels.is_file()):
        return None
    gold: dict[str, set[str]] = {}
    for line in qrels.read_text(encoding="utf-8").splitlines()[1:]:
        parts = line.split("\t")
        if len(parts) >= 3 and float(parts[2]) > 0 and parts[1] in doc_ids:
            gold.setdefault(parts[0], set()).add(parts[1])
    texts = {}
    for line in qfile.read_text(encoding="utf-8").splitlines():
        if line.strip():
            q = json.loads(line)
            if q["_id"] in gold:
                texts[q["_id"]] = q["text"]
    qids = sorted(texts)
    if not qids:
        return None
    ids = tokenizer([texts[q] for q in qids], add_special_tokens=False)["input_ids"]
    queries = [RealmQuery(input_ids=list(t)[: p.query_len - 2], labels=[IGNORE_INDEX] * len(list(t)[: p.query_len - 2]), source_row=-1)
               for t in ids]
    x = collate_queries(queries, p, special)
    return Probes("dev_questions", {k: x[k] for k in ("x_input_ids", "x_attention_mask")}, [gold[q] for q in qids])


def masked_answer(q: RealmQuery) -> tuple[int, ...]:
    """The token ids hidden in x, in order (a contiguous span in the span masking modes)."""
    return tuple(int(q.labels[i]) for i in q.masked_positions)


def _contains(hay: list[int], needle: tuple[int, ...]) -> bool:
    n = len(needle)
    return any(tuple(hay[i:i + n]) == needle for i in range(len(hay) - n + 1))


def answer_blocks(queries: list[RealmQuery], block_tokens) -> list[set[int]]:  # block_tokens: Dataset or [{input_ids}]
    """Per query, the rows other than its source block whose tokens contain the masked answer
    (DPR's "answer in passage" relevance): the documents that can tell the reader the answer.

    One pass over the blocks; only blocks holding a needle's first token are checked in full."""
    needles = [masked_answer(q) for q in queries]
    first = {n[0] for n in needles if n}
    by_first: dict[int, list[int]] = {t: [] for t in first}
    tokens: dict[int, list[int]] = {}
    rows = _iter_block_rows(block_tokens, ["input_ids"]) if hasattr(block_tokens, "select_columns") else enumerate(block_tokens)
    for r, row in rows:
        ids = [int(t) for t in row["input_ids"]]
        hit = first.intersection(ids)
        for t in hit:
            by_first[t].append(r)
        if hit:
            tokens[r] = ids
    return [{r for r in by_first.get(n[0], []) if r != q.source_row and _contains(tokens[r], n)} if n else set()
            for q, n in zip(queries, needles)]


def block_spans(block_row: dict, tagger: str = "auto") -> set[tuple[int, ...]]:
    """The token sequences of a block's salient spans."""
    ids = [int(t) for t in block_row["input_ids"]]
    return {tuple(ids[s:e]) for s, e in salient_token_spans(block_row, tagger) if e > s}


def unmasked_spans(q: RealmQuery, spans: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Of x's source-block `spans`, those x shows unmasked (its entities / dates other than the
    answer): what x is about."""
    answer = masked_answer(q)
    return sorted(sp for sp in spans if sp != answer and _contains(q.input_ids, sp))


def context_spans(q: RealmQuery, block_row: dict, tagger: str = "auto") -> list[tuple[int, ...]]:
    """`unmasked_spans` of x's source block `block_row`."""
    return unmasked_spans(q, block_spans(block_row, tagger))


def same_entity_gold(queries: list[RealmQuery], gold_rows: list[set[int]], blocks, tagger: str = "auto") -> list[set[int]]:
    """Of each query's `gold_rows` (`answer_blocks`), the blocks that also contain one of x's other
    salient spans (`context_spans`): about what x is about. Without this, a block that mentions the
    same value in passing counts ("known for its trout" of another river); in the synthetic world such
    coincidences are most of the loose gold (5.7 blocks per query, while a fact is stated by at most 2
    documents)."""
    sub = blocks.select_columns([c for c in ("input_ids", "word_ids", "offsets", "char_spans", "text") if c in blocks.column_names])
    tokens: dict[int, list[int]] = {}

    def ids(r: int) -> list[int]:
        if r not in tokens:
            tokens[r] = [int(t) for t in sub[int(r)]["input_ids"]]
        return tokens[r]

    out = []
    for q, gold in zip(queries, gold_rows):
        ctx = context_spans(q, sub[int(q.source_row)], tagger)
        out.append({r for r in gold if any(_contains(ids(r), sp) for sp in ctx)})
    return out


def heldout_probes(queries: list[RealmQuery], blocks, block_ids: np.ndarray, p: RealmParams, special: SpecialTokens,
                   same_entity: bool = False, gold_rows: list[set[int]] | None = None) -> Probes | None:
    """Held-out masked queries -> Probes with block-level gold: the OTHER blocks that contain the
    masked answer (what REALM's retriever is trained to find; the query's own block, of which x
    is a copy, is left out of the ranking as it is left out of training's candidates). Queries
    whose answer is in no other block cannot be helped by retrieval and are dropped.

    `same_entity`: only those that are about what x is about (`same_entity_gold`). `gold_rows`:
    `answer_blocks(queries, blocks)` when the caller already has it (it scans the whole corpus)."""
    gold_rows = answer_blocks(queries, blocks) if gold_rows is None else gold_rows
    if same_entity:
        gold_rows = same_entity_gold(queries, gold_rows, blocks, p.span_tagger)
    keep = [i for i, g in enumerate(gold_rows) if g]
    if not keep:
        return None
    x = collate_queries([queries[i] for i in keep], p, special)
    return Probes("heldout_masked_same_entity" if same_entity else "heldout_masked",
                  {k: x[k] for k in ("x_input_ids", "x_attention_mask")},
                  [{str(block_ids[r]) for r in gold_rows[i]} for i in keep], level="block",
                  exclude=[queries[i].source_row for i in keep])


@torch.inference_mode()
def encode_queries(retriever: Retriever, x: dict[str, torch.Tensor], batch_size: int = 256) -> np.ndarray:
    """Query vectors (Q, d) float32 with the retriever's query tower (eval mode)."""
    dev = next(retriever.parameters()).device
    was = retriever.training
    retriever.eval()
    try:
        ids, mask = x["x_input_ids"], x["x_attention_mask"]
        out = [retriever.encode_query(ids[i:i + batch_size].to(dev), mask[i:i + batch_size].to(dev)).float().cpu()
               for i in range(0, ids.shape[0], batch_size)]
    finally:
        retriever.train(was)
    return torch.cat(out).numpy() if out else np.zeros((0, retriever.retriever_dim), np.float32)


def probe_retrieval(q_vecs: np.ndarray, index: BlockIndex, gold: list[set[str]], keys: np.ndarray, k: int,
                    exclude: list[int] | None = None) -> dict[str, float]:
    """recall@k and mean rank of the first gold block (1-based; misses count RANK_DEPTH+1).

    `keys[row]` is what a retrieved row is matched against `gold` (doc ids, or block ids);
    `exclude[i]` (a row, or -1) is left out of query i's ranking."""
    if len(gold) == 0:
        return {}
    depth = min(len(index), max(k, RANK_DEPTH))
    extra = 1 if exclude is not None else 0
    _, rows = index.search(q_vecs, min(len(index), depth + extra))  # (Q, depth [+1])
    ranks = []
    for i, (row, g) in enumerate(zip(rows, gold)):
        row = row[row >= 0]
        if exclude is not None:
            row = row[row != exclude[i]]
        hit = np.flatnonzero(np.isin(keys[row[:depth]], list(g)))
        ranks.append(int(hit[0]) + 1 if hit.size else depth + 1)
    ranks = np.asarray(ranks, dtype=np.float64)
    return {"recall_at_k": float((ranks <= k).mean()), "mean_rank": float(ranks.mean())}


def run_probes(retriever: Retriever, index: BlockIndex, probes: dict[str, "Probes"], block_ids: np.ndarray,
               block_doc: np.ndarray, k: int) -> dict[str, float]:
    """Every probe set against `index`: `{prefix}recall_at_k`, `{prefix}mean_rank` (prefix "" for
    the main probe set, "heldout_" for the held-out masked queries)."""
    out: dict[str, float] = {}
    for prefix, pr in probes.items():
        if pr is None or not len(pr):
            continue
        q = encode_queries(retriever, pr.x)
        keys = block_doc if pr.level == "doc" else block_ids
        out.update({prefix + m: v for m, v in probe_retrieval(q, index, pr.gold, keys, k, pr.exclude).items()})
    return out


# ----------------------------------------------------------------------------------------------
# Inverse Cloze Task warm-up (ORQA): a sentence is a pseudo-query for its own context block
# ----------------------------------------------------------------------------------------------
_SENTENCE = re.compile(r"[^.!?]+(?:[.!?]+|$)")


def sentence_token_spans(text: str, offsets) -> list[tuple[int, int]]:
    """[start, end) token ranges of the block's sentences (tokens assigned by their char start)."""
    starts = np.asarray([int(o[0]) for o in offsets], dtype=np.int64)
    spans = []
    for m in _SENTENCE.finditer(text or ""):
        idx = np.flatnonzero((starts >= m.start()) & (starts < m.end()))
        if idx.size:
            spans.append((int(idx[0]), int(idx[-1]) + 1))
    return spans


class ICTCollator:
    """rows (block row numbers) -> `{q_*, d_*}`: a random sentence of each block as the query, the
    block as the context, minus that sentence with probability `mask_rate` (ORQA keeps it 10% of
    the time so the retriever still learns lexical overlap)."""

    def __init__(self, blocks, p: RealmParams, special: SpecialTokens, mask_rate: float):
        self.blocks, self.p, self.special, self.mask_rate = blocks, p, special, mask_rate

    def __call__(self, rows: list[int], generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng(generator.initial_seed() if generator is not None else 0)
        queries, contexts = [], []
        for r in rows:
            b = self.blocks[int(r)]
            ids = [int(t) for t in b["input_ids"]]
            spans = sentence_token_spans(b["text"], b["offsets"])
            s, e = spans[rng.integers(len(spans))]
            q = ids[s:e][: self.p.query_len - 2]
            queries.append(RealmQuery(q, [IGNORE_INDEX] * len(q), source_row=int(r)))
            contexts.append(ids[:s] + ids[e:] if rng.random() < self.mask_rate else ids)
        x = collate_queries(queries, self.p, self.special)
        d = passage_inputs(contexts, self.p, self.special)
        return {"q_input_ids": x["x_input_ids"], "q_attention_mask": x["x_attention_mask"],
                "d_input_ids": d["input_ids"], "d_attention_mask": d["attention_mask"]}


class ICTModel(nn.Module):
    """Softmax over the in-batch contexts: loss = CE(q . d^T, diagonal)."""

    def __init__(self, retriever: Retriever):
        super().__init__()
        self.retriever = retriever

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        q = self.retriever.encode_query(batch["q_input_ids"], batch["q_attention_mask"])  # (B, d)
        d = self.retriever.encode_passage(batch["d_input_ids"], batch["d_attention_mask"])  # (B, d)
        with torch.autocast(device_type=q.device.type, enabled=False):
            scores = q.float() @ d.float().T  # (B, B)
        target = torch.arange(scores.shape[0], device=scores.device)
        loss = F.cross_entropy(scores, target)
        return {"loss": loss, "ict_acc": (scores.argmax(-1) == target).float().mean().detach()}


def ict_eligible_rows(blocks) -> list[int]:
    """Blocks with at least two sentences (one to ask, the rest as context)."""
    return [r for r, row in _iter_block_rows(blocks, ["text", "offsets"]) if len(sentence_token_spans(row["text"], row["offsets"])) >= 2]


def ict_warmup(retriever: Retriever, blocks, params: Params, special: SpecialTokens, out_dir: Path, run=None,
               exclude: set[int] = frozenset()) -> dict:
    """Train `retriever` in place with ICT for `realm.ict_steps` steps (resumable, own checkpoints),
    on every block with two sentences except the rows in `exclude` (the held-out blocks)."""
    p = params.realm
    rows = [r for r in ict_eligible_rows(blocks) if r not in exclude]
    if len(rows) < p.ict_batch_size:
        raise ValueError(f"ICT needs at least realm.ict_batch_size={p.ict_batch_size} blocks with two sentences "
                         f"(held-out blocks excluded); found {len(rows)}: lower realm.ict_batch_size or set realm.ict_steps to 0")
    return run_warmup(ICTModel(retriever), rows, ICTCollator(blocks, p, special, p.ict_mask_rate), params, out_dir, run,
                      name="ict", steps=p.ict_steps, lr=p.ict_lr, batch_size=p.ict_batch_size, report=("loss", "ict_acc"))


def run_warmup(model: nn.Module, rows: list[int], collator, params: Params, out_dir: Path, run=None, *, name: str,
               steps: int, lr: float, batch_size: int, report: tuple[str, ...]) -> dict:
    """One warm-up before REALM on the shared Trainer (resumable, own checkpoints in `out_dir`, the
    rest of `realm.train` for the other knobs), its metrics logged as `{name}_*`. Returns
    `{name}_steps` and `{name}_final_<m>` for each metric m in `report`."""
    p = params.realm
    train = p.train.model_copy(update={"max_steps": steps, "lr": lr, "batch_size": batch_size,
                                       "checkpoint_every": max(1, min(p.train.checkpoint_every, steps))})
    logger = RankZeroLogger(run)
    trainer = Trainer(model, rows, collator, train, params.compute, out_dir,
                      log_fn=lambda m, s: logger({f"{name}_{k}": v for k, v in m.items()}, s),
                      log_every=params.tracking.log_every, param_prefix=f"realm.{name}", progress=False)
    result = trainer.fit()
    return {f"{name}_steps": result.step, **{f"{name}_final_{k}": v for k, v in result.metrics.items() if k in report}}


# ----------------------------------------------------------------------------------------------
# reader warm-up (realm.reader_warmup_steps)
# ----------------------------------------------------------------------------------------------
class SalientSpanIndex:
    """Which blocks hold which salient span (as token ids), from one pass over the corpus: finds, for
    a masked query, the blocks that state its answer about the same thing (`answer_docs`).

    Memory is one entry per (block, distinct salient span), the cost of one `eligible_rows` pass;
    a lookup intersects short posting lists, never scans the corpus."""

    def __init__(self, blocks, tagger: str = "auto"):
        cols = [c for c in ("input_ids", "word_ids", "offsets", "char_spans", "text") if c in blocks.column_names]
        self.spans_of: dict[int, set[tuple[int, ...]]] = {}
        self.rows_of: dict[tuple[int, ...], set[int]] = {}
        for r, row in _iter_block_rows(blocks, cols):
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


class ReaderWarmupCollator:
    """rows -> one REALM query per row with one document: `x_*` (B, Lx) and `z_*` (B, 1, Lz).

    `own_block`: z is x's own block, which holds x unmasked, so the task is to find x's context in z
    and copy the hidden span. `answer_block`: z is another block that states the hidden fact
    (`SalientSpanIndex.answer_docs`, drawn among `doc_rows`), in other words and order, so the
    reader must match x's subject and relation, not its surface; x's own block when there is none.
    With probability `reader_warmup_swap_answer` the answer is then swapped for a random salient span
    (`swap_answer`), so that reading z is the only way to predict it.
    Reading is the skill REALM's BERT reader starts with and a small encoder pre-trained for minutes
    on one CPU lacks (bench/realm_toy.py: without it the retriever only learns noise)."""

    def __init__(self, blocks, p: RealmParams, special: SpecialTokens, spans: SalientSpanIndex | None = None,
                 doc_rows: set[int] | None = None):
        self.blocks, self.lookup, self.p, self.special = blocks, blocks.select_columns(["input_ids"]), p, special
        self.spans, self.doc_rows = spans, doc_rows

    def document(self, q: RealmQuery, rng: np.random.Generator) -> int:
        answer_block = self.spans is not None and self.p.reader_warmup_doc == "answer_block"
        docs = self.spans.answer_docs(q) if answer_block else set()
        docs = sorted(docs if self.doc_rows is None else docs & self.doc_rows)
        return int(docs[rng.integers(len(docs))]) if docs else q.source_row

    def swap_answer(self, q: RealmQuery, z: list[int], rng: np.random.Generator) -> tuple[RealmQuery, list[int]]:
        """Replace the hidden answer, in x's labels and everywhere in z, by another salient span of the
        corpus with as many tokens. The new fact is in no training block, so the only way to predict
        it is to read z: memorising the ~200 training blocks (what a reader does otherwise, reading
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

    def examples(self, rows: list[int], rng: np.random.Generator) -> list[tuple[RealmQuery, list[int]]]:
        """(query, document tokens) per row that yields a query."""
        out = []
        for r in rows:
            q = make_query(self.blocks[int(r)], self.p, rng, mask_token_id=self.special.mask, row=int(r))
            if q is None:
                continue
            z = [int(t) for t in self.lookup[self.document(q, rng)]["input_ids"]]
            out.append(self.swap_answer(q, z, rng) if rng.random() < self.p.reader_warmup_swap_answer else (q, z))
        return out

    def __call__(self, rows: list[int], generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng(generator.initial_seed() if generator is not None else 0)
        examples = self.examples(rows, rng)
        slots = np.asarray([[NULL_ROW, i] for i in range(len(examples))], dtype=np.int64).reshape(len(examples), 2)
        batch = collate([q for q, _ in examples], slots, [z for _, z in examples], self.p, self.special)
        return {**{k: batch[k] for k in ("x_input_ids", "x_attention_mask", "x_labels")},
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
        return {"loss": loss, "reader_acc": (log_py.argmax(-1) == targets).float().mean().nan_to_num(0.0).detach()}


def reader_warmup(reader: KnowledgeAugmentedEncoder, blocks, rows: list[int], params: Params, special: SpecialTokens,
                  out_dir: Path, run=None) -> dict:
    """Train `reader` in place for `realm.reader_warmup_steps` steps on the `realm.reader_warmup_doc`
    task (resumable, own checkpoints). The retriever is untouched. `rows` must leave out the held-out
    blocks; they are also the only documents the `answer_block` task reads."""
    p = params.realm
    spans = SalientSpanIndex(blocks, p.span_tagger) if p.reader_warmup_doc == "answer_block" or p.reader_warmup_swap_answer else None
    collator = ReaderWarmupCollator(blocks, p, special, spans, set(rows))
    return run_warmup(ReaderWarmupModel(reader), rows, collator, params, out_dir, run,
                      name="reader_warmup", steps=p.reader_warmup_steps, lr=p.reader_warmup_lr,
                      batch_size=p.reader_warmup_batch_size, report=("loss", "reader_acc"))


# ----------------------------------------------------------------------------------------------
# REALM training data
# ----------------------------------------------------------------------------------------------
class RealmCollator:
    """rows (block row numbers) -> the batch REALM.forward takes, retrieving from the CURRENT index.

    Called by the Trainer in the training thread (`num_workers` must be 0: a worker process would
    search a copy of the index that never sees a swap). Masks are drawn from the Trainer's
    per-(step, micro-batch) generator, so a resumed run draws the same masks.
    """

    def __init__(self, blocks, p: RealmParams, special: SpecialTokens, retriever: Retriever, store: IndexStore):
        self.blocks = blocks
        self.lookup = blocks.select_columns(["input_ids"])
        self.p, self.special, self.retriever, self.store = p, special, retriever, store

    def queries(self, rows: list[int], rng: np.random.Generator) -> list[RealmQuery]:
        out = []
        for r in rows:
            q = make_query(self.blocks[int(r)], self.p, rng, mask_token_id=self.special.mask, row=int(r))
            if q is not None:  # eligible rows always give one in salient-span mode
                out.append(q)
        return out

    def batch(self, queries: list[RealmQuery], index_search=None, retriever: Retriever | None = None) -> dict[str, torch.Tensor]:
        retriever = retriever or self.retriever
        device = next(retriever.parameters()).device
        return build_batch(queries, retriever, index_search or self.store.search, self.lookup, self.p, self.special, device)

    def __call__(self, rows: list[int], generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng(generator.initial_seed() if generator is not None else 0)
        return self.batch(self.queries(rows, rng))


@torch.no_grad()
def evaluate_mlm(model: REALM, collator: RealmCollator, queries: list[RealmQuery], index: BlockIndex,
                 batch_size: int = 16) -> dict[str, float]:
    """Masked-token accuracy / loss of the marginal p(y|x) on fixed queries against `index` (eval mode)."""
    if not queries:
        return {}
    was = model.training
    model.eval()
    acc = loss = n = 0.0
    try:
        for i in range(0, len(queries), batch_size):
            batch = collator.batch(queries[i:i + batch_size], index.search, model.retriever)
            dev = next(model.parameters()).device
            out = model({k: v.to(dev) for k, v in batch.items()})
            m = float(out["num_tokens"])
            acc, loss, n = acc + float(out["mlm_acc"]) * m, loss + float(out["loss"]) * m, n + m
    finally:
        model.train(was)
    return {"mlm_acc": acc / max(n, 1), "loss": loss / max(n, 1), "tokens": n}


# ----------------------------------------------------------------------------------------------
# refresh_index
# ----------------------------------------------------------------------------------------------
@dataclass
class RefreshContext:
    """What every refresh needs, fixed for the run."""

    blocks: Any  # HF dataset of the retrieval blocks (input_ids used)
    block_ids: np.ndarray  # (N,) block id per row (the index ids)
    block_doc: np.ndarray  # (N,) doc id per row (dev-question gold is doc-level)
    p: RealmParams
    special: SpecialTokens
    probes: dict[str, Probes | None]  # metric prefix -> probe set ("" main, "heldout_" masked queries)
    staleness_x: dict[str, torch.Tensor]  # fixed training queries for overlap@k
    amp_dtype: torch.dtype | None = None


class IndexRefresh:
    """Owns the index during training: the initial build, the cadence (AsyncRefresher), the swap at
    step boundaries, failure handling, the per-refresh records and the final build.

    `embed_blocks` / `BlockIndex.build` are looked up at call time (module globals), so a test can
    inject a failing embed.
    """

    def __init__(self, ctx: RefreshContext, store: IndexStore, *, run=None, wrapper: RefreshWrapper | None = None,
                 history_path: Path | None = None, rank0: bool = True):
        self.ctx, self.store, self.run, self.rank0 = ctx, store, run, rank0
        self.wrapper = wrapper or plain_wrapper
        self.history_path = history_path
        self.history: list[dict] = []
        self.refresher: AsyncRefresher | None = None
        self._prefect_ctx: contextvars.Context | None = None
        # The index the next batch searches. Assigned only in the training thread at a step boundary;
        # the refresh thread only reads it (for staleness), so no lock is needed.
        self.active: BlockIndex | None = None
        self.train_index: BlockIndex | None = None  # what training used last, before any final rebuild

    # -- history (survives a resume) ---------------------------------------------------------
    def load_history(self, resumed_step: int) -> None:
        if self.history_path is not None and self.history_path.is_file():
            rows = json.loads(self.history_path.read_text())
            self.history = [r for r in rows if r["step"] <= resumed_step and r.get("reason") != "final"]

    def _record(self, row: dict) -> None:
        self.history.append(row)
        if self.history_path is not None and self.rank0:
            write_json_atomic(self.history_path, self.history)

    # -- the refresh body ----------------------------------------------------------------------
    def refresh_index(self, retriever: Retriever, step: int, reason: str = "cadence") -> tuple[BlockIndex, dict]:
        """refresh_index(snapshot, step) -> (index, stats); the new version is `stats["version"]`
        (and the index's meta). Embed -> build -> staleness/probes -> publish. Runs in the refresh
        thread (async) or the training thread (sync/initial/final), through the wrapper (a Prefect
        subflow under the flow), inside the context captured on the training thread."""
        holder: dict = {}

        def body(tags: dict | None = None) -> dict:
            holder["index"], stats = self._build(retriever, step, reason, tags)
            return stats

        ctx = self._prefect_ctx or contextvars.copy_context()
        self._prefect_ctx = None
        stats = ctx.run(self.wrapper, body, step=step, reason=reason)
        return holder["index"], stats

    def _build(self, retriever: Retriever, step: int, reason: str, tags: dict | None) -> tuple[BlockIndex, dict]:
        c = self.ctx
        t0 = time.perf_counter()  # wall time of the whole refresh, tracking included
        child = None
        if self.run is not None and self.rank0:
            child = self.run.child("refresh_index", tags={"rr.refresh_reason": reason, **(tags or {})})
        with child if child is not None else contextlib.nullcontext():
            dev = next(retriever.parameters()).device
            amp = (torch.autocast(device_type=dev.type, dtype=c.amp_dtype) if c.amp_dtype is not None else contextlib.nullcontext())

            def encode(batch):
                return retriever.encode_passage(batch["input_ids"].to(dev), batch["attention_mask"].to(dev))

            with amp:
                emb, st = embed_blocks(encode, c.blocks, c.p.embed_batch_size,
                                       lambda rows: passage_inputs([r["input_ids"] for r in rows], c.p, c.special), progress=False)
            kind = resolve_index_type(len(emb), c.p.index_type, c.p.index_auto_flat_max)
            index = BlockIndex.build(emb, c.block_ids, kind, step=step, auto_flat_max=c.p.index_auto_flat_max)
            stats: dict[str, Any] = {"step": step, "reason": reason, "index_size": len(index), "index_type": index.index_type,
                                     "embed_seconds": st["seconds"], "build_seconds": index.meta["build_seconds"],
                                     "blocks_per_s": st["blocks_per_s"], "tokens_per_s": st["tokens_per_s"], "n_tokens": st["n_tokens"]}
            if self.rank0:
                old = self.active
                if old is not None:
                    stats["staleness"] = staleness(encode_queries(retriever, c.staleness_x), old, index, c.p.staleness_k)
                    stats["previous_version"] = old.version
                stats.update(run_probes(retriever, index, c.probes, c.block_ids, c.block_doc, c.p.staleness_k))
                version = self.store.publish(index, step=step, extra_meta={"reason": reason}, make_current=False)
                self.store.prune(keep_last=2, keep_first=True)
                index = index.with_meta(version=version, step=step)
                stats["version"] = version
                stats["index_bytes"] = sum(f.stat().st_size for f in self.store.path(version).iterdir() if f.is_file())
            stats["refresh_seconds"] = time.perf_counter() - t0
            if child is not None:
                child.set_tags({"rr.index_version": stats.get("version"), "rr.index_type": index.index_type})
                child.log_metrics_now({k: float(v) for k, v in stats.items() if isinstance(v, (int, float)) and v is not None}, step=step)
        return index, stats

    # -- delivering ----------------------------------------------------------------------------
    def _swap(self, index: BlockIndex, stats: dict, swap_step: int) -> None:
        """At a step boundary, in the training thread: the next batch searches `index`."""
        self.store.swap(index)
        self.active = index
        row = {k: stats.get(k) for k in PLOT_COLUMNS if k in stats}
        row.update(ok=True, swap_step=swap_step, version=stats.get("version"))
        self._record(row)
        if self.run is not None and self.rank0:
            names = {"recall_at_k": "probe_recall_at_k", "mean_rank": "probe_mean_rank", "staleness": "staleness",
                     "heldout_recall_at_k": "heldout_recall_at_k", "heldout_mean_rank": "heldout_mean_rank",
                     "heldout_entity_recall_at_k": "heldout_entity_recall_at_k", "heldout_entity_mean_rank": "heldout_entity_mean_rank",
                     "refresh_seconds": "refresh_seconds"}
            m = {names[k]: float(stats[k]) for k in names if stats.get(k) is not None}
            m["refresh_version"] = float(stats.get("version") or 0)
            self.run.log_metrics(m, stats["step"])
        log.log(logging.INFO if self.rank0 else logging.DEBUG,
                "refresh_index %s: step %d -> v%s in %.2fs (swapped in after step %d) recall@%d=%s heldout=%s "
                "heldout_entity=%s staleness=%s", stats["reason"], stats["step"], stats.get("version"), stats["refresh_seconds"],
                swap_step, self.ctx.p.staleness_k, _fmt(stats.get("recall_at_k")), _fmt(stats.get("heldout_recall_at_k")),
                _fmt(stats.get("heldout_entity_recall_at_k")), _fmt(stats.get("staleness")))

    def _on_done(self, res: RefreshResult) -> None:
        self._swap(res.index, res.stats, res.swap_step if res.swap_step is not None else res.step)

    def _on_error(self, exc: BaseException, step: int) -> None:
        # Training keeps the old index; AsyncRefresher retries at the next cadence step.
        log.warning("refresh_index at step %d failed; training continues on index v%s and retries at the next cadence: %s\n%s",
                    step, getattr(self.active, "version", None), exc,
                    "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]))
        self._record({"step": step, "ok": False, "reason": "cadence", "error": f"{type(exc).__name__}: {exc}"})
        if self.run is not None and self.rank0:
            self.run.log_metrics({"refresh_failed": 1.0}, step)

    # -- trainer hooks -------------------------------------------------------------------------
    def on_train_start(self, step: int, trainer: Trainer) -> None:
        """Initial index, always from the weights training starts with (fresh or resumed)."""
        if self.rank0:
            removed = self.store.cleanup_partial()
            if removed:
                log.warning("removed %d half-written index folder(s) from a killed run: %s", len(removed), [p.name for p in removed])
        self.load_history(step)
        retriever = trainer.raw_model.retriever
        index, stats = self.refresh_index(snapshot_module(retriever), step, "initial")
        self._swap(index, stats, step)
        every = self.ctx.p.refresh_every
        self.refresher = AsyncRefresher(
            lambda snap, s: self.refresh_index(snap, s, "cadence"), on_done=self._on_done, on_error=self._on_error,
            every=every, mode=self.ctx.p.refresh_mode,
            start_step=step - step % every if every else step,  # keep the cadence grid across a resume
        )

    def on_step_end(self, step: int, trainer: Trainer) -> None:
        used = self.active  # the index this step's batch was retrieved from
        if self.run is not None and self.rank0:
            self.run.log_metrics({"index_version": float(used.version or 0), "index_lag": float(step - (used.step or 0))}, step)
        r = self.refresher
        r.poll(step)  # a finished async build is swapped in here, between two steps
        if r.due(step):
            # Captured here, on the training thread: the refresh thread runs the subflow inside this
            # context, so Prefect sees the stage's flow/task run as the parent (a true subflow).
            self._prefect_ctx = contextvars.copy_context()
            if r.maybe_start(step, trainer.raw_model.retriever) and r.mode == "sync":
                r.poll(step)  # sync: built inline; swap it in at this same boundary

    def finish(self, trainer: Trainer) -> dict:
        """Deliver an in-flight build, then make sure the final index embeds the final weights."""
        step = trainer.step
        if self.refresher is not None:
            self.refresher.wait(step=step)
            self.refresher.close()
        self.train_index = self.active
        if self.rank0 and self.train_index.step != step:  # only rank 0 saves it; the other ranks are done
            index, stats = self.refresh_index(snapshot_module(trainer.raw_model.retriever), step, "final")
            self._swap(index, stats, step)
        return self.refresher.timing() if self.refresher is not None else {}

    def close(self) -> None:
        if self.refresher is not None:
            self.refresher.close()

    # -- summaries -----------------------------------------------------------------------------
    @property
    def ok_rows(self) -> list[dict]:
        return [r for r in self.history if r.get("ok")]

    def csv_text(self) -> str:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=PLOT_COLUMNS, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in self.ok_rows:
            w.writerow({k: ("" if r.get(k) is None else (round(r[k], 6) if isinstance(r[k], float) else r[k])) for k in PLOT_COLUMNS})
        return buf.getvalue()


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


# ----------------------------------------------------------------------------------------------
# model construction
# ----------------------------------------------------------------------------------------------
def _encoder_config(params: Params, tokenizer, retromae_dir: Path):
    """The BERT config for random towers / reader: RetroMAE's when it exists (same architecture), else
    built from `retromae.encoder` (the project's one encoder spec)."""
    if (retromae_dir / "config.json").is_file():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(retromae_dir))
    from components.models.retromae import build_encoder

    return build_encoder(params.retromae.encoder, len(tokenizer), tokenizer.pad_token_id, cls_token_id=tokenizer.cls_token_id,
                         sep_token_id=tokenizer.sep_token_id, mask_token_id=tokenizer.mask_token_id).config


def build_model(params: Params, tokenizer, blocks, special: SpecialTokens, ckpt_root: Path, retromae_dir: Path,
                run=None, heldout: set[int] = frozenset()) -> tuple[REALM, dict]:
    """REALM with the retriever per `realm.retriever_init` (+ ICT) and the reader from RetroMAE (else random)."""
    p = params.realm
    torch.manual_seed(params.compute.seed)  # same projection/reader init for every variant of a comparison
    info: dict[str, Any] = {"retriever_init": p.retriever_init}
    has_retromae = (retromae_dir / "config.json").is_file()
    if p.retriever_init == "retromae":
        if not has_retromae:
            raise FileNotFoundError(f"realm.retriever_init=retromae needs {retromae_dir} (run `dvc repro pretrain_retromae`), "
                                    "or set realm.retriever_init to ict or random")
        retriever = Retriever.from_encoder(retromae_dir, p.retriever_dim, p.share_towers)
    else:
        retriever = Retriever.from_config(_encoder_config(params, tokenizer, retromae_dir), p.retriever_dim, p.share_towers)
    if p.retriever_init == "ict" and p.ict_steps == 0:
        log.warning("realm.retriever_init=ict with realm.ict_steps=0: the retriever stays random")
    if p.retriever_init in ("ict", "retromae") and p.ict_steps:
        info.update(ict_warmup(retriever, blocks, params, special, ckpt_root / "ict", run, exclude=heldout))
    if has_retromae:
        reader = KnowledgeAugmentedEncoder.from_pretrained(retromae_dir)
        info["knowledge_augmented_encoder_init"] = "retromae"
    else:
        reader = KnowledgeAugmentedEncoder.from_config(_encoder_config(params, tokenizer, retromae_dir))
        info["knowledge_augmented_encoder_init"] = "random"
    log.info("%s: retriever_init=%s, knowledge_augmented_encoder from %s", STAGE, p.retriever_init,
             retromae_dir if has_retromae else "a random init (no RetroMAE encoder found)")
    return REALM(retriever, reader, p.marginalization), info


# ----------------------------------------------------------------------------------------------
# the stage
# ----------------------------------------------------------------------------------------------
class _Recorder:
    """log_fn for the Trainer: forwards to MLflow (rank 0) and keeps the windows for the summary."""

    def __init__(self, run):
        self.forward = RankZeroLogger(run)
        self.windows: list[tuple[int, dict]] = []

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        self.windows.append((step, dict(metrics)))
        self.forward(metrics, step)

    def tail_mean(self, key: str, max_steps: int, frac: float = 0.1) -> float | None:
        """Mean of `key` over the last `frac` of the steps: less noisy than the last window."""
        lo = max_steps - max(1, int(round(frac * max_steps)))
        vals = [m[key] for s, m in self.windows if s > lo and key in m]
        return float(np.mean(vals)) if vals else None


def _model_card(params: Params, summary: dict, info: dict) -> str:
    p = params.realm
    return "\n".join([
        "# REALM (retriever + knowledge-augmented encoder)", "",
        "Trained by retro-realm (`dvc repro pretrain_realm`): REALM pre-training (Guu et al. 2020) with salient-span",
        f"masking and an index refreshed every {p.refresh_every} steps ({p.refresh_mode}).", "",
        f"- retriever init: `{info['retriever_init']}`; knowledge-augmented encoder init: `{info['knowledge_augmented_encoder_init']}`",
        f"- index: `index/first/` (built at step {summary.get('first_index_step')}), `index/final/` (step {summary.get('step')})",
        f"- probes: {summary.get('probe_set')} (n={summary.get('probe_n')}), recall@{p.staleness_k} = {summary.get('recall_at_k')}", "",
        "## Params", "```json", json.dumps(p.model_dump(mode="json"), indent=2), "```", "",
        "## Summary", "```json", json.dumps(summary, indent=2, default=str), "```", "",
        "## Load", "```python",
        "from components.models.realm import REALM, Retriever",
        "from components.index.faiss_index import BlockIndex",
        'model = REALM.from_pretrained("models/realm")          # retriever + knowledge_augmented_encoder',
        'retriever = Retriever.from_pretrained("models/realm/retriever")',
        'index = BlockIndex.load("models/realm/index/final")',
        "```",
    ]) + "\n"


def train_realm(
    params: Params,
    run=None,
    *,
    refresh_wrapper: RefreshWrapper | None = None,
    tokens_dir: Path = TOKENS,
    corpus_dir: Path = CORPUS,
    retromae_dir: Path = RETROMAE_ENCODER,
    out_dir: Path = OUT,
    metrics_path: Path = METRICS_FILE,
    plot_path: Path = PLOT_FILE,
    log_artifacts: bool = True,
) -> dict:
    """Run the stage; returns the summary also written to `metrics_path` (rank 0).

    `refresh_wrapper(body, step=, reason=) -> dict` runs each `refresh_index` (the flow passes a
    Prefect subflow; default: call `body()`). `realm.heldout_queries` blocks (at most a quarter of
    the eligible ones) never give a training query: their fixed masked queries measure held-out
    masked-token accuracy and held-out recall (`heldout_probes`). They stay in the index: they are
    knowledge, like every block, only not questions.
    """
    import datasets

    from components.data.tokenize import load_tokenizer

    p = params.realm
    tokenizer = load_tokenizer(tokens_dir / "tokenizer")
    special = SpecialTokens.from_tokenizer(tokenizer)
    blocks = datasets.load_from_disk(str(tokens_dir / "blocks"))
    block_ids = np.asarray(blocks["block_id"])
    block_doc = np.asarray(blocks["doc_id"])
    ckpt_root = checkpoint_dir(STAGE, params, ["realm", "retromae"], corpus_dir)
    # The process group must exist before asking for the rank (the Trainer would create it later, too late).
    rank0 = D.init_distributed(params.compute).rank == 0
    if run is not None and rank0:
        run.set_tags({"realm.retriever_init": p.retriever_init, "realm.refresh_mode": p.refresh_mode})

    # examples: eligible blocks, minus a fixed held-out set
    seed = params.compute.seed
    rows = eligible_rows(blocks, p, special.mask, seed)
    rng = np.random.default_rng(seed)
    n_held = min(p.heldout_queries, len(rows) // 4)
    held = sorted(rng.choice(rows, size=n_held, replace=False).tolist()) if n_held else []
    train_rows = sorted(set(rows) - set(held))
    if len(train_rows) < p.train.batch_size:
        raise ValueError(f"only {len(train_rows)} blocks have a salient span to mask, "
                         f"fewer than realm.train.batch_size={p.train.batch_size}")
    held_queries = fixed_queries(blocks, held, p, special, seed + 1, draws=p.heldout_draws)
    stale_rows = rng.choice(train_rows, size=min(p.staleness_probes, len(train_rows)), replace=False).tolist()
    stale_x = collate_queries(fixed_queries(blocks, stale_rows, p, special, seed + 2), p, special)
    held_probes = held_entity = None
    if held_queries:
        answers = answer_blocks(held_queries, blocks)  # one pass over the corpus serves both gold definitions
        held_probes = heldout_probes(held_queries, blocks, block_ids, p, special, gold_rows=answers)
        held_entity = heldout_probes(held_queries, blocks, block_ids, p, special, same_entity=True, gold_rows=answers)
    probes = dev_question_probes(corpus_dir, tokenizer, p, special, set(block_doc.tolist())) or held_probes
    probe_sets = {"": probes, "heldout_": held_probes, "heldout_entity_": held_entity}
    log.info("%s: %d blocks, %d trainable (+%d held out, %d with an answer in another block), probes: %s (%d)", STAGE,
             len(blocks), len(train_rows), len(held), len(held_probes) if held_probes else 0,
             probes.kind if probes else "none", len(probes) if probes else 0)

    model, info = build_model(params, tokenizer, blocks, special, ckpt_root, retromae_dir, run, heldout=set(held))
    if p.reader_warmup_steps:
        info.update(reader_warmup(model.knowledge_augmented_encoder, blocks, train_rows, params, special,
                                  ckpt_root / "reader_warmup", run))
    if run is not None and rank0:
        run.set_tags({"realm.knowledge_augmented_encoder_init": info["knowledge_augmented_encoder_init"],
                      "realm.probe_set": probes.kind if probes else "none"})

    train = p.train
    if train.num_workers:
        log.warning("realm.train.num_workers=%d ignored: the collate searches the live index, which worker processes cannot see",
                    train.num_workers)
        train = train.model_copy(update={"num_workers": 0})
    store = IndexStore(ckpt_root / "index", use_gpu="auto")
    collator = RealmCollator(blocks, p, special, model.retriever, store)
    recorder = _Recorder(run)
    refresh = IndexRefresh(RefreshContext(blocks.select_columns(["input_ids"]), block_ids, block_doc, p, special, probe_sets,
                                          {k: stale_x[k] for k in ("x_input_ids", "x_attention_mask")}),
                           store, run=run, wrapper=refresh_wrapper, history_path=ckpt_root / "refresh_history.json", rank0=rank0)
    ev_start: dict[str, float] = {}

    def on_train_start(step: int, trainer: Trainer) -> None:
        refresh.on_train_start(step, trainer)
        if rank0 and step == 0:  # the start of the curve: held-out accuracy before any update (not on a resume)
            ev_start.update(evaluate_mlm(trainer.raw_model, collator, held_queries, refresh.active))

    trainer = Trainer(model, train_rows, collator, train, params.compute, ckpt_root, log_fn=recorder,
                      hooks={"on_train_start": on_train_start, "on_step_end": refresh.on_step_end},
                      log_every=params.tracking.log_every, param_prefix="realm.train")
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(trainer.precision)
    refresh.ctx.amp_dtype = amp  # index embeddings in the precision REALM's rescoring runs in
    try:
        result = trainer.fit()
        timing = refresh.finish(trainer)
    finally:
        refresh.close()

    summary: dict[str, Any] = {"step": result.step, "resumed_from": result.resumed_from or 0, "bad_steps": result.bad_steps,
                               "train_seconds": round(result.elapsed_s, 2), **info}
    if not rank0:
        D.barrier()
        return summary

    # held-out masked-token accuracy: with the final index, and with the index training used last
    final_index = refresh.active
    ev = evaluate_mlm(trainer.raw_model, collator, held_queries, final_index)
    stale_at_end = refresh.train_index is not final_index
    ev_train = evaluate_mlm(trainer.raw_model, collator, held_queries, refresh.train_index) if stale_at_end else ev
    last, start = refresh.ok_rows[-1], refresh.ok_rows[0]
    train_probe = (run_probes(trainer.raw_model.retriever, refresh.train_index, probe_sets, block_ids, block_doc, p.staleness_k)
                   if stale_at_end else last)
    cadence = [r for r in refresh.history if r.get("reason") == "cadence"]
    stale_vals = [r["staleness"] for r in refresh.ok_rows if r.get("staleness") is not None and r.get("reason") == "cadence"]
    first = store.first()
    summary.update({
        "loss": recorder.tail_mean("loss", train.max_steps), "mlm_acc": recorder.tail_mean("mlm_acc", train.max_steps),
        "final_loss": result.metrics.get("loss"), "final_mlm_acc": result.metrics.get("mlm_acc"),
        "eval_mlm_acc": ev.get("mlm_acc"), "eval_loss": ev.get("loss"), "eval_tokens": ev.get("tokens"),
        "eval_mlm_acc_train_index": ev_train.get("mlm_acc"), "eval_mlm_acc_start": ev_start.get("mlm_acc"),
        "k": p.staleness_k, "recall_at_k_start": start.get("recall_at_k"),
        "recall_at_k": last.get("recall_at_k"), "mean_rank": last.get("mean_rank"),
        "recall_at_k_train_index": train_probe.get("recall_at_k"), "mean_rank_train_index": train_probe.get("mean_rank"),
        "probe_set": probes.kind if probes else "none", "probe_n": len(probes) if probes else 0,
        # held-out masked queries (block-level gold, own block excluded): first index, final, training's last
        "heldout_n": len(held_probes) if held_probes else 0,
        "heldout_recall_at_k_start": start.get("heldout_recall_at_k"), "heldout_mean_rank_start": start.get("heldout_mean_rank"),
        "heldout_recall_at_k": last.get("heldout_recall_at_k"), "heldout_mean_rank": last.get("heldout_mean_rank"),
        "heldout_recall_at_k_train_index": train_probe.get("heldout_recall_at_k"),
        "heldout_entity_n": len(held_entity) if held_entity else 0,
        "heldout_entity_recall_at_k_start": start.get("heldout_entity_recall_at_k"),
        "heldout_entity_mean_rank_start": start.get("heldout_entity_mean_rank"),
        "heldout_entity_recall_at_k": last.get("heldout_entity_recall_at_k"),
        "heldout_entity_mean_rank": last.get("heldout_entity_mean_rank"),
        "heldout_entity_recall_at_k_train_index": train_probe.get("heldout_entity_recall_at_k"),
        "refreshes": sum(1 for r in cadence if r.get("ok")), "failures": sum(1 for r in cadence if not r.get("ok")),
        "mean_staleness": float(np.mean(stale_vals)) if stale_vals else None,
        "final_index_version": final_index.version, "first_index_version": first.version if first else None,
        "first_index_step": first.step if first else None,
        "fraction_hidden": timing.get("fraction_hidden", 0.0), "refresh_hidden_s": timing.get("hidden_s", 0.0),
        "refresh_blocked_s": timing.get("blocked_s", 0.0), "refresh_build_s": timing.get("build_s", 0.0),
        "refresh_deferred": timing.get("steps_due_while_busy", 0.0),
    })
    summary = {k: v for k, v in summary.items() if v is not None}

    # outputs, each written atomically
    store.set_current(final_index.version)  # CURRENT on disk = the final version (cheap: once, at the end)
    with atomic_dir(out_dir) as tmp:
        trainer.raw_model.retriever.save_pretrained(tmp / "retriever")
        tokenizer.save_pretrained(str(tmp / "retriever"))
        trainer.raw_model.knowledge_augmented_encoder.save_pretrained(tmp / "knowledge_augmented_encoder")
        tokenizer.save_pretrained(str(tmp / "knowledge_augmented_encoder"))
        write_json_atomic(tmp / REALM_CONFIG, {"marginalization": trainer.raw_model.marginalization})
        (first or final_index).save(tmp / "index" / "first", extra_meta={"role": "first"})
        final_index.save(tmp / "index" / "final", extra_meta={"role": "final"})
        write_text_atomic(tmp / "model_card.md", _model_card(params, summary, info))
    write_text_atomic(plot_path, refresh.csv_text())
    write_stage_metrics(metrics_path, summary)
    if run is not None and log_artifacts:  # the summary numbers are logged by the flow, as for every stage
        for sub in ("retriever", "knowledge_augmented_encoder"):
            run.log_artifact(out_dir / sub, artifact_path=sub)  # a large folder becomes a reference
        run.log_artifact(out_dir / "index" / "final", artifact_path="index_final")
        run.log_artifact(out_dir / "model_card.md")
        run.log_artifact(plot_path)
        run.log_artifact(metrics_path)
    log.info("%s: %s", STAGE, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()})
    D.barrier()
    return summary


def main() -> None:
    torchrun_worker(STAGE, lambda params, run: train_realm(params, run))


if __name__ == "__main__":
    main()
