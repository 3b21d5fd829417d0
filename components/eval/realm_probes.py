"""What REALM pre-training measures while it trains: retrieval probes run against each new index,
and the held-out masked-token accuracy.

Probe sets (`Probes`), each scored by `probe_retrieval` (recall@k, mean rank of the first gold):
* `dev_question_probes`: the corpus's dev questions (data/corpus/beir), gold = their judged
  documents (doc level).
* `heldout_probes`: fixed masked queries of blocks that never give a training query; gold = the
  OTHER blocks that contain the masked answer (`answer_blocks`, what REALM's reader can use), the
  query's own block left out of the ranking as in training. With `same_entity=True` only those
  that also name one of x's other salient spans (`same_entity_gold`): the gold *document*, about
  what x is about, not a block that mentions the same value in passing.

    probes = probe_sets(heldout_queries, blocks, block_ids, block_doc, corpus_dir, tokenizer, p, special)
    run_probes(retriever, index, probes, block_ids, block_doc, k)   # {"recall_at_k", "heldout_recall_at_k", ...}
    evaluate_mlm(model, collator, queries, index)                    # {"mlm_acc", "loss", "tokens"}
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from components.config_stages import RealmParams
from components.data.beir import read_qrels, read_queries
from components.data.realm_batch import RealmCollator, collate_queries
from components.data.realm_query import RealmQuery, context_spans, iter_block_rows, masked_answer
from components.data.salient_spans import span_tagger_for
from components.data.special_tokens import IGNORE_INDEX, SpecialTokens
from components.data.token_spans import contains_span
from components.index.faiss_index import BlockIndex
from components.models.realm import REALM
from components.models.retriever import Retriever, encode_queries
from components.progress import ProgressClock, format_duration, progress_line

RANK_DEPTH = 1000  # mean gold rank is exact up to this depth; a gold doc not found counts as depth + 1
log = logging.getLogger(__name__)


@dataclass
class Probes:
    """Recall probes: query inputs `[CLS] q [SEP]`, the gold keys of each, and per query the row to
    leave out of its ranking (a held-out masked query's own block: REALM never retrieves it either)."""

    kind: str  # "dev_questions" | "heldout_masked" | "heldout_masked_same_entity"
    x: dict[str, torch.Tensor]  # x_input_ids, x_attention_mask (Q, Lx)
    gold: list[set[str]]  # doc ids (level "doc") or block ids (level "block")
    level: str = "doc"  # "doc" | "block": which key of a retrieved row is matched against `gold`
    exclude: list[int] | None = None  # (Q,) row left out of each query's ranking; None: none

    def __len__(self) -> int:
        return len(self.gold)


def _query_inputs(queries: list[RealmQuery], p: RealmParams, special: SpecialTokens) -> dict[str, torch.Tensor]:
    x = collate_queries(queries, p, special)
    return {k: x[k] for k in ("x_input_ids", "x_attention_mask")}


# ----------------------------------------------------------------------------------------------
# probe sets
# ----------------------------------------------------------------------------------------------
def dev_question_probes(corpus_dir: Path, tokenizer, p: RealmParams, special: SpecialTokens, doc_ids: set[str]) -> Probes | None:
    """data/corpus/beir (queries.jsonl, qrels/dev.tsv) -> Probes over the documents in `doc_ids`;
    None when there is no dev split or no judged question has a document among them."""
    qfile, qrels_file = Path(corpus_dir) / "beir" / "queries.jsonl", Path(corpus_dir) / "beir" / "qrels" / "dev.tsv"
    if not (qfile.is_file() and qrels_file.is_file()):
        return None
    # The BEIR readers without load_beir: its cross-check would parse the whole corpus.jsonl, which the probes never read.
    texts = read_queries(qfile)
    qrels = read_qrels(qrels_file, known_queries=texts)
    gold = {q: {d for d, score in docs.items() if score > 0 and d in doc_ids} for q, docs in qrels.items()}
    qids = sorted(q for q, g in gold.items() if g)
    if not qids:
        return None
    ids = tokenizer([texts[q] for q in qids], add_special_tokens=False)["input_ids"]
    queries = [RealmQuery(input_ids=list(t)[: p.query_len - 2], labels=[IGNORE_INDEX] * len(list(t)[: p.query_len - 2]), source_row=-1)
               for t in ids]
    return Probes("dev_questions", _query_inputs(queries, p, special), [gold[q] for q in qids])


def answer_blocks(queries: list[RealmQuery], block_tokens) -> list[set[int]]:  # block_tokens: Dataset or [{input_ids}]
    """Per query, the rows other than its source block whose tokens contain the masked answer
    (DPR's "answer in passage" relevance): the documents that can tell the reader the answer.

    One pass over the blocks; only blocks holding a needle's first token are checked in full."""
    needles = [masked_answer(q) for q in queries]
    first = {n[0] for n in needles if n}
    by_first: dict[int, list[int]] = {t: [] for t in first}
    tokens: dict[int, list[int]] = {}
    rows = iter_block_rows(block_tokens, ["input_ids"]) if hasattr(block_tokens, "select_columns") else enumerate(block_tokens)
    for r, row in rows:
        ids = [int(t) for t in row["input_ids"]]
        hit = first.intersection(ids)
        for t in hit:
            by_first[t].append(r)
        if hit:
            tokens[r] = ids
    return [{r for r in by_first.get(n[0], []) if r != q.source_row and contains_span(tokens[r], n)} if n else set()
            for q, n in zip(queries, needles)]


def same_entity_gold(queries: list[RealmQuery], gold_rows: list[set[int]], blocks, tagger) -> list[set[int]]:
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
        out.append({r for r in gold if any(contains_span(ids(r), sp) for sp in ctx)})
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
        gold_rows = same_entity_gold(queries, gold_rows, blocks, span_tagger_for(p))
    keep = [i for i, g in enumerate(gold_rows) if g]
    if not keep:
        return None
    return Probes("heldout_masked_same_entity" if same_entity else "heldout_masked",
                  _query_inputs([queries[i] for i in keep], p, special),
                  [{str(block_ids[r]) for r in gold_rows[i]} for i in keep], level="block",
                  exclude=[queries[i].source_row for i in keep])


def probe_sets(held_queries: list[RealmQuery], blocks, block_ids: np.ndarray, block_doc: np.ndarray, corpus_dir: Path,
               tokenizer, p: RealmParams, special: SpecialTokens) -> dict[str, Probes | None]:
    """The REALM stage's probe sets by metric prefix: "" the dev questions (else the held-out masked
    queries), "heldout_" the held-out masked queries, "heldout_entity_" their same-entity gold."""
    held = held_entity = None
    if held_queries:
        answers = answer_blocks(held_queries, blocks)  # one pass over the corpus serves both gold definitions
        held = heldout_probes(held_queries, blocks, block_ids, p, special, gold_rows=answers)
        held_entity = heldout_probes(held_queries, blocks, block_ids, p, special, same_entity=True, gold_rows=answers)
    main = dev_question_probes(corpus_dir, tokenizer, p, special, set(block_doc.tolist())) or held
    return {"": main, "heldout_": held, "heldout_entity_": held_entity}


# ----------------------------------------------------------------------------------------------
# scoring
# ----------------------------------------------------------------------------------------------
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


def run_probes(retriever: Retriever, index: BlockIndex, probes: dict[str, Probes | None], block_ids: np.ndarray,
               block_doc: np.ndarray, k: int) -> dict[str, float]:
    """Every probe set against `index`: `{prefix}recall_at_k`, `{prefix}mean_rank` (prefix "" for
    the main probe set, "heldout_" for the held-out masked queries)."""
    out: dict[str, float] = {}
    for prefix, pr in probes.items():
        if pr is None or not len(pr):
            continue
        t0 = time.perf_counter()
        q = encode_queries(retriever, pr.x)
        keys = block_doc if pr.level == "doc" else block_ids
        got = probe_retrieval(q, index, pr.gold, keys, k, pr.exclude)
        out.update({prefix + m: v for m, v in got.items()})
        log.info("realm.probe %s: %d queries, recall@%d %.3f, mean rank %.1f in %s", pr.kind, len(pr), k,
                 got["recall_at_k"], got["mean_rank"], format_duration(time.perf_counter() - t0))
    return out


@torch.no_grad()
def evaluate_mlm(model: REALM, collator: RealmCollator, queries: list[RealmQuery], index: BlockIndex,
                 batch_size: int = 16, progress_every: int = 0) -> dict[str, float]:
    """Masked-token accuracy / loss of the marginal p(y|x) on fixed queries against `index` (eval mode).

    A progress line (`realm.probe.mlm step 3/10 (30%) loss ... eta ...`) every `progress_every`
    batches (`tracking.progress_every`; 0: by time only), and at least every PROGRESS_EVERY_S seconds
    (`components.progress.ProgressClock`)."""
    if not queries:
        return {}
    was = model.training
    model.eval()
    acc = loss = n = seen = 0.0
    steps = -(-len(queries) // batch_size)
    clock = ProgressClock(progress_every)
    try:
        for step, i in enumerate(range(0, len(queries), batch_size), start=1):
            batch = collator.batch(queries[i:i + batch_size], index.search, model.retriever)
            dev = next(model.parameters()).device
            out = model({k: v.to(dev) for k, v in batch.items()})
            m = float(out["num_masked"])  # acc and loss are means over the masked tokens
            acc, loss, n = acc + float(out["mlm_acc"]) * m, loss + float(out["loss"]) * m, n + m
            seen += float(out["num_tokens"])
            if clock.due(step, final=step == steps):
                rate = seen / max(clock.elapsed(), 1e-9)
                log.info("%s", progress_line("realm.probe.mlm", step, steps, {"loss": loss / max(n, 1), "tokens_per_s": rate}, clock.eta(step, steps)))
    finally:
        model.train(was)
    return {"mlm_acc": acc / max(n, 1), "loss": loss / max(n, 1), "tokens": n}
