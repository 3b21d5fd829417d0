"""`prepare_corpus`: read a source, normalise, de-duplicate, split questions, write the corpus folder.

Output (one folder, swapped in atomically):
    passages.parquet            doc_id, title, text, spans (marked salient char spans)
    beir/corpus.jsonl           the same passages in BEIR layout (_id, title, text)
    beir/queries.jsonl          questions, when the source has them
    beir/qrels/{split}.tsv      question -> gold passage, per split (train/dev/test)
    qa/{split}.jsonl            id, question, answers, positive_ctx (open-QA data)
    data_card.json              counts, dedupe report, skipped lines, dropped empty passages, length histogram, digest
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from components.config_stages import DataParams, SplitParams
from components.data.corpus import SourceData, load_source, normalize_and_dedupe
from components.data.errors import DataError
from components.io import atomic_dir, write_json_atomic, write_jsonl_atomic, write_text_atomic

SPLITS = ("train", "dev", "test")

PASSAGE_SCHEMA = pa.schema([
    ("doc_id", pa.string()),
    ("title", pa.string()),
    ("text", pa.string()),
    ("spans", pa.list_(pa.struct([("start", pa.int32()), ("end", pa.int32()), ("label", pa.string())]))),
])


def assign_splits(qids: list[str], given: dict[str, str], sp: SplitParams) -> dict[str, str]:
    """Keep the source's own split; split the rest by question with a seeded shuffle."""
    free = sorted(q for q in qids if q not in given)
    random.Random(sp.seed).shuffle(free)
    n_test, n_dev = round(len(free) * sp.test), round(len(free) * sp.dev)
    out = dict(given)
    for i, q in enumerate(free):
        out[q] = "test" if i < n_test else ("dev" if i < n_test + n_dev else "train")
    return out


def length_histogram(passages: list[dict], edges=(0, 16, 32, 64, 128, 256, 512, 1024, 1 << 30)) -> dict:
    words = np.array([len(p["text"].split()) for p in passages] or [0])
    counts, _ = np.histogram(words, bins=np.array(edges))
    labels = [f"{lo}-{hi - 1}" if hi < (1 << 30) else f"{lo}+" for lo, hi in zip(edges[:-1], edges[1:])]
    return {"unit": "words", "bins": dict(zip(labels, counts.tolist())),
            "mean": float(words.mean()), "max": int(words.max()), "p50": float(np.median(words))}


def corpus_digest(passages: list[dict]) -> str:
    h = hashlib.sha256()
    for p in passages:
        h.update(p["doc_id"].encode() + b"\0" + p["text"].encode() + b"\n")
    return h.hexdigest()


def _check_questions(src: SourceData, doc_ids: set[str]) -> None:
    """Gold docs may have been removed as duplicates: re-point nothing silently, report instead."""
    for qid, rels in src.qrels.items():
        missing = [d for d in rels if d not in doc_ids]
        for d in missing:
            del rels[d]
    src.queries = [q for q in src.queries if src.qrels.get(q["qid"])]


def prepare_corpus(p: DataParams, out_dir: str | Path) -> dict:
    """Run the stage body and return the data card (also written to `out_dir/data_card.json`)."""
    src = load_source(p)
    passages, dedupe = normalize_and_dedupe(src.passages, p.min_chars)
    if p.max_docs and len(passages) > p.max_docs:
        passages = passages[: p.max_docs]
    if not passages:
        where = src.report.files[0] if src.report.files else (p.path or p.source)
        raise DataError(where, "no passages left after reading and cleaning",
                        fix="check the source file, data.min_chars and data.jsonl_fields.text")
    doc_ids = {d["doc_id"] for d in passages}
    n_queries_in = len(src.queries)
    _check_questions(src, doc_ids)
    splits = assign_splits([q["qid"] for q in src.queries], {q["qid"]: q["split"] for q in src.queries if q.get("split")}, p.split)
    qa_split = {r["id"]: r.get("split") or splits.get(r["id"]) for r in src.qa}
    qa_free = [r["id"] for r in src.qa if qa_split[r["id"]] is None]
    qa_split.update(assign_splits(qa_free, {}, p.split))

    with atomic_dir(out_dir) as tmp:
        table = pa.Table.from_pylist(
            [{"doc_id": d["doc_id"], "title": d["title"], "text": d["text"],
              "spans": [{"start": s["start"], "end": s["end"], "label": s.get("label", "")} for s in d["spans"]]}
             for d in passages], schema=PASSAGE_SCHEMA)
        pq.write_table(table, tmp / "passages.parquet")
        write_jsonl_atomic(tmp / "beir/corpus.jsonl", [{"_id": d["doc_id"], "title": d["title"], "text": d["text"]} for d in passages])
        write_jsonl_atomic(tmp / "beir/queries.jsonl", [{"_id": q["qid"], "text": q["text"]} for q in src.queries])
        for split in SPLITS:
            rows = [f"{qid}\t{doc}\t{rel}" for qid in sorted(src.qrels) if splits.get(qid) == split for doc, rel in sorted(src.qrels[qid].items())]
            write_text_atomic(tmp / f"beir/qrels/{split}.tsv", "query-id\tcorpus-id\tscore\n" + "".join(r + "\n" for r in rows))
            write_jsonl_atomic(tmp / f"qa/{split}.jsonl",
                               [{k: r[k] for k in ("id", "question", "answers", "positive_ctx") if k in r} for r in src.qa if qa_split[r["id"]] == split])
        card = {
            "source": p.source,
            "path": p.path,
            "read": src.report.as_dict(),
            "dedupe": dedupe,
            # passages whose text was empty or whitespace-only (also dedupe.empty_dropped): named at the
            # top level because a count above 0 usually means a wrong data.jsonl_fields.text or a bad export
            "dropped_empty": dedupe["empty_dropped"],
            "passages": len(passages),
            "passages_with_spans": sum(1 for d in passages if d["spans"]),
            "queries": {s: sum(1 for q in src.queries if splits.get(q["qid"]) == s) for s in SPLITS},
            "queries_dropped_no_gold": n_queries_in - len(src.queries),
            "qa": dict(Counter(qa_split[r["id"]] for r in src.qa)),
            "length_histogram": length_histogram(passages),
            "digest": corpus_digest(passages),
        }
        write_json_atomic(tmp / "data_card.json", card)
    return card
