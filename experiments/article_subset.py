r"""A BEIR folder cut to some of its articles: a corpus the presets were not tuned on, to check that
their settings carry over (`data.path` at the copy; the shipped corpus's own ids and sizes change).

    .venv/bin/python -m experiments.article_subset --articles 6-11 --out /tmp/squad-a6-11
    .venv/bin/python -m experiments.small_seeds --preset default --name a6_11_dev --seeds 1 --split dev \
        --workdir /tmp/a6_11 --set data.path=/tmp/squad-a6-11

The source needs `qa.jsonl` rows with an `article` (the shipped slice's have it). Paragraph ids are
`<article>-<paragraph>`, as in the shipped slice, so a paragraph's article is its id's prefix. Every file
is written with the same name and compression as in the source: corpus, queries, qa and each qrels split,
keeping only the rows of the chosen articles.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.data.beir import qrels_files  # noqa: E402
from components.data.textfile import resolve_member  # noqa: E402

SHIPPED = ROOT / "corpora" / "squad-v1.1-dev-a0-11"


def _open(path: Path, mode: str):
    return gzip.open(path, mode + "t", encoding="utf-8") if path.suffix == ".gz" else open(path, mode, encoding="utf-8")


def _find(folder: Path, name: str) -> Path:
    path = resolve_member(folder, name)  # name or name.gz; both is refused as ambiguous
    if not path.exists():
        raise SystemExit(f"{folder}: no {name} or {name}.gz")
    return path


def parse_articles(spec: str) -> set[int]:
    """'6-11' or '0,2,5-7' -> the article numbers."""
    out: set[int] = set()
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def subset(src: Path, out: Path, articles: set[int]) -> dict[str, int]:
    qa_path = _find(src, "qa.jsonl")
    with _open(qa_path, "r") as f:
        qa = [json.loads(line) for line in f if line.strip()]
    if qa and "article" not in qa[0]:
        raise SystemExit(f"{qa_path}: rows have no 'article' field to cut by")
    keep_q = {r["id"] for r in qa if int(r["article"]) in articles}
    docs = {r["positive_ctx"] for r in qa if r["id"] in keep_q}
    prefixes = {d.split("-")[0] for d in docs}
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}

    def copy_jsonl(path: Path, keep) -> None:
        with _open(path, "r") as f, _open(out / path.name, "w") as g:
            n = 0
            for line in f:
                if line.strip() and keep(json.loads(line)):
                    g.write(line if line.endswith("\n") else line + "\n")
                    n += 1
        counts[path.name] = n

    copy_jsonl(_find(src, "corpus.jsonl"), lambda r: r["_id"].split("-")[0] in prefixes)
    copy_jsonl(_find(src, "queries.jsonl"), lambda r: r["_id"] in keep_q)
    copy_jsonl(qa_path, lambda r: r["id"] in keep_q)
    (out / "qrels").mkdir(exist_ok=True)
    for q in qrels_files(src).values():
        with _open(q, "r") as f, _open(out / "qrels" / q.name, "w") as g:
            n = 0
            for i, line in enumerate(f):
                cols = line.rstrip("\n").split("\t")
                if (i == 0 and cols[0] == "query-id") or cols[0] in keep_q:
                    g.write(line if line.endswith("\n") else line + "\n")
                    n += cols[0] != "query-id"
        counts[f"qrels/{q.name}"] = n
    return counts


def main(argv: list[str] | None = None) -> dict[str, int]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=SHIPPED, help="a BEIR folder with qa.jsonl (default: the shipped slice)")
    ap.add_argument("--articles", required=True, help="article numbers to keep: 6-11, or 0,2,5-7")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    counts = subset(a.src, a.out, parse_articles(a.articles))
    print(json.dumps(counts))
    return counts


if __name__ == "__main__":
    main()
