"""SQuAD-schema rows -> the BEIR + open-QA records the repo ships in `corpora/squad-v1.1-dev-a0-11/`.

One conversion serves both users of SQuAD: `scripts/build_shipped_corpus.py` (which writes the
shipped folder from the hub's `rajpurkar/squad`) and `data.source: hf` (which reads a SQuAD-schema
dataset, from the hub or a `save_to_disk` folder, as the same records the BEIR loader gives for
that folder). The schema is the hub's: one row per question,

    id, title, context, question, answers {text: [str, ...], answer_start: [int, ...]}

and the records are

    corpus   {"_id": "AA-PPP", "title", "text": context, "metadata": {"article": AA}}
             article AA in order of first appearance of its title, paragraph PPP in order within it;
             the title as words (`Super_Bowl_50` -> `Super Bowl 50`: SQuAD stores the URL form)
    queries  {"_id": id, "text": question, "metadata": {"article": AA}}
    qrels    (id, "AA-PPP", 1): a question is judged against the paragraph it was asked on
    qa       {"id", "question", "answers": distinct non-empty answer texts in order,
              "positive_ctx": "AA-PPP", "answer_starts": every annotator's start, "article": AA}

Question and context text is kept as the dataset has it (prepare_corpus normalises passages; the
shipped queries keep SQuAD's trailing spaces). A question without an answer (SQuAD v2's
unanswerable ones) stays a retrieval query on its paragraph but gets no QA record: open QA scores
answers, and it has none.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from components.data.errors import DataError

log = logging.getLogger(__name__)

SQUAD_COLUMNS = ("id", "title", "context", "question", "answers")


def is_squad_schema(columns: Iterable[str]) -> bool:
    """True when a dataset has every SQuAD column (the hub's `rajpurkar/squad`, `squad_v2`, ...)."""
    return set(SQUAD_COLUMNS) <= set(columns)


@dataclass
class SquadBeir:
    """The converted records, each list in the order the shipped files hold them."""

    corpus: list[dict] = field(default_factory=list)  # {"_id", "title", "text", "metadata": {"article"}}
    queries: list[dict] = field(default_factory=list)  # {"_id", "text", "metadata": {"article"}}
    qrels: list[tuple[str, str, int]] = field(default_factory=list)  # (query id, doc id, 1)
    qa: list[dict] = field(default_factory=list)  # {"id", "question", "answers", "positive_ctx", "answer_starts", "article"}
    unanswerable: int = 0  # questions with no answer text: queries, not QA records


class _Rows:
    """Raise or skip-and-count a bad row, as the line readers do (`where:row: problem -- fix`)."""

    def __init__(self, where: str, on_error: str, skipped: list[str] | None):
        self.where, self.on_error, self.skipped = where, on_error, skipped

    def fail(self, row: int, problem: str, fix: str) -> None:
        err = DataError(self.where, f"row {row}: {problem}", fix=fix)
        if self.on_error != "skip":
            raise err
        if self.skipped is not None:
            self.skipped.append(str(err))


def _answers(value: Any) -> tuple[list[str], list[int]] | None:
    """(distinct non-empty texts in order, every start) from SQuAD's answers struct; None if malformed."""
    if not isinstance(value, Mapping) or not isinstance(value.get("text"), list):
        return None
    texts = [t for t in value["text"] if isinstance(t, str) and t.strip()]
    starts = value.get("answer_start") or []
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in starts):
        return None
    return list(dict.fromkeys(texts)), list(starts)


def squad_to_beir(rows: Iterable[Mapping[str, Any]], *, articles: range | None = None, where: str = "<squad rows>",
                  on_error: str = "raise", skipped: list[str] | None = None) -> SquadBeir:
    """Convert SQuAD-schema rows (see the module doc); `articles` keeps only those article indexes.

    Bad rows (a missing or empty id/question, a repeated id, a malformed answers struct) raise
    `DataError` naming `where` and the row, or with `on_error="skip"` are skipped and appended to
    `skipped`, as the BEIR readers do with bad lines.
    """
    bad = _Rows(where, on_error, skipped)
    out = SquadBeir()
    article_of: dict[str, int] = {}  # title -> article index, in order of first appearance
    doc_of: dict[tuple[int, str], str] = {}  # (article, context) -> doc id
    paragraphs: dict[int, int] = {}  # article -> paragraphs so far
    first_row: dict[str, int] = {}  # question id -> row it was read from
    for i, row in enumerate(rows):
        raw_title = str(row.get("title") or "")
        article = article_of.setdefault(raw_title, len(article_of))
        title = raw_title.replace("_", " ")  # Wikipedia's URL form -> the article's name
        if articles is not None and article not in articles:
            continue
        qid, question, context = row.get("id"), row.get("question"), row.get("context")
        if not isinstance(context, str):
            bad.fail(i, f"context is {type(context).__name__}, not a string", "give every row its paragraph")
            continue
        # the paragraph is registered before its question is checked: a bad question loses no passage
        key = (article, context)
        if key not in doc_of:
            doc_of[key] = f"{article:02d}-{paragraphs.get(article, 0):03d}"
            paragraphs[article] = paragraphs.get(article, 0) + 1
            out.corpus.append({"_id": doc_of[key], "title": title, "text": context, "metadata": {"article": article}})
        doc = doc_of[key]
        qid = str(qid) if isinstance(qid, (str, int)) and not isinstance(qid, bool) else None
        if not qid or not qid.strip() or any(c in qid for c in "\t\r\n"):
            bad.fail(i, f"id {row.get('id')!r} is missing, empty or contains a tab/newline", "give every question a single-line id")
            continue
        if qid in first_row:
            bad.fail(i, f"duplicate id {qid!r}: row {i} repeats the id of row {first_row[qid]}",
                     "give every question its own id, or set data.on_error: skip to keep the first")
            continue
        if not isinstance(question, str) or not question.strip():
            bad.fail(i, f"question {qid!r} is missing or empty", "drop the row or give it a question")
            continue
        answers = _answers(row.get("answers"))
        if answers is None:
            bad.fail(i, f"answers of {qid!r} is not SQuAD's {{text: [str], answer_start: [int]}}: {row.get('answers')!r:.80}",
                     "convert the dataset to the SQuAD schema")
            continue
        first_row[qid] = i
        out.queries.append({"_id": qid, "text": question, "metadata": {"article": article}})
        out.qrels.append((qid, doc, 1))
        texts, starts = answers
        if not texts:
            out.unanswerable += 1
            continue
        out.qa.append({"id": qid, "question": question, "answers": texts, "positive_ctx": doc,
                       "answer_starts": starts, "article": article})
    if out.unanswerable:
        log.info("%s: %d question(s) without an answer kept as retrieval queries, without QA records", where, out.unanswerable)
    return out
