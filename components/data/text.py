"""Text normalisation shared by answer matching (the reader's gold spans, BM25's has-answer test)
and the open-QA metrics, so that a span counts as the answer by one rule everywhere."""

from __future__ import annotations

import re
import string

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """SQuAD v1.1: lowercase, drop punctuation, drop the articles a/an/the, collapse whitespace.

    Same order as the official script (lower -> punctuation -> articles -> whitespace), so
    "state-of-the-art" becomes "stateoftheart" (punctuation is deleted, not turned into space).
    """
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())
