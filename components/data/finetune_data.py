"""Fine-tuning data: retrieval pairs + hard negatives for the bi-encoder, QA rows for the reader.

Reads the corpus folder written by `prepare_corpus` (docs/contracts.md):

    corpus = load_corpus("data/corpus")                          # {doc_id: passage text}
    pairs = load_pairs("data/corpus", "train")                   # [{qid, query, pos_doc_id, positives, answers?}]
    pairs = mine_bm25_negatives(pairs, corpus, depth=30)         # + "negatives": ranked doc ids
    #  or   mine_dense_negatives(make_encode_fn(stage1, tok, 32, 80), pairs, corpus, depth=30)
    collate = BiEncoderCollator(tok, p.finetune.query_len, p.finetune.passage_len, p.finetune.hard_negatives, corpus)
    batch = collate(pairs[:4], generator=torch.Generator().manual_seed(0))   # -> BiEncoder(batch)

    qa = load_qa("data/corpus", "train")                         # [{id, question, answers, positive_ctx?}]
    qa = retrieve_qa_blocks(encode_fn, qa, k=p.finetune.qa_top_k, search_fn=block_index.search)  # + block_rows
    #  -> components.models.reader.QACollator(tok, blocks, block_vecs, ...)(qa[:4]) -> OpenQA(batch)

Hard negatives: each pair keeps a ranked pool of `depth` negatives (never one of the query's
positives, nor, when the query has QA answers, a passage containing an answer: DPR's filter for
likely false negatives); every batch the collator samples `hard_negatives` of them without
replacement from the trainer's generator (Tevatron-style), so each epoch sees different ones and a
resumed run sees the same ones. A pool shorter than `hard_negatives` is topped up with random
corpus passages (not positives), so every query always has exactly 1 + hard_negatives passages,
which the cross-device gather needs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from components.data import beir

SIDE_QUERY, SIDE_PASSAGE = "query", "passage"
EncodeFn = Callable[[Sequence[str], str], np.ndarray]  # (texts, "query"|"passage") -> (N, D) float32


# ----------------------------------------------------------------------------------------------
# reading the corpus folder
# ----------------------------------------------------------------------------------------------
def passage_text(title: str, text: str, use_title: bool = False) -> str:
    """The string a passage is encoded from. Default: the text alone, as the retrieval blocks of
    the tokenize stage (what REALM and the QA index embed); `use_title` prepends "title. "."""
    return f"{title}. {text}" if use_title and title else text


def load_corpus(corpus_dir: str | Path, use_title: bool = False) -> dict[str, str]:
    """`beir/corpus.jsonl` -> {doc_id: passage_text} in file order."""
    corpus = beir.read_corpus(Path(corpus_dir) / "beir" / "corpus.jsonl")
    return {d: passage_text(r["title"], r["text"], use_title) for d, r in corpus.items()}


def load_pairs(corpus_dir: str | Path, split: str = "train", with_answers: bool = True) -> list[dict]:
    """One row per (query, relevant doc) of `beir/qrels/{split}.tsv` (score > 0), sorted by (qid, doc):

        {qid, query, pos_doc_id, positives: all relevant doc ids of the query (false-negative
         masking and negative mining use them), answers: [...] (only when `qa/{split}.jsonl` has
         the query's id and `with_answers`)}
    """
    root = Path(corpus_dir)
    queries = beir.read_queries(root / "beir" / "queries.jsonl")
    qrels = beir.read_qrels(root / "beir" / "qrels" / f"{split}.tsv", known_queries=queries)
    answers: dict[str, list[str]] = {}
    qa_path = root / "qa" / f"{split}.jsonl"
    if with_answers and qa_path.exists() and qa_path.stat().st_size:
        answers = {r["id"]: r["answers"] for r in beir.read_qa(qa_path)}
    rows = []
    for qid in sorted(qrels):
        positives = sorted(d for d, s in qrels[qid].items() if s > 0)
        for doc in positives:
            row = {"qid": qid, "query": queries[qid], "pos_doc_id": doc, "positives": positives}
            if qid in answers:
                row["answers"] = answers[qid]
            rows.append(row)
    return rows


def load_qa(corpus_dir: str | Path, split: str = "train") -> list[dict]:
    """`qa/{split}.jsonl` -> [{id, question, answers, positive_ctx?}] (validated by `beir.read_qa`)."""
    path = Path(corpus_dir) / "qa" / f"{split}.jsonl"
    if path.exists() and path.stat().st_size == 0:
        return []  # prepare_corpus writes an empty file for a split without questions
    return beir.read_qa(path)


# ----------------------------------------------------------------------------------------------
# hard negatives
# ----------------------------------------------------------------------------------------------
def _unique_queries(pairs: Sequence[dict]) -> tuple[list[str], dict[str, dict]]:
    first: dict[str, dict] = {}
    for r in pairs:
        first.setdefault(r["qid"], r)
    return list(first), first


def _with_negatives(pairs: Sequence[dict], negatives: Mapping[str, list[str]]) -> list[dict]:
    return [{**r, "negatives": list(negatives[r["qid"]])} for r in pairs]


def mine_bm25_negatives(pairs: Sequence[dict], corpus: Mapping[str, str], depth: int = 30, retriever: Any = None) -> list[dict]:
    """Add `negatives`: the top `depth` BM25 passages of each query that are not its positives
    (nor answer-bearing, when the pair has `answers`). `retriever`: a fitted BM25Retriever
    (fitted on `corpus` here when None). BM25 may return fewer (docs sharing no term are no hard
    negatives); the collator tops short pools up with random passages."""
    if retriever is None:
        from components.retrieval.bm25 import BM25Retriever

        retriever = BM25Retriever().fit(list(corpus), list(corpus.values()))
    qids, first = _unique_queries(pairs)
    if not qids:
        return []
    negs = retriever.hard_negatives(
        [first[q]["query"] for q in qids], [first[q]["positives"] for q in qids], k=depth,
        answers=[first[q].get("answers", []) for q in qids],  # [] = no answer filter for that query
    )
    return _with_negatives(pairs, dict(zip(qids, negs)))


def dense_search(query_vecs: np.ndarray, passage_vecs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-k with faiss IndexFlatIP: (scores, rows), each (Q, min(k, N))."""
    import faiss

    p = np.ascontiguousarray(passage_vecs, dtype=np.float32)
    q = np.ascontiguousarray(query_vecs, dtype=np.float32)
    index = faiss.IndexFlatIP(p.shape[1])
    index.add(p)
    return index.search(q, min(k, p.shape[0]))


def mine_dense_negatives(
    encode_fn: EncodeFn, pairs: Sequence[dict], corpus: Mapping[str, str], depth: int = 30,
    passage_vecs: np.ndarray | None = None,
) -> list[dict]:
    """Add `negatives` from a dense search of the stage-1 encoder (ANCE/RocketQA-style): the top
    `depth` passages by inner product that are not positives and contain no gold answer.

    `encode_fn(texts, "query"|"passage") -> (N, D)` float32 (see `biencoder.make_encode_fn`);
    `passage_vecs` (len(corpus), D) in corpus order skips re-encoding the corpus.
    """
    from components.data.text import normalize_answer

    doc_ids = list(corpus)
    qids, first = _unique_queries(pairs)
    if not qids:
        return []
    if passage_vecs is None:
        passage_vecs = encode_fn([corpus[d] for d in doc_ids], SIDE_PASSAGE)
    query_vecs = encode_fn([first[q]["query"] for q in qids], SIDE_QUERY)
    max_pos = max(len(first[q]["positives"]) for q in qids)
    # Search deep enough that filtering positives and answer-bearing passages still leaves `depth`
    # in most cases; the collator tops up the rest.
    _, rows = dense_search(query_vecs, passage_vecs, 2 * depth + max_pos)
    normed: dict[str, str] = {}
    out: dict[str, list[str]] = {}
    for qi, q in enumerate(qids):
        pos = set(first[q]["positives"])
        golds = [f" {a} " for a in (normalize_answer(x) for x in first[q].get("answers", [])) if a]
        negs: list[str] = []
        for r in rows[qi]:
            if r < 0 or len(negs) == depth:
                break
            d = doc_ids[r]
            if d in pos:
                continue
            if golds:
                t = normed.setdefault(d, f" {normalize_answer(corpus[d])} ")
                if any(g in t for g in golds):
                    continue  # likely a false negative: it answers the question
            negs.append(d)
        out[q] = negs
    return _with_negatives(pairs, out)


# ----------------------------------------------------------------------------------------------
# collation
# ----------------------------------------------------------------------------------------------
def doc_key(doc_id: str) -> int:
    """A stable 63-bit int for a doc id (tensors cannot hold strings; keys cross ranks)."""
    return int.from_bytes(hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest(), "little") & (2**63 - 1)


class BiEncoderCollator:
    """Rows from `load_pairs` (+ `negatives`) -> the batch `BiEncoder.forward` takes.

        query_input_ids, query_attention_mask        (B, Lq)     [CLS] q [SEP], <= query_len
        passage_input_ids, passage_attention_mask    (B*G, Lp)   per query: positive, then H negatives
        passage_keys                                 (B*G,)      doc_key of each passage
        query_positive_keys                          (B, P)      doc_keys of each query's positives, -1 pad

    G = 1 + hard_negatives. `corpus`: {doc_id: passage text}. Randomness only from `generator`.
    """

    def __init__(self, tokenizer: Any, query_len: int, passage_len: int, hard_negatives: int,
                 corpus: Mapping[str, str] | None = None):
        if hard_negatives < 0:
            raise ValueError(f"hard_negatives must be >= 0, got {hard_negatives}")
        if corpus is None:
            raise ValueError("BiEncoderCollator needs `corpus` ({doc_id: text}) to look passages up")
        self.tokenizer, self.query_len, self.passage_len = tokenizer, query_len, passage_len
        self.hard_negatives = hard_negatives
        self.corpus = corpus
        self._doc_ids = list(corpus)  # for topping up short negative pools

    @classmethod
    def from_params(cls, tokenizer: Any, p: Any, corpus: Mapping[str, str]) -> "BiEncoderCollator":
        """`p`: a FinetuneParams."""
        return cls(tokenizer, p.query_len, p.passage_len, p.hard_negatives, corpus)

    def sample_negatives(self, row: dict, generator: torch.Generator) -> list[str]:
        """`hard_negatives` doc ids: a random subset of the row's pool, topped up at random."""
        H = self.hard_negatives
        pool = list(row.get("negatives") or [])
        picked = [pool[i] for i in torch.randperm(len(pool), generator=generator)[:H].tolist()]
        banned = set(row.get("positives") or [row["pos_doc_id"]]) | set(picked)
        tries = 0
        while len(picked) < H:
            d = self._doc_ids[int(torch.randint(len(self._doc_ids), (1,), generator=generator))]
            tries += 1
            if d not in banned or tries > 100 * H:  # tiny corpus: allow repeats rather than loop
                picked.append(d)
                banned.add(d)
        return picked

    def _tokenize(self, texts: list[str], max_len: int) -> dict[str, torch.Tensor]:
        return self.tokenizer(texts, max_length=max_len, truncation=True, padding=True,
                              return_tensors="pt", return_token_type_ids=False)

    def __call__(self, rows: Sequence[dict], generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        if generator is None:  # the trainer always passes one; this keeps ad-hoc calls deterministic
            generator = torch.Generator().manual_seed(0)
        passages: list[str] = []
        keys: list[int] = []
        for r in rows:
            for d in [r["pos_doc_id"], *self.sample_negatives(r, generator)]:
                passages.append(self.corpus[d])
                keys.append(doc_key(d))
        positives = [[doc_key(d) for d in (r.get("positives") or [r["pos_doc_id"]])] for r in rows]
        P = max(len(p) for p in positives)
        q = self._tokenize([r["query"] for r in rows], self.query_len)
        p = self._tokenize(passages, self.passage_len)
        return {
            "query_input_ids": q["input_ids"],
            "query_attention_mask": q["attention_mask"],
            "passage_input_ids": p["input_ids"],
            "passage_attention_mask": p["attention_mask"],
            "passage_keys": torch.tensor(keys, dtype=torch.long),
            "query_positive_keys": torch.tensor([k + [-1] * (P - len(k)) for k in positives], dtype=torch.long),
        }


def write_pairs_jsonl(path: str | Path, pairs: Sequence[dict]) -> Path:
    """Mined pairs (with negatives) as JSON lines, atomically: a cacheable stage output."""
    from components.io import write_text_atomic

    return write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in pairs))


def read_pairs_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------------------------
# QA rows: the top-k blocks of the frozen index
# ----------------------------------------------------------------------------------------------
def retrieve_qa_blocks(
    encode_fn: EncodeFn, qa_rows: Sequence[dict], k: int, block_vecs: np.ndarray | None = None,
    search_fn: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]] | None = None,
) -> list[dict]:
    """Add `block_rows` (the top-k block rows) to each QA row, searching the frozen block index
    once with the stage-1 query encoder: `search_fn(q, k) -> (scores, rows)` (e.g.
    `BlockIndex.search`), or an exact IndexFlatIP over `block_vecs`. Only the *selection* is fixed
    here; `OpenQA` re-scores the k blocks with the training query tower every step (REALM's
    stale-index argument), the block vectors themselves never change."""
    if (block_vecs is None) == (search_fn is None):
        raise ValueError("give exactly one of block_vecs or search_fn")
    if not qa_rows:
        return []
    q = encode_fn([r["question"] for r in qa_rows], SIDE_QUERY)
    _, rows = search_fn(q, k) if search_fn is not None else dense_search(q, block_vecs, k)
    return [{**r, "block_rows": [int(x) for x in rows[i] if x >= 0]} for i, r in enumerate(qa_rows)]
