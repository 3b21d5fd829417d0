"""experiments/article_subset.py on the shipped slice: a cut holds exactly its articles' questions and
their paragraphs, under the source's file names and compression, loads through the project's own BEIR
reader, and the cuts of two complementary article sets partition the source."""

from __future__ import annotations

import gzip
import json

import pytest

from components.data.beir import load_beir, qrels_files, read_qa
from experiments.article_subset import SHIPPED, parse_articles, subset


def test_parse_articles():
    assert parse_articles("6-11") == set(range(6, 12))
    assert parse_articles("0,2,5-7,") == {0, 2, 5, 6, 7}


@pytest.fixture(scope="module")
def halves(tmp_path_factory):
    out = tmp_path_factory.mktemp("cuts")
    cuts = {name: (out / name, parse_articles(spec)) for name, spec in (("a0_5", "0-5"), ("a6_11", "6-11"))}
    counts = {name: subset(SHIPPED, folder, articles) for name, (folder, articles) in cuts.items()}
    return cuts, counts


def test_a_cut_holds_its_articles_questions_and_their_paragraphs(halves):
    cuts, counts = halves
    folder, articles = cuts["a6_11"]
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in SHIPPED.iterdir() if p.name not in
                                                              ("LICENSE", "README.md"))
    assert {k: p.name for k, p in qrels_files(folder).items()} == {k: p.name for k, p in qrels_files(SHIPPED).items()}
    qa_file = next(folder.glob("qa.jsonl*"))
    qa = read_qa(qa_file)  # the loader's records; the raw rows keep the article read_qa does not return
    with gzip.open(qa_file, "rt", encoding="utf-8") as f:
        assert qa and {int(json.loads(line)["article"]) for line in f} == articles
    data = load_beir(folder, "test")
    assert {r["id"] for r in qa} == set(data.queries) == set(data.qrels)
    assert {r["positive_ctx"] for r in qa} <= set(data.corpus)
    assert all(d in data.corpus for judged in data.qrels.values() for d in judged)
    assert counts["a6_11"] == {"corpus.jsonl.gz": len(data.corpus), "queries.jsonl.gz": len(qa), "qa.jsonl.gz": len(qa),
                               "qrels/test.tsv.gz": len(qa)}  # what it prints: rows kept per file


def test_two_complementary_cuts_partition_the_source(halves):
    cuts, _ = halves
    whole = load_beir(SHIPPED, "test")
    parts = [load_beir(folder, "test") for folder, _ in cuts.values()]
    assert set(parts[0].corpus).isdisjoint(parts[1].corpus) and set(parts[0].queries).isdisjoint(parts[1].queries)
    assert {**parts[0].corpus, **parts[1].corpus} == whole.corpus
    assert {**parts[0].queries, **parts[1].queries} == whole.queries
    assert {**parts[0].qrels, **parts[1].qrels} == whole.qrels
