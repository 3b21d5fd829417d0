"""Fine-tuning data: retrieval pairs for the bi-encoder, QA rows for the reader, and the collator.

Reads the corpus folder written by `prepare_corpus` (docs/contracts.md):

    corpus = load_corpus(CORPUS)                                 # {doc_id: passage text}
    pairs = load_pairs(CORPUS, "train")                          # [{qid, query, pos_doc_id, positives, answers?}]
    pairs = mine_bm25_negatives(pairs, corpus, depth=30)         # components.retrieval.negatives: + "negatives"
    collate = BiEncoderCollator(tok, p.finetune.query_len, p.finetune.passage_len, p.finetune.hard_negatives, corpus)
    batch = collate(pairs[:4], generator=torch.Generator().manual_seed(0))   # -> BiEncoder(batch)

    qa = load_qa(CORPUS, "train")                                # [{id, question, answers, positive_ctx?}]
    #  -> components.data.qa_batch.QACollator(tok, blocks, block_vecs, retrieve=tower_search_fn(...))(qa[:4])
    #     searches the frozen index with the current query tower each call -> OpenQA(batch)
    #  (BM25: components.retrieval.search.bm25_qa_blocks(...) adds fixed block_rows)

(CORPUS is `components.paths.CORPUS`.) Hard negatives: each pair keeps a ranked pool of `depth`
negatives (mined in `components.retrieval.negatives`); every batch the collator samples
`hard_negatives` of them without replacement from the trainer's generator (Tevatron-style), so
each epoch sees different ones and a resumed run sees the same ones. A pool shorter than
`hard_negatives` is topped up with random corpus passages (not positives), so every query always
has exactly 1 + hard_negatives passages, which the cross-device gather needs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from components.data import beir


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
