"""experiments/sentence_queries.py: a retrieval set cut from prose loads through the project's BEIR reader,
each query is a sentence of its own paragraph and is gone from its passage, ineligible paragraphs are not
drawn, and the draw follows the seed."""

from __future__ import annotations

import gzip
import json

import pytest

from components.data.beir import load_beir
from experiments.sentence_queries import build, main, sentences

PARAGRAPHS = [
    {"id": "a", "text": "Apt installs packages from a mirror. It checks every signature first. Then it unpacks them in order."},
    {"id": "b", "text": "The kernel boots before anything else.  Systemd then starts the services it was asked to start. "
                        "Logs go to the journal by default."},
    {"id": "c", "text": "Too short. Only two sentences here."},  # fewer than 3 sentences
    {"id": "d", "text": "One sentence has few words. Ok then. The last one is long enough to count here."},  # "Ok then." < 5 words
    {"id": "e", "text": "Dpkg is the low-level tool. Apt calls it for each package. 3 tools build on top of both of them."},
]


def test_sentences_split_on_end_marks_before_a_capital_a_digit_or_a_quote():
    assert sentences("It ran. 3 jobs failed! \"Why?\" he asked.  e.g. this stays.") == \
        ["It ran.", "3 jobs failed!", "\"Why?\" he asked. e.g. this stays."]  # whitespace runs become one space


@pytest.fixture
def folder(tmp_path):
    src = tmp_path / "paragraphs.jsonl.gz"
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(p) + "\n" for p in PARAGRAPHS)
    out = tmp_path / "beir"
    counts = main(["--src", str(src), "--out", str(out), "--max", "10", "--seed", "3"])
    assert counts == {"paragraphs_read": 5, "passages": 3, "queries": 3}
    return out


def test_each_query_is_a_sentence_removed_from_its_only_relevant_passage(folder):
    data = load_beir(folder, "test")
    assert set(data.corpus) == {"a", "b", "e"}  # c and d are not eligible
    source = {p["id"]: sentences(p["text"]) for p in PARAGRAPHS}
    for qid, query in data.queries.items():
        (doc,) = data.qrels[qid]
        rest = sentences(data.corpus[doc]["text"])
        assert query in source[doc] and query not in rest
        assert sorted(rest + [query]) == sorted(source[doc])


def test_the_draw_follows_the_seed():
    rows = [{"_id": p["id"], "title": "", "text": p["text"]} for p in PARAGRAPHS]  # as read_paragraphs returns them
    assert build(rows, 2, seed=1) == build(rows, 2, seed=1)
    assert len({json.dumps(build(rows, 3, seed=s)) for s in range(8)}) > 1


def test_a_line_without_the_text_field_names_the_file_and_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(PARAGRAPHS[0]) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(SystemExit, match=r"bad.jsonl:2: missing field 'text'.*--text-field"):
        main(["--src", str(src), "--out", str(tmp_path / "o")])
