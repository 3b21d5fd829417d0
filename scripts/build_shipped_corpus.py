"""Build `corpora/squad-v1.1-dev-a0-11/`, the small real corpus the repo ships (the `small` preset's data).

    .venv/bin/python scripts/build_shipped_corpus.py --from-beir path/to/squad-dev-a0-11
    .venv/bin/python scripts/build_shipped_corpus.py --from-hf rajpurkar/squad --split validation --articles 0-11
    .venv/bin/python scripts/build_shipped_corpus.py --from-beir path/to/squad-dev-a0-11 --check

`--from-beir` re-encodes a BEIR folder in the shipped layout (corpus.jsonl, queries.jsonl, qa.jsonl
and qrels/test.tsv, every record and field kept as it is); `--from-hf` converts a SQuAD-schema dataset
(a hub name, online, or a `save_to_disk` folder) with `components.data.squad.squad_to_beir`, the
conversion `data.source: hf` uses too. `--check` builds in memory and compares with the folder
instead of writing (exit 1 on a difference).

Output: `corpus.jsonl.gz`, `queries.jsonl.gz`, `qa.jsonl.gz`, `qrels/test.tsv.gz`, each gzip with
mtime 0 and no file name in the header, so the same records give the same bytes (with the same
zlib). Only those files are written; README.md and LICENSE in the folder are left alone. The
result is read back through the project's BEIR loader and its counts printed.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.data.squad import SquadBeir, squad_to_beir  # noqa: E402

OUT = ROOT / "corpora" / "squad-v1.1-dev-a0-11"
QRELS_HEADER = "query-id\tcorpus-id\tscore\n"
SPLIT = "test"  # the shipped folder's one qrels file: prepare_corpus splits its questions by data.split


# ----------------------------------------------------------------------------------------------
# sources -> records
# ----------------------------------------------------------------------------------------------
def _jsonl_rows(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def records_from_beir(folder: str | Path, split: str = SPLIT) -> SquadBeir:
    """A BEIR folder's records, verbatim (extra fields such as qa's answer_starts/article included)."""
    folder = Path(folder)
    with open(folder / "qrels" / f"{split}.tsv", encoding="utf-8") as f:
        lines = f.read().splitlines()
    if not lines or lines[0] + "\n" != QRELS_HEADER:
        raise SystemExit(f"{folder}/qrels/{split}.tsv: expected the header {QRELS_HEADER!r}")
    qrels = [(q, d, int(s)) for q, d, s in (line.split("\t") for line in lines[1:] if line.strip())]
    qa = _jsonl_rows(folder / "qa.jsonl") if (folder / "qa.jsonl").exists() else []
    return SquadBeir(_jsonl_rows(folder / "corpus.jsonl"), _jsonl_rows(folder / "queries.jsonl"), qrels, qa)


def parse_articles(spec: str | None) -> range | None:
    """`0-11` -> range(0, 12); `5` -> range(5, 6); None -> every article."""
    if not spec:
        return None
    lo, _, hi = spec.partition("-")
    return range(int(lo), int(hi or lo) + 1)


def records_from_hf(name_or_path: str, split: str, articles: range | None) -> SquadBeir:
    """A SQuAD-schema dataset (hub name or save_to_disk folder) through the loader's own conversion."""
    from components.data.corpus import load_hf_dataset

    return squad_to_beir(load_hf_dataset(name_or_path, split), articles=articles, where=name_or_path)


# ----------------------------------------------------------------------------------------------
# records -> bytes -> folder
# ----------------------------------------------------------------------------------------------
def gzip_bytes(data: bytes) -> bytes:
    """gzip with mtime 0 and no file name: the bytes depend on the content only (and zlib)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", fileobj=buf, mode="wb", compresslevel=9, mtime=0) as gz:
        gz.write(data)
    return buf.getvalue()


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def folder_files(recs: SquadBeir, split: str = SPLIT) -> dict[str, bytes]:
    """{relative path: gzip bytes} of the shipped layout."""
    qrels = QRELS_HEADER + "".join(f"{q}\t{d}\t{s}\n" for q, d, s in recs.qrels)
    files = {"corpus.jsonl.gz": _jsonl(recs.corpus), "queries.jsonl.gz": _jsonl(recs.queries),
             f"qrels/{split}.tsv.gz": qrels.encode("utf-8")}
    if recs.qa:
        files["qa.jsonl.gz"] = _jsonl(recs.qa)
    return {name: gzip_bytes(data) for name, data in files.items()}


def write_folder(out: str | Path, recs: SquadBeir, split: str = SPLIT) -> dict[str, bytes]:
    """Write the data files into `out` (each atomically); other files there are kept."""
    from components.io import write_bytes_atomic

    files = folder_files(recs, split)
    for name, data in files.items():
        write_bytes_atomic(Path(out) / name, data)
    return files


def differences(out: str | Path, files: dict[str, bytes]) -> list[str]:
    """The data files of `out` whose bytes differ from `files` (or are missing)."""
    out = Path(out)
    return [name for name, data in files.items() if not (out / name).is_file() or (out / name).read_bytes() != data]


def summary(out: str | Path) -> dict:
    """Counts as the project's BEIR loader reads the folder back."""
    from components.data.corpus import read_beir_source

    data = read_beir_source(Path(out))
    return {"paragraphs": len(data.passages), "questions": len(data.queries), "qa": len(data.qa),
            "skipped": len(data.report.skipped)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-beir", type=Path, help="a BEIR folder (e.g. a copy of squad-dev-a0-11 in BEIR layout)")
    src.add_argument("--from-hf", help="a SQuAD-schema HF dataset: hub name (online) or save_to_disk folder")
    ap.add_argument("--split", default="validation", help="--from-hf: the dataset split (SQuAD's dev set is `validation`)")
    ap.add_argument("--articles", default="0-11", help="--from-hf: article indexes to keep, e.g. 0-11 ('' = all)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing")
    args = ap.parse_args(argv)
    if args.from_beir:
        recs = records_from_beir(args.from_beir)
    else:
        recs = records_from_hf(args.from_hf, args.split, parse_articles(args.articles))
    if args.check:
        diff = differences(args.out, folder_files(recs))
        print(f"{args.out}: " + (f"differs in {diff}" if diff else "identical"))
        return 1 if diff else 0
    write_folder(args.out, recs)
    print(f"{args.out}: {summary(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
