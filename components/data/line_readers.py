"""Records from text files, line by line with precise errors: `iter_lines` (UTF-8 per line, so an
error names its line; gzip and the UTF-16/32 refusal are `textfile.py`'s), `read_txt`, `read_jsonl`,
the `ReadReport` every reader returns, and `drop_duplicate_ids` (a second record under an id already
read is bad input). `corpus.py` dispatches `data.source` to these and its other readers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from components.data.errors import DataError
from components.data.textfile import iter_raw_lines, plain_stem

Passage = dict  # {doc_id: str, title: str, text: str, spans: list[{start, end, label}]}, + `_at` from a file reader


@dataclass
class ReadReport:
    files: list[str] = field(default_factory=list)
    records_read: int = 0
    skipped: list[str] = field(default_factory=list)  # "file:line: problem", one per skipped record

    def skip(self, err: DataError) -> None:
        self.skipped.append(str(err))

    def as_dict(self) -> dict:
        return {
            "files": self.files,
            "records_read": self.records_read,
            "skipped": len(self.skipped),
            "skipped_examples": self.skipped[:20],
        }


# ----------------------------------------------------------------------------------------------
# line-level reading with precise errors
# ----------------------------------------------------------------------------------------------
def _require_file(path: Path) -> None:
    if not path.exists():
        raise DataError(path, "file not found", fix="check data.path in params.yaml (paths are relative to the repo root)")
    if path.is_dir():
        raise DataError(path, "is a folder, expected a file", fix="point data.path at the file, or use data.source: beir for a BEIR folder")
    if path.stat().st_size == 0:
        raise DataError(path, "file is empty", fix="give a non-empty corpus file")


def iter_lines(path: Path, report: ReadReport, on_error: str) -> Iterator[tuple[int, str]]:
    """(line_number, text) for each line, decoding UTF-8 per line so an error names its line.

    gzip is decompressed and a UTF-16/32 file refused whole (at line 1) by `iter_raw_lines`.
    """
    _require_file(path)
    report.files.append(str(path))
    for lineno, raw in iter_raw_lines(path):
        try:
            # utf-8-sig on line 1 drops the BOM that Windows editors write at the start of a file
            yield lineno, raw.decode("utf-8-sig" if lineno == 1 else "utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            err = DataError(path, f"not valid UTF-8 at byte {e.start} of the line", line=lineno,
                            fix="re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or set data.on_error: skip")
            if on_error == "skip":
                report.skip(err)
                continue
            raise err from None


def drop_duplicate_ids(passages: list[Passage], report: ReadReport, on_error: str, unit: str = "line") -> list[Passage]:
    """Keep the first record of each id; a later one raises naming both places, or is skipped and counted.

    Each passage carries `_at = (file, line)` from its reader, so a repeat in a second file under
    an s3:// prefix, or in an HF dataset (`unit="row"`), is named the same way.
    """
    first: dict[str, tuple[str, int]] = {}
    out: list[Passage] = []
    for p in passages:
        path, line = p["_at"]
        seen = first.get(p["doc_id"])
        if seen is None:
            first[p["doc_id"]] = (path, line)
            out.append(p)
            continue
        earlier = f"{unit} {seen[1]}" if seen[0] == path else f"{seen[0]}:{seen[1]}"
        err = DataError(path, f"duplicate id {p['doc_id']!r}: {unit} {line} repeats the id of {earlier}", line=line,
                        fix="give every record its own id (ids name passages in qrels and indexes), "
                            "or set data.on_error: skip to keep the first")
        if on_error != "skip":
            raise err
        report.skip(err)
    report.records_read = len(out)
    return out


def read_txt(path: str | Path, mode: str = "paragraph", on_error: str = "raise") -> tuple[list[Passage], ReadReport]:
    """`line`: one passage per non-empty line. `paragraph`: passages separated by blank lines."""
    path, report = Path(path), ReadReport()
    stem = plain_stem(path)  # c.txt.gz gives the ids c.txt gives
    out: list[Passage] = []
    buf: list[str] = []
    start = 0

    def flush() -> None:
        if buf:
            out.append({"doc_id": f"{stem}-{start}", "title": "", "text": " ".join(buf), "spans": [], "_at": (str(path), start)})
            buf.clear()

    for lineno, line in iter_lines(path, report, on_error):
        if not line.strip():
            flush()
            continue
        if mode == "line":
            out.append({"doc_id": f"{stem}-{lineno}", "title": "", "text": line, "spans": [], "_at": (str(path), lineno)})
            continue
        if not buf:
            start = lineno
        buf.append(line.strip())
    flush()
    report.records_read = len(out)
    return out, report


def _json_error(path: Path, lineno: int, problem: str, fix: str, report: ReadReport, on_error: str) -> None:
    err = DataError(path, problem, line=lineno, fix=fix)
    if on_error != "skip":
        raise err
    report.skip(err)


def read_jsonl(path: str | Path, text_field: str = "text", title_field: str | None = "title",
               id_field: str | None = "id", on_error: str = "raise") -> tuple[list[Passage], ReadReport]:
    path, report = Path(path), ReadReport()
    out: list[Passage] = []
    for lineno, line in iter_lines(path, report, on_error):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            _json_error(path, lineno, f"malformed JSON ({e.msg} at column {e.colno})",
                        "fix or remove the line, or set data.on_error: skip", report, on_error)
            continue
        except (ValueError, RecursionError) as e:  # an int over 4300 digits, or nesting deeper than the recursion limit
            _json_error(path, lineno, f"unreadable JSON ({type(e).__name__}: {str(e)[:80]})",
                        "fix or remove the line, or set data.on_error: skip", report, on_error)
            continue
        if not isinstance(rec, dict):
            _json_error(path, lineno, f"expected a JSON object, got {type(rec).__name__}",
                        "each line must be one object like {\"text\": ...}", report, on_error)
            continue
        text = rec.get(text_field)
        if not isinstance(text, str):
            problem = f"missing field {text_field!r}" if text is None else f"field {text_field!r} is {type(text).__name__}, not a string"
            _json_error(path, lineno, problem,
                        f"add it, or set data.jsonl_fields.text to the field holding the text (keys here: {sorted(rec)[:8]})",
                        report, on_error)
            continue
        doc_id = rec.get(id_field) if id_field else None
        title = rec.get(title_field) if title_field else None
        out.append({
            "doc_id": str(doc_id) if doc_id is not None else f"{plain_stem(path)}-{lineno}",  # c.jsonl.gz: c.jsonl's ids
            "title": title if isinstance(title, str) else "",
            "text": text,
            "spans": [],
            "_at": (str(path), lineno),
        })
    return drop_duplicate_ids(out, report, on_error), report
