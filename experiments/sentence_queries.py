r"""A retrieval set from a corpus of prose that has no questions: for each drawn paragraph, one of its
sentences becomes the query and is removed from the paragraph, whose rest is the one relevant
passage (the Inverse Cloze Task's pairs, ORQA's, scored as an eval set). A BEIR folder, so the
presets run on it with `data.path` pointed at it: a corpus from another domain than the shipped
SQuAD slice, to check that their settings carry over.

    .venv/bin/python -m experiments.sentence_queries --src path/to/paragraphs.jsonl.gz --out /tmp/prose-beir --max 900
    .venv/bin/python -m experiments.small_seeds --preset default --name prose_dev --seeds 1 2 --split dev \
        --workdir /tmp/prose --set data.path=/tmp/prose-beir

The source is JSON lines (gzip read too), one paragraph per line, read as `data.source: jsonl` reads it:
its text in `--text-field`, its id in `--id-field` (without one: `<file stem>-<line>`) and, if given, a
title in `--title-field`. Only paragraphs of at least `--min-sentences` sentences, each of at least
`--min-words` words, are drawn, so that a query is a whole sentence and its passage keeps some context.
Sentences are cut by a rule (., ! or ? then whitespace and a capital, digit or opening quote), not by a
parser. Writes corpus.jsonl.gz, queries.jsonl.gz and qrels/test.tsv.gz; no qa.jsonl, so the open-QA
readers are skipped and the table has retrieval rows only. Caveat: the queries are ICT's own kind of
pair, so a model trained with ICT (`realm.ict_steps`) is scored on its training task.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.data.errors import DataError  # noqa: E402
from components.data.line_readers import read_jsonl  # noqa: E402
from components.io import write_bytes_atomic  # noqa: E402

SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")


def sentences(text: str) -> list[str]:
    return [s for s in SENTENCE_END.split(" ".join(text.split())) if s]


def read_paragraphs(src: Path, text_field: str, id_field: str | None, title_field: str | None) -> list[dict]:
    """The paragraphs as `data.source: jsonl` reads them (`read_jsonl`: gzip, ids, duplicate ids refused),
    as {_id, title, text}; a bad line stops with its file and line, and the flag to set."""
    try:
        passages, _ = read_jsonl(src, text_field=text_field, title_field=title_field, id_field=id_field)
    except DataError as e:
        raise SystemExit(f"{e} (here: --text-field, --id-field, --title-field)") from None
    return [{"_id": p["doc_id"], "title": p["title"], "text": p["text"]} for p in passages]


def build(paragraphs: list[dict], n: int, seed: int, min_sentences: int = 3, min_words: int = 5) -> tuple[list, list, list]:
    """(corpus, queries, qrels) from up to `n` eligible paragraphs drawn with `seed`: query i is one
    sentence of its paragraph, the passage the paragraph without it."""
    rng = random.Random(seed)
    eligible = [(p, s) for p in paragraphs
                if len(s := sentences(p["text"])) >= min_sentences and all(len(x.split()) >= min_words for x in s)]
    rng.shuffle(eligible)
    corpus, queries, qrels = [], [], []
    for i, (p, sents) in enumerate(eligible[:n]):
        j = rng.randrange(len(sents))
        corpus.append({"_id": p["_id"], "title": p["title"], "text": " ".join(sents[:j] + sents[j + 1:])})
        queries.append({"_id": f"q{i}", "text": sents[j]})
        qrels.append((f"q{i}", p["_id"]))
    return corpus, queries, qrels


def write(out: Path, corpus: list, queries: list, qrels: list) -> None:
    def gz(text: str) -> bytes:
        return gzip.compress(text.encode("utf-8"), mtime=0)

    jsonl = lambda rows: "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)  # noqa: E731
    write_bytes_atomic(out / "corpus.jsonl.gz", gz(jsonl(corpus)))
    write_bytes_atomic(out / "queries.jsonl.gz", gz(jsonl(queries)))
    write_bytes_atomic(out / "qrels" / "test.tsv.gz", gz("query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t1\n" for q, d in qrels)))


def main(argv: list[str] | None = None) -> dict[str, int]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, required=True, help="paragraphs, JSON lines (.gz read too)")
    ap.add_argument("--out", type=Path, required=True, help="the BEIR folder to write")
    ap.add_argument("--max", type=int, default=900, help="paragraphs drawn (each gives one query)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--id-field", default="id", help="'' for <file stem>-<line> ids")
    ap.add_argument("--title-field", default=None)
    ap.add_argument("--min-sentences", type=int, default=3)
    ap.add_argument("--min-words", type=int, default=5)
    a = ap.parse_args(argv)
    paragraphs = read_paragraphs(a.src, a.text_field, a.id_field or None, a.title_field)
    corpus, queries, qrels = build(paragraphs, a.max, a.seed, a.min_sentences, a.min_words)
    if not corpus:
        raise SystemExit(f"{a.src}: no paragraph has {a.min_sentences}+ sentences of {a.min_words}+ words (--min-sentences, --min-words)")
    write(a.out, corpus, queries, qrels)
    counts = {"paragraphs_read": len(paragraphs), "passages": len(corpus), "queries": len(queries)}
    print(json.dumps(counts))
    return counts


if __name__ == "__main__":
    main()
