"""Salient spans for REALM's `salient_span_mask` (Guu et al. 2020, section 3.4, "Salient span masking").

REALM masks *one* named entity or date per query instead of random tokens: such spans need world
knowledge to fill in, so the masked LM only gets better by retrieving a useful document. The paper
found salient spans with a BERT NER tagger plus a regex date tagger. Here:

* `find_salient_spans(text, tagger)` -> `[(char_start, char_end, label), ...]`, sorted, non-overlapping.
  `tagger="regex"`: dependency-free (dates, years, numbers, capitalised names; see `_regex_spans`).
  `tagger="spacy"`: spaCy NER (`en_core_web_sm`); raises if spaCy or the model cannot be loaded.
  `tagger="auto"`: spaCy when it loads, else the regex tagger (a WARNING, once).
  `tagger` may also be a `SpanTagger` (`span_tagger_for(realm_params)`): the tagger plus the spaCy
  labels that count (`realm.span_types`, REALM's named entities and dates), and `.fallback` /
  `.kind`, what the run actually used (the REALM stage tags its MLflow run with it).
* `char_spans_to_token_spans(char_spans, offsets)` -> `[(tok_start, tok_end), ...]` (half-open),
  using the tokenizer's `[char_start, char_end)` offsets of each token.
* `salient_token_spans(block_row, tagger)`: a tokenized block's spans, grown to whole words;
  `block_spans` gives their token sequences, `contains_span` finds one in a token list (what the
  held-out probes' gold and the reader warm-up's documents are matched by).

Try it:
    .venv/bin/python -c "from components.data.salient_spans import find_salient_spans as f; \
print(f('On 12 March 1875 Zorvan Teluk crossed the New Ardel River with 1,200 men.', 'regex'))"
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from typing import Literal, Sequence, Union

log = logging.getLogger(__name__)

Span = tuple[int, int, str]
Tagger = Literal["auto", "regex", "spacy"]

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
# spaCy tagger (optional dependency: `pip install -e .[spacy]` + an English model)
# ----------------------------------------------------------------------------------------------
SPACY_MODEL = "en_core_web_sm"


@functools.lru_cache(maxsize=1)
def _load_spacy(model: str = SPACY_MODEL):
    import spacy  # noqa: PLC0415 - optional

    # Only NER is needed: the parser and lemmatizer would triple the cost per block.
    return spacy.load(model, disable=["parser", "lemmatizer", "tagger", "attribute_ruler"])


@functools.lru_cache(maxsize=1)
def spacy_available(model: str = SPACY_MODEL) -> bool:
    try:
        _load_spacy(model)
        return True
    except Exception as e:  # ImportError, OSError (model not installed), version mismatch
        # WARNING: the regex tagger also masks plain numbers and any capitalised run, not REALM's spans
        log.warning("salient spans: spaCy NER unavailable (%s: %s); span_tagger=auto falls back to the regex tagger "
                    "(capitalised runs, dates and numbers, not REALM's named entities). For REALM's spans: "
                    "pip install -e .[spacy] && python -m spacy download %s", type(e).__name__, e, model)
        return False


def _spacy_spans(text: str, types: frozenset[str] | None = None) -> list[Span]:
    doc = _load_spacy()(text)
    return sorted((e.start_char, e.end_char, e.label_) for e in doc.ents
                  if e.end_char > e.start_char and (not types or e.label_ in types))


@dataclass(frozen=True)
class SpanTagger:
    """A salient-span tagger: `requested` (auto | regex | spacy) and the spaCy labels that count
    (`types`; empty = every label). `kind` is the tagger actually used and `fallback` whether
    `auto` fell back to the regex tagger, resolved once per process."""

    requested: Tagger = "auto"
    types: tuple[str, ...] = ()

    @property
    def kind(self) -> Literal["regex", "spacy"]:
        return resolve_tagger(self.requested)

    @property
    def fallback(self) -> bool:
        return self.requested == "auto" and self.kind == "regex"

    def __call__(self, text: str) -> list[Span]:
        if not text:
            return []
        return _spacy_spans(text, frozenset(self.types)) if self.kind == "spacy" else _regex_spans(text)


def span_tagger_for(p) -> SpanTagger:
    """The tagger of `realm.span_tagger` / `realm.span_types` (p: components.config.RealmParams)."""
    return SpanTagger(p.span_tagger, tuple(p.span_types))


TaggerLike = Union[Tagger, SpanTagger]


def as_tagger(tagger: TaggerLike) -> SpanTagger:
    """A `SpanTagger`; a bare name keeps every label spaCy emits."""
    return tagger if isinstance(tagger, SpanTagger) else SpanTagger(tagger)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def resolve_tagger(tagger: TaggerLike = "auto") -> Literal["regex", "spacy"]:
    """The tagger `find_salient_spans` will actually use for `tagger`."""
    if isinstance(tagger, SpanTagger):
        tagger = tagger.requested
    if tagger == "regex":
        return "regex"
    if tagger == "spacy":
        _load_spacy()  # raises a clear ImportError/OSError when it cannot work
        return "spacy"
    if tagger == "auto":
        return "spacy" if spacy_available() else "regex"
    raise ValueError(f"tagger must be auto|regex|spacy, got {tagger!r}")


def find_salient_spans(text: str, tagger: TaggerLike = "auto") -> list[Span]:
    """Named entities / dates (/ numbers, regex) in `text` as sorted `(char_start, char_end, label)`."""
    return as_tagger(tagger)(text)


def char_spans_to_token_spans(
    char_spans: Sequence[Sequence[int]], offsets: Sequence[Sequence[int]]
) -> list[tuple[int, int]]:
    """Map `[char_start, char_end)` spans to half-open token spans `[tok_start, tok_end)`.

    A token belongs to a span when their character ranges overlap. (The released REALM code
    keeps only tokens *inside* the span; for spans on word boundaries, as both taggers produce,
    the two agree, and on a boundary inside a word overlapping masks the whole piece instead of
    leaking half of it.) Zero-width tokens (specials, offsets (0, 0)) are ignored. Spans
    that cover no token (e.g. text beyond the block) are dropped; duplicates are removed.
    `char_spans` entries may carry a third element (the label); it is ignored.
    """
    starts = [int(o[0]) for o in offsets]
    ends = [int(o[1]) for o in offsets]
    out: list[tuple[int, int]] = []
    for span in char_spans:
        cs, ce = int(span[0]), int(span[1])
        hit = [i for i, (s, e) in enumerate(zip(starts, ends)) if e > s and s < ce and cs < e]
        if hit:
            ts = (hit[0], hit[-1] + 1)
            if ts not in out:
                out.append(ts)
    return out


# ----------------------------------------------------------------------------------------------
# salient spans of a tokenized block
# ----------------------------------------------------------------------------------------------
def _as_list(x) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def whole_words(s: int, e: int, word_ids: Sequence[int]) -> tuple[int, int]:
    """Grow [s, e) to whole words: masking half a word lets the reader read the answer off the rest."""
    while s > 0 and word_ids[s - 1] == word_ids[s]:
        s -= 1
    while e < len(word_ids) and word_ids[e] == word_ids[e - 1]:
        e += 1
    return s, e


def salient_token_spans(block_row: dict, tagger: TaggerLike = "auto") -> list[tuple[int, int]]:
    """Whole-word token spans of the block's salient spans (source-marked `char_spans`, else tagged)."""
    char_spans = _as_list(block_row.get("char_spans") or [])
    if len(char_spans) == 0:
        char_spans = [(s, e) for s, e, _ in find_salient_spans(block_row.get("text") or "", tagger)]
    word_ids = _as_list(block_row["word_ids"])
    spans = char_spans_to_token_spans(char_spans, _as_list(block_row["offsets"]))
    return sorted({whole_words(s, e, word_ids) for s, e in spans})


def block_spans(block_row: dict, tagger: TaggerLike = "auto") -> set[tuple[int, ...]]:
    """The token sequences of a block's salient spans."""
    ids = [int(t) for t in block_row["input_ids"]]
    return {tuple(ids[s:e]) for s, e in salient_token_spans(block_row, tagger) if e > s}


def contains_span(hay: Sequence[int], needle: tuple[int, ...]) -> bool:
    """Whether the token sequence `needle` occurs in `hay`, in order."""
    n = len(needle)
    return any(tuple(hay[i:i + n]) == needle for i in range(len(hay) - n + 1))
