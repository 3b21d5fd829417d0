"""Read and write evaluation data: BEIR folders and open-QA `qa.jsonl` files.

BEIR layout (https://github.com/beir-cellar/beir):
    corpus.jsonl        {"_id": str, "title": str, "text": str}      one passage per line
    queries.jsonl       {"_id": str, "text": str}                    one question per line
    qrels/<split>.tsv   header `query-id<TAB>corpus-id<TAB>score`, then one int judgement per row
qa.jsonl (open QA):     {"question": str, "answers": [str, ...], "id"?: str, "positive_ctx"?: doc_id}

Any of these files may be gzip-compressed (`corpus.jsonl.gz`, `qrels/test.tsv.gz`, ...): the readers
detect gzip by its magic bytes and read it exactly as the plain file (`components.data.textfile`).
A folder holding both `x` and `x.gz` is refused, naming both.

Every bad input raises `DataError` naming the file, the line and a fix. With `on_error="skip"`
the bad line is skipped and *counted*: its message is appended to the caller's `skipped` list
(pass one; `load_beir` does and returns the count), and a warning with the count is logged,
so nothing is ever dropped silently. Structural problems (missing file, wrong qrels header)
always raise: there is no line to skip.

    from components.data.beir import load_beir
    data = load_beir("data/corpus/beir", split="test")      # data.corpus, data.queries, data.qrels
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterator, Mapping

from components.data.errors import DataError
from components.data.textfile import iter_raw_lines, plain_name, plain_stem, resolve_member
from components.io import write_text_atomic

log = logging.getLogger(__name__)

QRELS_HEADER = ("query-id", "corpus-id", "score")
ON_ERROR = ("raise", "skip")


# ----------------------------------------------------------------------------------------------
# line-level plumbing: every problem becomes a DataError that names file + line
# ----------------------------------------------------------------------------------------------
class _Lines:
    """Iterate the non-blank lines of a UTF-8 file (gzip or not) as (line_number, text), raising or skipping bad ones."""

    def __init__(self, path: str | os.PathLike, on_error: str, skipped: list[str] | None, what: str):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        self.path, self.on_error, self.what = Path(path), on_error, what
        self.sink = skipped
        self.n_skipped = 0
        if not self.path.exists():
            raise DataError(self.path, f"{what} file not found", fix="create it, or point the eval set at a folder that has it")
        if self.path.is_dir():
            raise DataError(self.path, f"is a folder, expected the {what} file", fix="give the file's path")

    def fail(self, line: int, problem: str, fix: str) -> None:
        """Raise (on_error=raise) or record the bad line (on_error=skip)."""
        err = DataError(self.path, problem, line=line, fix=fix)
        if self.on_error == "raise":
            raise err
        self.n_skipped += 1
        if self.sink is not None:
            self.sink.append(str(err))
        if self.n_skipped <= 3:
            log.warning("skipping bad line: %s", err)

    def done(self) -> None:
        if self.n_skipped:
            log.warning("%s: skipped %d bad line(s) (on_error=skip)", self.path, self.n_skipped)

    def __iter__(self) -> Iterator[tuple[int, str]]:
        # gzip is decompressed and a UTF-16/32 file refused whole by iter_raw_lines
        for lineno, raw in iter_raw_lines(self.path):
            try:
                # utf-8-sig on line 1 drops a BOM that Windows editors add.
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                self.fail(lineno, f"not valid UTF-8 (byte {e.start} of the line)",
                          "re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 in > out`")
                continue
            text = text.rstrip("\r\n")
            if text.strip():  # blank lines (e.g. a trailing one) carry no record
                yield lineno, text

    def json_objects(self) -> Iterator[tuple[int, dict]]:
        for lineno, text in self:
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                self.fail(lineno, f"malformed JSON ({e.msg} at column {e.colno})",
                          "write one JSON object per line (JSON Lines), no trailing commas or comments")
                continue
            except (ValueError, RecursionError) as e:  # an int over 4300 digits, or nesting past the recursion limit
                self.fail(lineno, f"unreadable JSON ({type(e).__name__}: {str(e)[:80]})", "write one flat JSON object per line")
                continue
            if not isinstance(obj, dict):
                self.fail(lineno, f"expected a JSON object, got {type(obj).__name__}",
                          "write one {...} object per line")
                continue
            yield lineno, obj


_JSON_TYPES = {str: "string", list: "list"}
_BAD = object()  # a field that failed its check (the line was reported and must be skipped)


def _field(lines: _Lines, lineno: int, obj: dict, key: str, kind: type, required: bool = True) -> Any:
    """obj[key] checked for presence and type; None when optional and absent; _BAD after lines.fail."""
    value = obj.get(key)
    kind_name = _JSON_TYPES.get(kind, kind.__name__)
    if value is None:
        if not required:
            return None
        lines.fail(lineno, f"missing or null field {key!r} (keys present: {sorted(obj)})",
                   f"add a {kind_name} {key!r} to every line")
        return _BAD
    # ids may be written as numbers by some exporters; BEIR treats them as strings.
    if kind is str and key in ("_id", "id") and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, kind):
        lines.fail(lineno, f"field {key!r} must be a {kind_name}, got {type(value).__name__}",
                   f"write {key!r} as a JSON {kind_name}")
        return _BAD
    return value


def _fields(lines: _Lines, lineno: int, obj: dict, *specs: tuple[str, type, bool]) -> list | None:
    """Several `_field`s; stops at the first bad one so a bad line is reported (and counted) once."""
    out = []
    for key, kind, required in specs:
        value = _field(lines, lineno, obj, key, kind, required)
        if value is _BAD:
            return None
        out.append(value)
    return out


def _check_id(lines: _Lines, lineno: int, key: str, value: str, first_line: dict[str, int]) -> bool:
    """A usable id not in `first_line` (id -> line of the record kept). Ids are the identity of
    everything downstream, so a repeat names both lines (skip mode keeps the first)."""
    if not value.strip() or any(c in value for c in "\t\r\n"):
        lines.fail(lineno, f"{key} {value!r} is empty or contains a tab/newline", "use non-empty single-line ids")
        return False
    if value in first_line:
        lines.fail(lineno, f"duplicate {key} {value!r}: line {lineno} repeats the id of line {first_line[value]}",
                   "give every record its own id (de-duplicate the file), or set data.on_error: skip to keep the first")
        return False
    return True


# ----------------------------------------------------------------------------------------------
# readers
# ----------------------------------------------------------------------------------------------
def read_corpus(path: str | os.PathLike, *, on_error: str = "raise", skipped: list[str] | None = None) -> dict[str, dict[str, str]]:
    """BEIR corpus.jsonl -> {doc_id: {"title", "text"}} in file order. `title` is optional ("")."""
    lines = _Lines(path, on_error, skipped, "BEIR corpus")
    corpus: dict[str, dict[str, str]] = {}
    first_line: dict[str, int] = {}
    for lineno, obj in lines.json_objects():
        fields = _fields(lines, lineno, obj, ("_id", str, True), ("text", str, True), ("title", str, False))
        if fields is None:
            continue
        doc_id, text, title = fields
        if not _check_id(lines, lineno, "_id", doc_id, first_line):
            continue
        corpus[doc_id] = {"title": title or "", "text": text}
        first_line[doc_id] = lineno
    lines.done()
    return corpus


def read_queries(path: str | os.PathLike, *, on_error: str = "raise", skipped: list[str] | None = None) -> dict[str, str]:
    """BEIR queries.jsonl -> {query_id: text} in file order."""
    lines = _Lines(path, on_error, skipped, "BEIR queries")
    queries: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for lineno, obj in lines.json_objects():
        fields = _fields(lines, lineno, obj, ("_id", str, True), ("text", str, True))
        if fields is None:
            continue
        qid, text = fields
        if not _check_id(lines, lineno, "_id", qid, first_line):
            continue
        if not text.strip():
            lines.fail(lineno, f"query {qid!r} has empty text", "drop the query or give it text")
            continue
        queries[qid] = text
        first_line[qid] = lineno
    lines.done()
    return queries


def read_qrels(
    path: str | os.PathLike,
    *,
    known_queries: Collection[str] | None = None,
    known_docs: Collection[str] | None = None,
    on_error: str = "raise",
    skipped: list[str] | None = None,
) -> dict[str, dict[str, int]]:
    """BEIR qrels/<split>.tsv -> {query_id: {doc_id: score}}.

    The header row `query-id corpus-id score` is required (BEIR's own loader skips line 1 blindly,
    which silently drops a judgement from a header-less file; we refuse instead). Rows naming a
    query or doc outside `known_queries` / `known_docs` (when given) are errors, as are non-int
    scores and a pair judged twice with different scores.
    """
    lines = _Lines(path, on_error, skipped, "BEIR qrels")
    qrels: dict[str, dict[str, int]] = {}
    rows = iter(lines)
    first = next(rows, None)
    if first is None:
        raise DataError(lines.path, "qrels file has no header and no rows",
                        fix="write the header `query-id\\tcorpus-id\\tscore` and one row per judgement")
    lineno, header = first
    if tuple(c.strip() for c in header.split("\t")) != QRELS_HEADER:
        raise DataError(lines.path, f"first line must be the header `query-id<TAB>corpus-id<TAB>score`, got {header[:80]!r}",
                        line=lineno, fix="add that header line (tab-separated) above the judgements")
    for lineno, text in rows:
        cols = text.split("\t")
        if len(cols) != 3:
            lines.fail(lineno, f"expected 3 tab-separated columns (query-id, corpus-id, score), got {len(cols)}",
                       "separate the three columns with single tabs")
            continue
        qid, doc_id, score_s = (c.strip() for c in cols)
        try:
            score = int(score_s)
        except ValueError:
            lines.fail(lineno, f"score {score_s!r} is not an integer", "write relevance as an int (0, 1, 2, ...)")
            continue
        if not qid or not doc_id:
            lines.fail(lineno, "empty query-id or corpus-id", "fill both id columns")
            continue
        if known_queries is not None and qid not in known_queries:
            lines.fail(lineno, f"query-id {qid!r} is not in queries.jsonl",
                       "add the query to queries.jsonl or drop this row")
            continue
        if known_docs is not None and doc_id not in known_docs:
            lines.fail(lineno, f"corpus-id {doc_id!r} is not in corpus.jsonl",
                       "add the passage to corpus.jsonl or drop this row")
            continue
        prev = qrels.get(qid, {}).get(doc_id)
        if prev is not None and prev != score:
            lines.fail(lineno, f"({qid!r}, {doc_id!r}) judged twice with different scores ({prev} and {score})",
                       "keep one judgement per query/doc pair")
            continue
        qrels.setdefault(qid, {})[doc_id] = score
    lines.done()
    return qrels


def read_qa(
    path: str | os.PathLike,
    *,
    known_docs: Collection[str] | None = None,
    on_error: str = "raise",
    skipped: list[str] | None = None,
) -> list[dict]:
    """qa.jsonl -> [{"id", "question", "answers", "positive_ctx"?, "split"?}] in file order.

    `id` defaults to `<file stem>-<line>`; `positive_ctx` (a gold doc_id) and `split` are kept
    only when the line has them. Answers must be a non-empty list of non-empty strings: an empty
    gold would normalise to "" and score an empty prediction as exact.
    """
    lines = _Lines(path, on_error, skipped, "QA")
    out: list[dict] = []
    first_line: dict[str, int] = {}
    for lineno, obj in lines.json_objects():
        fields = _fields(lines, lineno, obj, ("question", str, True), ("answers", list, True), ("id", str, False),
                         ("positive_ctx", str, False), ("split", str, False))
        if fields is None:
            continue
        question, answers, qa_id, pos, split = fields
        qa_id = qa_id if qa_id is not None else f"{plain_stem(lines.path)}-{lineno}"  # qa.jsonl.gz: the same ids
        if not _check_id(lines, lineno, "id", qa_id, first_line):
            continue
        if not question.strip():
            lines.fail(lineno, "empty question", "drop the line or give it a question")
            continue
        if not answers or not all(isinstance(a, str) and a.strip() for a in answers):
            lines.fail(lineno, f"answers must be a non-empty list of non-empty strings, got {answers!r:.80}",
                       'write e.g. "answers": ["Paris"]')
            continue
        if pos is not None and known_docs is not None and pos not in known_docs:
            lines.fail(lineno, f"positive_ctx {pos!r} is not in the corpus", "fix the doc id or drop positive_ctx")
            continue
        row = {"id": qa_id, "question": question, "answers": list(answers)}
        if pos is not None:
            row["positive_ctx"] = pos
        if split is not None:
            row["split"] = split
        first_line[qa_id] = lineno
        out.append(row)
    lines.done()
    return out


@dataclass
class BeirData:
    """One BEIR split: the corpus, the split's judged queries, and its qrels."""

    corpus: dict[str, dict[str, str]]  # doc_id -> {"title", "text"}
    queries: dict[str, str]  # query_id -> text; only queries judged in this split (as BEIR does)
    qrels: dict[str, dict[str, int]]  # query_id -> {doc_id: score}
    skipped: list[str] = field(default_factory=list)  # "file:line: problem -- fix: ..." per skipped line

    @property
    def n_skipped(self) -> int:
        return len(self.skipped)


def qrels_files(folder: str | os.PathLike) -> dict[str, Path]:
    """{split: file} for `qrels/<split>.tsv` and `qrels/<split>.tsv.gz`, by split name; a split in
    both forms is refused (resolve_member names both)."""
    qdir = Path(folder) / "qrels"
    if not qdir.is_dir():
        return {}
    names = sorted({plain_name(f) for f in qdir.iterdir() if plain_name(f).endswith(".tsv")})
    return {Path(n).stem: resolve_member(qdir, n) for n in names}


def load_beir(folder: str | os.PathLike, split: str = "test", *, on_error: str = "raise") -> BeirData:
    """Read corpus.jsonl, queries.jsonl and qrels/<split>.tsv (each plain or .gz) from a BEIR folder, cross-checked."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(folder, "BEIR folder not found", fix="point the eval set's beir_path at a folder holding corpus.jsonl")
    splits = qrels_files(folder)
    if split not in splits:
        raise DataError(folder / "qrels" / f"{split}.tsv", f"no qrels for split {split!r} (splits present: {sorted(splits)})",
                        fix="pick one of the present splits, or write qrels/<split>.tsv")
    qrels_path = splits[split]
    skipped: list[str] = []
    corpus = read_corpus(resolve_member(folder, "corpus.jsonl"), on_error=on_error, skipped=skipped)
    queries = read_queries(resolve_member(folder, "queries.jsonl"), on_error=on_error, skipped=skipped)
    qrels = read_qrels(qrels_path, known_queries=queries, known_docs=corpus, on_error=on_error, skipped=skipped)
    return BeirData(corpus, {q: queries[q] for q in qrels}, qrels, skipped)


# ----------------------------------------------------------------------------------------------
# writers (atomic: temp sibling + os.replace, via components.io)
# ----------------------------------------------------------------------------------------------
def _jsonl(rows: Iterator[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def write_beir(
    folder: str | os.PathLike,
    corpus: Mapping[str, Mapping[str, str]],
    queries: Mapping[str, str],
    qrels_by_split: Mapping[str, Mapping[str, Mapping[str, int]]],
) -> Path:
    """Write corpus.jsonl, queries.jsonl and qrels/<split>.tsv; every file atomically.

    Everything is validated before the first write, so a bad qrels entry leaves no partial folder.
    """
    folder = Path(folder)
    for kind, ids in (("doc", corpus), ("query", queries)):
        for i in ids:
            if not isinstance(i, str) or not i.strip() or any(c in i for c in "\t\r\n"):
                raise ValueError(f"{kind} id {i!r} must be a non-empty single-line string without tabs")
    for split, qrels in qrels_by_split.items():
        for qid, rels in qrels.items():
            if qid not in queries:
                raise ValueError(f"qrels[{split!r}] names query {qid!r}, which is not in `queries`")
            for doc_id, score in rels.items():
                if doc_id not in corpus:
                    raise ValueError(f"qrels[{split!r}][{qid!r}] names doc {doc_id!r}, which is not in `corpus`")
                if not isinstance(score, int) or isinstance(score, bool):
                    raise ValueError(f"qrels[{split!r}][{qid!r}][{doc_id!r}] = {score!r} must be an int")
    write_text_atomic(folder / "corpus.jsonl", _jsonl(
        {"_id": d, "title": c.get("title") or "", "text": c["text"]} for d, c in corpus.items()))
    write_text_atomic(folder / "queries.jsonl", _jsonl({"_id": q, "text": t} for q, t in queries.items()))
    for split, qrels in qrels_by_split.items():
        body = "".join(f"{q}\t{d}\t{s}\n" for q, rels in qrels.items() for d, s in rels.items())
        write_text_atomic(folder / "qrels" / f"{split}.tsv", "\t".join(QRELS_HEADER) + "\n" + body)
    return folder


def write_qa(path: str | os.PathLike, rows: list[dict]) -> Path:
    """Write a qa.jsonl atomically (id, question, answers, positive_ctx when present)."""
    keys = ("id", "question", "answers", "positive_ctx")
    return write_text_atomic(path, _jsonl({k: r[k] for k in keys if r.get(k) is not None} for r in rows))
