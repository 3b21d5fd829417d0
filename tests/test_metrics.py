"""Retrieval metrics against hand-computed values, SQuAD EM/F1, and the BEIR / qa.jsonl readers."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import ir_measures
import pytest
from ir_measures import RR, nDCG

from components.data.errors import DataError
from components.data.beir import load_beir, read_qa, read_qrels, read_queries, write_beir, write_qa
from components.eval.metrics import (canonical_run, exact_match, f1, normalize_answer, qa_metrics,
                                     retrieval_metrics)

log2 = math.log2


# ----------------------------------------------------------------------------------------------
# retrieval: a hand-worked 3-query, 5-doc case
# ----------------------------------------------------------------------------------------------
QRELS = {
    "q1": {"d1": 1, "d3": 1, "d2": 0},  # two relevant docs, d2 judged non-relevant
    "q2": {"d5": 2, "d4": 1},  # graded: d5 highly relevant
    "q3": {"d2": 1},  # its relevant doc is never retrieved
}
RUN = {
    "q1": {"d2": 0.9, "d1": 0.8, "d4": 0.7, "d3": 0.6, "d5": 0.5},  # ranks: d2 d1 d4 d3 d5
    "q2": {"d5": 0.9, "d3": 0.5, "d4": 0.4, "d1": 0.3, "d2": 0.2},  # ranks: d5 d3 d4 d1 d2
    "q3": {"d1": 0.3, "d3": 0.2},
}


def test_hand_worked_metrics():
    m = retrieval_metrics(QRELS, RUN, recall_at=[1, 2, 5])
    pq = m["per_query"]

    # q1: relevant d1 at rank 2, d3 at rank 4 (gain 1 each; discount 1/log2(rank+1)).
    #   DCG@10 = 1/log2(3) + 1/log2(5); ideal ranking d1, d3: IDCG = 1/log2(2) + 1/log2(3)
    ndcg1 = (1 / log2(3) + 1 / log2(5)) / (1 / log2(2) + 1 / log2(3))  # = 0.6509...
    rr1 = 1 / 2  # first relevant at rank 2
    r1 = {1: 0 / 2, 2: 1 / 2, 5: 2 / 2}  # relevant found in top k / 2 relevant
    # q2: d5 (gain 2) at rank 1, d4 (gain 1) at rank 3.
    #   DCG = 2/log2(2) + 1/log2(4) = 2.5; IDCG = 2/log2(2) + 1/log2(3)
    ndcg2 = (2 / log2(2) + 1 / log2(4)) / (2 / log2(2) + 1 / log2(3))  # = 0.9502...
    rr2 = 1 / 1
    r2 = {1: 1 / 2, 2: 1 / 2, 5: 2 / 2}
    # q3: d2 not in the run: every metric is 0.
    ndcg3 = rr3 = 0.0
    r3 = {1: 0.0, 2: 0.0, 5: 0.0}

    assert pq["q1"]["ndcg_at_10"] == pytest.approx(ndcg1, abs=1e-9)
    assert pq["q2"]["ndcg_at_10"] == pytest.approx(ndcg2, abs=1e-9)
    assert pq["q3"]["ndcg_at_10"] == 0.0
    assert (pq["q1"]["mrr_at_10"], pq["q2"]["mrr_at_10"], pq["q3"]["mrr_at_10"]) == pytest.approx((rr1, rr2, rr3))
    for k in (1, 2, 5):
        got = [pq[q][f"recall_at_{k}"] for q in ("q1", "q2", "q3")]
        assert got == pytest.approx([r1[k], r2[k], r3[k]]), k

    # means over the 3 judged queries
    assert m["ndcg_at_10"] == pytest.approx((ndcg1 + ndcg2 + ndcg3) / 3)  # = 0.5337...
    assert m["mrr_at_10"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert m["recall_at_1"] == pytest.approx((0 + 0.5 + 0) / 3)
    assert m["recall_at_2"] == pytest.approx((0.5 + 0.5 + 0) / 3)
    assert m["recall_at_5"] == pytest.approx((1 + 1 + 0) / 3)
    assert (m["n_queries"], m["n_missing"], m["n_no_relevant"]) == (3, 0, 0)


def test_mrr_cutoff_is_10():
    # first relevant doc at rank 11: RR@10 = 0, nDCG@10 = 0, but Recall@20 = 1.
    run = {"q": {f"n{i:02d}": 100.0 - i for i in range(10)} | {"rel": 50.0}}
    m = retrieval_metrics({"q": {"rel": 1}}, run, recall_at=[10, 20])
    assert m["mrr_at_10"] == 0.0 and m["ndcg_at_10"] == 0.0
    assert m["recall_at_10"] == 0.0 and m["recall_at_20"] == 1.0


def test_ties_are_broken_by_doc_id_ascending_and_order_free():
    qrels = {"q": {"b": 1}}
    # a and b tie at 1.0: canonical order is (score desc, doc id asc) -> a, b, c; b is at rank 2.
    expected = {"ndcg_at_10": 1 / log2(3), "mrr_at_10": 1 / 2, "recall_at_1": 0.0, "recall_at_2": 1.0}
    items = [("b", 1.0), ("a", 1.0), ("c", 0.5)]
    for seed in range(4):  # dict insertion order must not matter
        random.Random(seed).shuffle(items)
        m = retrieval_metrics(qrels, {"q": dict(items)}, recall_at=[1, 2])
        assert {k: m[k] for k in expected} == pytest.approx(expected)


def test_raw_providers_disagree_on_ties_which_is_why_we_canonicalise():
    # The library behaviour canonical_run guards against: trec_eval ranks tied docs by doc id
    # *descending* (b before a), ir-measures' msmarco provider (RR@10) by doc id ascending.
    qrels, run = {"q": {"b": 1}}, {"q": {"a": 1.0, "b": 1.0}}
    raw_ndcg = ir_measures.pytrec_eval.calc_aggregate([nDCG @ 10], qrels, run)[nDCG @ 10]
    raw_rr = ir_measures.msmarco.calc_aggregate([RR @ 10], qrels, run)[RR @ 10]
    assert raw_ndcg == pytest.approx(1.0)  # b first
    assert raw_rr == pytest.approx(0.5)  # a first
    m = retrieval_metrics(qrels, run, recall_at=[1])
    assert m["ndcg_at_10"] == pytest.approx(1 / log2(3)) and m["mrr_at_10"] == pytest.approx(0.5)


def test_canonical_run_keeps_order_and_removes_ties():
    c = canonical_run({"q": {"x": 0.5, "y": 2.0, "z": 0.5}})["q"]
    assert sorted(c, key=c.get, reverse=True) == ["y", "x", "z"]
    assert len(set(c.values())) == 3
    with pytest.raises(ValueError, match="NaN"):
        canonical_run({"q": {"x": float("nan")}})


def test_missing_and_unjudgeable_queries_are_counted():
    qrels = {"q1": {"d1": 1}, "q2": {"d2": 1}, "q3": {"d3": 0}}  # q3: nothing relevant
    run = {"q1": {"d1": 1.0}, "other": {"d1": 1.0}}  # q2 absent; `other` has no qrels
    m = retrieval_metrics(qrels, run, recall_at=[1])
    assert (m["n_queries"], m["n_missing"], m["n_no_relevant"]) == (2, 1, 1)
    assert m["per_query"]["q2"] == {"ndcg_at_10": 0.0, "mrr_at_10": 0.0, "recall_at_1": 0.0}
    assert m["mrr_at_10"] == pytest.approx(0.5)  # (1 + 0) / 2, not 1/1
    with pytest.raises(ValueError, match="no query with a relevant"):
        retrieval_metrics({"q": {"d": 0}}, run)


# ----------------------------------------------------------------------------------------------
# open-QA: SQuAD v1.1 normalisation, EM, F1
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, norm", [
    ("The Beatles", "beatles"),  # case + article
    ("an apple a day", "apple day"),  # a / an
    ("Theater of the Absurd", "theater of absurd"),  # 'the' only as a whole word
    ("U.S.A.!", "usa"),  # punctuation deleted
    ("state-of-the-art", "stateoftheart"),  # deleted, not spaced: v1.1 behaviour
    ("  New\t\nYork   City ", "new york city"),  # whitespace collapsed
    ("“Quoted”", "“quoted”"),  # only ASCII punctuation is removed (string.punctuation)
])
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


def test_exact_match():
    assert exact_match("The Beatles!", ["beatles"]) == 1.0
    assert exact_match("Beatles band", ["beatles"]) == 0.0
    assert exact_match("paris", ["London", "Paris"]) == 1.0  # max over golds
    assert exact_match("paris", "Paris") == 1.0  # a single gold string
    with pytest.raises(ValueError):
        exact_match("x", [])


def test_f1_partial_overlap():
    # pred {red, dog}; gold "the big red dog" -> {big, red, dog}; overlap 2
    # P = 2/2 = 1, R = 2/3, F1 = 2PR/(P+R) = 2*1*(2/3) / (1 + 2/3) = 0.8
    assert f1("red dog", ["the big red dog"]) == pytest.approx(0.8)
    # P = R = 2/3 -> F1 = 2/3
    assert f1("big red dog", ["red dog barks"]) == pytest.approx(2 / 3)
    # bag overlap: pred x x y, gold x y y -> common min counts x:1 y:1 = 2; P = R = 2/3
    assert f1("x x y", ["x y y"]) == pytest.approx(2 / 3)
    assert f1("red dog", ["cat", "big red dog"]) == pytest.approx(0.8)  # max over golds
    assert f1("cat", ["dog"]) == 0.0
    assert f1("The Dog.", ["dog"]) == 1.0


def test_qa_metrics():
    preds = {"a": "Paris", "b": "red dog"}
    golds = {"a": ["paris"], "b": ["the big red dog"], "c": ["x"]}  # c: no prediction -> 0
    m = qa_metrics(preds, golds)
    assert m["em"] == pytest.approx((1 + 0 + 0) / 3)
    assert m["f1"] == pytest.approx((1 + 0.8 + 0) / 3)
    assert (m["n"], m["n_missing"]) == (3, 1)
    with pytest.raises(ValueError, match="no gold"):
        qa_metrics({"zzz": "x"}, golds)


# ----------------------------------------------------------------------------------------------
# BEIR / qa.jsonl readers: every bad input is a DataError naming file and line
# ----------------------------------------------------------------------------------------------
CORPUS = {"d1": {"title": "Paris", "text": "Paris is the capital of France."},
          "d2": {"title": "", "text": "Berlin is the capital of Germany."},
          "d3": {"title": "Rome", "text": "Rome is in Italy."}}
QUERIES = {"q1": "capital of france", "q2": "capital of germany"}
QRELS_SPLITS = {"test": {"q1": {"d1": 1}, "q2": {"d2": 1, "d3": 0}}, "train": {"q1": {"d1": 1}}}


@pytest.fixture
def beir_dir(tmp_path: Path) -> Path:
    return write_beir(tmp_path / "beir", CORPUS, QUERIES, QRELS_SPLITS)


def test_write_then_load_roundtrip(beir_dir: Path):
    d = load_beir(beir_dir, "test")
    assert d.corpus == CORPUS and d.queries == QUERIES and d.qrels == QRELS_SPLITS["test"]
    assert d.n_skipped == 0
    assert load_beir(beir_dir, "train").queries == {"q1": "capital of france"}  # judged queries only
    assert (beir_dir / "qrels/test.tsv").read_text().splitlines()[0] == "query-id\tcorpus-id\tscore"
    assert not list(beir_dir.rglob(".tmp-*"))  # atomic writes leave no temp files


def _set_line(path: Path, lineno: int, content: bytes) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    lines[lineno - 1] = content + b"\n"
    path.write_bytes(b"".join(lines))


BAD_INPUTS = [
    # (file, line to overwrite, new bytes, expected text in the message)
    ("corpus.jsonl", 2, b'{"_id": "d2", "text": "unterminated', "malformed JSON"),
    ("corpus.jsonl", 3, b'{"_id": "d3", "title": "Rome"}', "missing or null field 'text'"),
    ("corpus.jsonl", 2, b'{"_id": "d1", "text": "dup"}', "duplicate _id 'd1'"),
    ("corpus.jsonl", 1, b'["not", "an", "object"]', "expected a JSON object"),
    ("corpus.jsonl", 2, b'{"_id": "d2", "text": 7}', "must be a string"),
    ("queries.jsonl", 2, b'{"_id": "q2", "text": "caf\xe9 latin-1"}', "not valid UTF-8"),
    ("queries.jsonl", 1, b'{"text": "no id"}', "missing or null field '_id'"),
    ("qrels/test.tsv", 3, b"q2\td9\t1", "corpus-id 'd9' is not in corpus.jsonl"),
    ("qrels/test.tsv", 2, b"q9\td1\t1", "query-id 'q9' is not in queries.jsonl"),
    ("qrels/test.tsv", 2, b"q1\td1", "expected 3 tab-separated columns"),
    ("qrels/test.tsv", 2, b"q1 d1 1", "expected 3 tab-separated columns"),
    ("qrels/test.tsv", 2, b"q1\td1\t1.5", "not an integer"),
    ("qrels/test.tsv", 1, b"q1\td1\t1", "header"),
]


@pytest.mark.parametrize("fname, lineno, content, expect", BAD_INPUTS)
def test_bad_beir_input_raises_data_error_with_file_and_line(beir_dir: Path, fname, lineno, content, expect):
    path = beir_dir / fname
    _set_line(path, lineno, content)
    with pytest.raises(DataError) as e:
        load_beir(beir_dir, "test")
    msg = str(e.value)
    assert f"{path}:{lineno}:" in msg and expect in msg and "fix:" in msg
    assert e.value.line == lineno and e.value.path == str(path)


@pytest.mark.parametrize("fname", ["corpus.jsonl", "queries.jsonl", "qrels/test.tsv"])
def test_missing_file_raises(beir_dir: Path, fname):
    (beir_dir / fname).unlink()
    with pytest.raises(DataError, match="not found|no qrels"):
        load_beir(beir_dir, "test")


def test_skip_mode_counts_instead_of_raising(beir_dir: Path):
    _set_line(beir_dir / "corpus.jsonl", 3, b"{broken")  # d3 gone ...
    _set_line(beir_dir / "qrels/test.tsv", 2, b"q1\td1")  # ... a bad row ...
    d = load_beir(beir_dir, "test", on_error="skip")  # ... and q2->d3 now names an unknown doc
    assert d.n_skipped == 3
    assert any("corpus.jsonl:3:" in s for s in d.skipped)
    assert d.qrels == {"q2": {"d2": 1}} and set(d.corpus) == {"d1", "d2"}
    # the lower-level readers report into a caller's list (e.g. line_readers.ReadReport.skipped)
    sink: list[str] = []
    read_qrels(beir_dir / "qrels/test.tsv", known_docs={"d2"}, on_error="skip", skipped=sink)
    assert len(sink) == 2
    with pytest.raises(ValueError, match="on_error"):
        read_queries(beir_dir / "queries.jsonl", on_error="ignore")


def test_read_qa(tmp_path: Path):
    p = write_qa(tmp_path / "qa.jsonl", [
        {"id": "a", "question": "capital of france?", "answers": ["Paris"], "positive_ctx": "d1"},
        {"question": "capital of germany?", "answers": ["Berlin", "berlin city"]},
    ])
    rows = read_qa(p, known_docs=set(CORPUS))
    assert rows[0] == {"id": "a", "question": "capital of france?", "answers": ["Paris"], "positive_ctx": "d1"}
    assert rows[1]["id"] == "qa-2" and "positive_ctx" not in rows[1]  # default id: <stem>-<line>


@pytest.mark.parametrize("line, expect", [
    ({"question": "q?", "answers": "Paris"}, "must be a list"),
    ({"question": "q?", "answers": []}, "non-empty list"),
    ({"question": "q?", "answers": [""]}, "non-empty list"),
    ({"answers": ["x"]}, "missing or null field 'question'"),
    ({"question": "q?", "answers": ["x"], "positive_ctx": "d9"}, "not in the corpus"),
    ({"id": "a", "question": "q?", "answers": ["x"]}, "duplicate id 'a'"),
])
def test_bad_qa_raises(tmp_path: Path, line, expect):
    p = tmp_path / "qa.jsonl"
    p.write_text(json.dumps({"id": "a", "question": "ok?", "answers": ["ok"]}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(DataError) as e:
        read_qa(p, known_docs=set(CORPUS))
    assert f"{p}:2:" in str(e.value) and expect in str(e.value)
