"""Corpus readers, normalisation and de-duplication: the body of the `prepare_corpus` stage.
(The line-by-line file readers, `.txt` and `.jsonl`, are `line_readers.py`.)

Every reader returns passages as dicts `{doc_id, title, text, spans}` plus a `ReadReport`.
Bad input raises `DataError` naming the file, the line and a fix; with `on_error="skip"` the
bad lines are skipped and *counted* in the report (never dropped silently).

Corpus ids are the identity of everything downstream (qrels, indexes, eval rows), so a second
record under an id already read is bad input: it stops the stage naming both lines, and in skip
mode the later record is skipped and counted. A UTF-8 BOM at the start of a file is stripped.

Every file source reads gzip transparently (`c.jsonl.gz` loads exactly as `c.jsonl`, ids included)
and refuses a UTF-16/UTF-32 file naming its encoding (`components.data.textfile`). Passages whose
text is empty or whitespace-only are dropped by `normalize_and_dedupe` and counted (`empty_dropped`).

    python -m flows.prepare_corpus            # the stage, as dvc.yaml runs it
"""

from __future__ import annotations

import hashlib
import tempfile
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from components.config_stages import DataParams
from components.data.errors import DataError
from components.data.line_readers import Passage, ReadReport, drop_duplicate_ids, read_jsonl, read_txt
from components.data.textfile import plain_name, plain_suffix, resolve_member

if TYPE_CHECKING:
    import datasets


# ----------------------------------------------------------------------------------------------
# HF datasets
# ----------------------------------------------------------------------------------------------
def load_hf_dataset(name_or_path: str, split: str) -> datasets.Dataset:
    """One split of a `save_to_disk` folder (offline; a Dataset or a DatasetDict) or of a hub dataset (needs network)."""
    import datasets

    if not Path(name_or_path).exists():
        return datasets.load_dataset(name_or_path, split=split)
    ds = datasets.load_from_disk(name_or_path)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(name_or_path, f"split {split!r} not in {list(ds)}", fix="set data.hf_split")
        ds = ds[split]
    return ds


def read_hf(name_or_path: str, split: str, text_field: str, title_field: str | None, id_field: str | None,
            on_error: str = "raise", ds: datasets.Dataset | None = None) -> tuple[list[Passage], ReadReport]:
    """Passages from one text column of an HF dataset (`ds`, else loaded by `load_hf_dataset`)."""
    report = ReadReport(files=[name_or_path])
    ds = load_hf_dataset(name_or_path, split) if ds is None else ds
    if text_field not in ds.column_names:
        raise DataError(name_or_path, f"no column {text_field!r} (columns: {ds.column_names})", fix="set data.jsonl_fields.text")
    out = []
    for i, rec in enumerate(ds):
        out.append({
            "doc_id": str(rec[id_field]) if id_field and id_field in rec else f"hf-{i}",
            "title": str(rec.get(title_field) or "") if title_field else "",
            "text": rec[text_field] or "",
            "spans": [],
            "_at": (name_or_path, i),
        })
    return drop_duplicate_ids(out, report, on_error, unit="row"), report


def read_hf_squad(name_or_path: str, ds: datasets.Dataset, on_error: str = "raise") -> SourceData:
    """A SQuAD-schema dataset as the records the BEIR loader gives for the shipped corpus folder:
    paragraphs as passages, questions as queries judged against their paragraph, and QA records."""
    from components.data.squad import squad_to_beir

    report = ReadReport(files=[name_or_path])
    conv = squad_to_beir(ds, where=name_or_path, on_error=on_error, skipped=report.skipped)
    qrels: dict[str, dict[str, int]] = {}
    for qid, doc, rel in conv.qrels:
        qrels.setdefault(qid, {})[doc] = rel
    qa = [{k: r[k] for k in ("id", "question", "answers", "positive_ctx")} for r in conv.qa]
    return beir_source_data({d["_id"]: {"title": d["title"], "text": d["text"]} for d in conv.corpus},
                            {q["_id"]: q["text"] for q in conv.queries}, {"hf": qrels}, qa, report)


def _hf_format(p: DataParams, columns: list[str]) -> str:
    """`data.hf_format`, with auto resolved by the dataset's columns."""
    from components.data.squad import SQUAD_COLUMNS, is_squad_schema

    if p.hf_format == "auto":
        return "squad" if is_squad_schema(columns) else "text"
    if p.hf_format == "squad" and not is_squad_schema(columns):
        raise DataError(p.path, f"data.hf_format is squad but the dataset lacks SQuAD's columns {sorted(set(SQUAD_COLUMNS) - set(columns))} "
                        f"(columns: {columns})", fix="set data.hf_format: text (and data.jsonl_fields.text), or give a SQuAD-schema dataset")
    return p.hf_format


def _load_hf(p: DataParams) -> SourceData:
    ds = load_hf_dataset(p.path, p.hf_split)
    if _hf_format(p, list(ds.column_names)) == "squad":
        return read_hf_squad(p.path, ds, p.on_error)
    f = p.jsonl_fields
    return SourceData(*read_hf(p.path, p.hf_split, f.text, f.title, f.id, p.on_error, ds=ds))


# ----------------------------------------------------------------------------------------------
# normalise + de-duplicate
# ----------------------------------------------------------------------------------------------
def normalize_text(text: str) -> str:
    """NFC + collapse all whitespace runs to one space + strip."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def normalize_and_dedupe(passages: list[Passage], min_chars: int = 1) -> tuple[list[Passage], dict]:
    """Normalise text, drop empty and too-short passages, drop exact duplicates (by text hash); keep the first.

    Empty (or whitespace-only) passages are counted apart from the merely short ones: an empty
    record is usually a reader or export problem worth seeing in the data card, a short one a choice.

    Ids are unique already (every reader refuses or skips a repeated id), so a passage keeps its id.
    Marked spans are kept only when normalisation leaves the text unchanged (offsets stay valid);
    the synthetic world emits normalised text, so its spans always survive.
    """
    seen: dict[str, str] = {}
    out: list[Passage] = []
    stats = {"input": len(passages), "empty_dropped": 0, "too_short_dropped": 0, "duplicates_dropped": 0}
    for p in passages:
        text = normalize_text(p["text"])
        if not text:
            stats["empty_dropped"] += 1
            continue
        if len(text) < min_chars:
            stats["too_short_dropped"] += 1
            continue
        h = hashlib.sha1(text.encode("utf-8")).hexdigest()
        if h in seen:
            stats["duplicates_dropped"] += 1
            continue
        seen[h] = p["doc_id"]
        spans = p.get("spans") or []
        out.append({"doc_id": p["doc_id"], "title": normalize_text(p.get("title") or ""), "text": text,
                    "spans": spans if text == p["text"] else []})
    stats["output"] = len(out)
    return out, stats


# ----------------------------------------------------------------------------------------------
# sources
# ----------------------------------------------------------------------------------------------
@dataclass
class SourceData:
    """What a source gives the stage: passages, and (when it has them) questions with gold docs."""

    passages: list[Passage]
    report: ReadReport
    queries: list[dict] = field(default_factory=list)  # {qid, text, split|None}
    qrels: dict[str, dict[str, int]] = field(default_factory=dict)  # qid -> {doc_id: rel}
    qrels_split: dict[str, str] = field(default_factory=dict)  # qid -> split, when the source has splits
    qa: list[dict] = field(default_factory=list)  # {id, question, answers, positive_ctx}


def _read_file_by_suffix(path: Path, p: DataParams) -> tuple[list[Passage], ReadReport]:
    f = p.jsonl_fields
    if plain_suffix(path) in (".jsonl", ".json"):  # c.jsonl.gz is JSON Lines too
        return read_jsonl(path, f.text, f.title, f.id, p.on_error)
    return read_txt(path, p.txt_mode, p.on_error)


def load_source(p: DataParams) -> SourceData:
    """Dispatch on `data.source`. Returns raw (not yet normalised) passages."""
    if p.source == "synthetic":
        from components.data.synthetic import generate_world

        w = generate_world(p.synthetic, p.split)
        queries = [{"qid": q["qid"], "text": q["text"], "split": q["split"]} for q in w.queries]
        qrels = {qid: rels for split in w.qrels.values() for qid, rels in split.items()}
        return SourceData(list(w.passages), ReadReport(files=["<synthetic>"], records_read=len(w.passages)),
                          queries, qrels, {q["qid"]: q["split"] for q in w.queries}, list(w.qa))
    if p.source == "txt":
        return SourceData(*read_txt(p.path, p.txt_mode, p.on_error))
    if p.source == "jsonl":
        f = p.jsonl_fields
        return SourceData(*read_jsonl(p.path, f.text, f.title, f.id, p.on_error))
    if p.source == "beir":
        return read_beir_source(Path(p.path), p.on_error)
    if p.source == "hf":
        return _load_hf(p)
    if p.source == "s3":
        return _load_s3(p)
    raise DataError("params.yaml", f"unknown data.source {p.source!r}")  # unreachable: validated


def _load_s3(p: DataParams) -> SourceData:
    from components.io import s3_download_prefix

    with tempfile.TemporaryDirectory(prefix="rr-s3-") as tmp:
        files = s3_download_prefix(p.path, tmp, endpoint_url=p.s3_endpoint_url)
        base = p.path.rstrip("/")

        def s3_name(text: str) -> str:
            # Errors must name the object, not the temp copy that is gone when the stage stops.
            for f in sorted(files, key=lambda f: -len(str(f))):  # longest first: a.txt.bak before a.txt
                rel = f.relative_to(tmp).as_posix()
                text = text.replace(str(f), base if base.endswith("/" + rel) else f"{base}/{rel}")
            return text.replace(str(tmp), base)

        try:
            data = _read_s3_files(p, files)
        except DataError as e:
            raise DataError(s3_name(e.path), s3_name(e.problem), line=e.line, fix=e.fix) from None
        data.report.skipped = [s3_name(s) for s in data.report.skipped]
        data.report.files = [p.path]
        return data


def _read_s3_files(p: DataParams, files: list[Path]) -> SourceData:
    fmt = p.format
    if fmt == "auto" and any(plain_name(f) == "corpus.jsonl" for f in files):
        fmt = "beir"
    if fmt == "beir":
        root = next(f for f in files if plain_name(f) == "corpus.jsonl").parent
        return read_beir_source(root, p.on_error)
    passages, report = [], ReadReport()
    for f in files:
        if fmt == "auto":  # each file by its own suffix: a prefix may mix .jsonl and .txt files
            ps, r = _read_file_by_suffix(f, p)
        elif fmt == "jsonl":
            ps, r = read_jsonl(f, p.jsonl_fields.text, p.jsonl_fields.title, p.jsonl_fields.id, p.on_error)
        else:
            ps, r = read_txt(f, p.txt_mode, p.on_error)
        passages += ps
        report.skipped += r.skipped
    # each file's ids are unique already; a prefix of several files must not repeat one across them
    return SourceData(drop_duplicate_ids(passages, report, p.on_error), report)


def beir_source_data(corpus: dict[str, dict[str, str]], queries: dict[str, str],
                     qrels_by_split: dict[str, dict[str, dict[str, int]]], qa: list[dict], report: ReadReport) -> SourceData:
    """Validated BEIR records -> SourceData. One qrels split leaves questions unsplit (prepare_corpus
    splits them by data.split); several keep a train/dev/test file's own split. Shared by the BEIR
    folder and the SQuAD-schema HF reader, so the two give the same records."""
    passages = [{"doc_id": d, "title": r["title"], "text": r["text"], "spans": []} for d, r in corpus.items()]
    report.records_read = len(passages)
    data = SourceData(passages, report, qa=qa)
    for split, qrels in qrels_by_split.items():
        for qid, rels in qrels.items():
            data.qrels.setdefault(qid, {}).update(rels)
            if split in ("train", "dev", "test") and len(qrels_by_split) > 1:
                data.qrels_split[qid] = split
    data.queries = [{"qid": qid, "text": text, "split": data.qrels_split.get(qid)} for qid, text in queries.items() if qid in data.qrels]
    return data


def read_beir_source(root: Path, on_error: str = "raise") -> SourceData:
    """A BEIR folder: corpus.jsonl (+ queries.jsonl, qrels/*.tsv, and an optional qa.jsonl), each plain or .gz."""
    from components.data import beir

    if not root.is_dir():
        raise DataError(root, "BEIR folder not found", fix="set data.path to a folder holding corpus.jsonl")
    report = ReadReport(files=[str(root)])
    corpus = beir.read_corpus(resolve_member(root, "corpus.jsonl"), on_error=on_error, skipped=report.skipped)
    doc_ids = set(corpus)
    queries: dict[str, str] = {}
    qrels_by_split: dict[str, dict[str, dict[str, int]]] = {}
    queries_file = resolve_member(root, "queries.jsonl")
    if queries_file.exists():
        queries = beir.read_queries(queries_file, on_error=on_error, skipped=report.skipped)
        for split, f in beir.qrels_files(root).items():
            qrels_by_split[split] = beir.read_qrels(f, known_queries=set(queries), known_docs=doc_ids,
                                                    on_error=on_error, skipped=report.skipped)
    qa_file = resolve_member(root, "qa.jsonl")
    qa = beir.read_qa(qa_file, known_docs=doc_ids, on_error=on_error, skipped=report.skipped) if qa_file.exists() else []
    return beir_source_data(corpus, queries, qrels_by_split, qa, report)
