"""prepare_corpus: every source, every bad-input case (error names file + line), dedupe, outputs."""

import json

import pyarrow.parquet as pq
import pytest

from components.config_stages import DataParams
from components.data.corpus import normalize_and_dedupe
from components.data.errors import DataError
from components.data.line_readers import read_jsonl, read_txt
from components.data.prepare import prepare_corpus


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------
# sources
# --------------------------------------------------------------------------------------------
def test_txt_line_and_paragraph_modes(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("first line\nsecond line\n\nthird para\ncontinues here\n\n\n", encoding="utf-8")
    lines, _ = read_txt(f, "line")
    assert [p["text"] for p in lines] == ["first line", "second line", "third para", "continues here"]
    paras, _ = read_txt(f, "paragraph")
    assert [p["text"] for p in paras] == ["first line second line", "third para continues here"]
    assert [p["doc_id"] for p in paras] == ["c-1", "c-4"]  # stable ids: file stem + first line


def test_jsonl_configurable_fields(tmp_path):
    f = _jsonl(tmp_path / "c.jsonl", [{"body": "alpha text", "name": "A", "key": 7}, {"body": "beta", "key": 8}])
    ps, rep = read_jsonl(f, text_field="body", title_field="name", id_field="key")
    assert [(p["doc_id"], p["title"], p["text"]) for p in ps] == [("7", "A", "alpha text"), ("8", "", "beta")]
    assert rep.records_read == 2 and not rep.skipped


def test_beir_source_keeps_questions_and_splits(tmp_path):
    root = tmp_path / "beir"
    (root / "qrels").mkdir(parents=True)
    _jsonl(root / "corpus.jsonl", [{"_id": f"d{i}", "title": f"T{i}", "text": f"document number {i} text"} for i in range(6)])
    _jsonl(root / "queries.jsonl", [{"_id": f"q{i}", "text": f"question {i}?"} for i in range(10)])
    (root / "qrels/test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i % 6}\t1\n" for i in range(10)))
    _jsonl(root / "qa.jsonl", [{"id": f"q{i}", "question": f"question {i}?", "answers": [f"number {i % 6}"], "positive_ctx": f"d{i % 6}"} for i in range(10)])
    p = DataParams(source="beir", path=str(root), split={"dev": 0.2, "test": 0.2, "seed": 1})
    card = prepare_corpus(p, tmp_path / "out")
    assert card["passages"] == 6
    assert card["queries"] == {"train": 6, "dev": 2, "test": 2}  # one qrels file: split by question
    assert card["qa"] == {"train": 6, "dev": 2, "test": 2}
    test_q = {l.split("\t")[0] for l in (tmp_path / "out/beir/qrels/test.tsv").read_text().splitlines()[1:]}
    test_qa = {json.loads(l)["id"] for l in (tmp_path / "out/qa/test.jsonl").read_text().splitlines()}
    assert test_q == test_qa  # QA and retrieval agree on which questions are held out


def test_hf_load_from_disk(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["one doc", "two doc", "one doc"], "id": ["a", "b", "c"]})
    ds.save_to_disk(str(tmp_path / "hf"))
    card = prepare_corpus(DataParams(source="hf", path=str(tmp_path / "hf")), tmp_path / "out")
    assert card["passages"] == 2 and card["dedupe"]["duplicates_dropped"] == 1


def test_synthetic_source_writes_everything(tmp_path, params):
    card = prepare_corpus(params.data, tmp_path / "out")
    out = tmp_path / "out"
    table = pq.read_table(out / "passages.parquet").to_pylist()
    assert len(table) == card["passages"] > 0
    assert card["passages_with_spans"] > 0
    for row in table:
        for s in row["spans"]:
            assert 0 <= s["start"] < s["end"] <= len(row["text"])
    assert card["queries"]["train"] > 0 and card["queries"]["test"] > 0
    for split in ("train", "dev", "test"):
        assert (out / f"beir/qrels/{split}.tsv").exists() and (out / f"qa/{split}.jsonl").exists()
    assert json.loads((out / "data_card.json").read_text())["digest"] == card["digest"]


def test_synthetic_prepare_is_deterministic(tmp_path, params):
    a = prepare_corpus(params.data, tmp_path / "a")
    b = prepare_corpus(params.data, tmp_path / "b")
    assert a["digest"] == b["digest"]
    assert (tmp_path / "a/beir/qrels/test.tsv").read_bytes() == (tmp_path / "b/beir/qrels/test.tsv").read_bytes()


# --------------------------------------------------------------------------------------------
# bad input: the error names the file, the line and a fix; skip mode counts
# --------------------------------------------------------------------------------------------
def test_malformed_json_line_names_file_and_line(tmp_path):
    f = _jsonl(tmp_path / "c.jsonl", [{"text": "ok"}, '{"text": "broken', {"text": "fine"}])
    with pytest.raises(DataError) as e:
        read_jsonl(f)
    assert f"{f}:2" in str(e.value) and "malformed JSON" in str(e.value) and "fix:" in str(e.value)
    ps, rep = read_jsonl(f, on_error="skip")
    assert [p["text"] for p in ps] == ["ok", "fine"] and len(rep.skipped) == 1 and ":2:" in rep.skipped[0]


def test_missing_field_names_line_and_field(tmp_path):
    f = _jsonl(tmp_path / "c.jsonl", [{"text": "ok"}, {"body": "no text field"}])
    with pytest.raises(DataError, match=r"c\.jsonl:2: missing field 'text'.*data\.jsonl_fields\.text"):
        read_jsonl(f)


def test_non_utf8_bytes_name_the_line(tmp_path):
    f = tmp_path / "c.txt"
    f.write_bytes(b"good line\ncaf\xe9 latin-1\nanother\n")
    with pytest.raises(DataError, match=r"c\.txt:2: not valid UTF-8.*iconv"):
        read_txt(f, "line")
    ps, rep = read_txt(f, "line", on_error="skip")
    assert [p["text"] for p in ps] == ["good line", "another"] and len(rep.skipped) == 1


@pytest.mark.parametrize("kind", ["empty", "missing", "folder"])
def test_empty_missing_or_folder_path(tmp_path, kind):
    f = tmp_path / "c.jsonl"
    if kind == "empty":
        f.write_text("")
    elif kind == "folder":
        f.mkdir()
    with pytest.raises(DataError) as e:
        read_jsonl(f)
    assert str(f) in str(e.value) and {"empty": "empty", "missing": "not found", "folder": "folder"}[kind] in str(e.value)


def test_whitespace_only_corpus_is_an_error_naming_the_source(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("   \n\t\n")
    with pytest.raises(DataError, match="no passages left"):
        prepare_corpus(DataParams(source="txt", path=str(f)), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_skip_mode_reports_counts_in_the_data_card(tmp_path):
    f = _jsonl(tmp_path / "c.jsonl", [{"text": "a"}, "not json", {"x": 1}, {"text": "b"}])
    card = prepare_corpus(DataParams(source="jsonl", path=str(f), on_error="skip"), tmp_path / "out")
    assert card["passages"] == 2 and card["read"]["skipped"] == 2
    assert any(":2:" in s for s in card["read"]["skipped_examples"])


# --------------------------------------------------------------------------------------------
# normalisation + dedupe
# --------------------------------------------------------------------------------------------
def test_dedupe_counts_and_keeps_first():
    ps = [{"doc_id": "a", "title": "", "text": "Hello   world", "spans": []},
          {"doc_id": "b", "title": "", "text": "Hello world", "spans": []},     # same after normalising
          {"doc_id": "d", "title": "", "text": "different text", "spans": []},
          {"doc_id": "c", "title": "", "text": "  ", "spans": []}]
    out, stats = normalize_and_dedupe(ps)
    assert [p["doc_id"] for p in out] == ["a", "d"]  # ids are kept as the readers gave them
    assert stats == {"input": 4, "empty_dropped": 1, "too_short_dropped": 0, "duplicates_dropped": 1, "output": 2}


# --------------------------------------------------------------------------------------------
# corpus identity: a repeated id stops the stage naming both lines; a BOM is stripped
# --------------------------------------------------------------------------------------------
BOM = "\ufeff"


def test_duplicate_id_stops_naming_both_lines(tmp_path):
    f = _jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "first"}, {"id": "b", "text": "other"},
                                      {"id": "a", "text": "a different text"}])
    with pytest.raises(DataError) as e:
        read_jsonl(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}:3: duplicate id 'a'") and "line 1" in msg and "fix:" in msg
    with pytest.raises(DataError, match=r"c\.jsonl:3: duplicate id 'a'.*line 1"):
        prepare_corpus(DataParams(source="jsonl", path=str(f)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_duplicate_id_in_skip_mode_keeps_the_first_and_counts_the_later(tmp_path):
    f = _jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "first"}, {"id": "a", "text": "second"},
                                      {"id": "b", "text": "other"}, {"id": "a", "text": "first"}])
    ps, rep = read_jsonl(f, on_error="skip")
    assert [(p["doc_id"], p["text"]) for p in ps] == [("a", "first"), ("b", "other")]
    assert rep.records_read == 2 and len(rep.skipped) == 2
    assert rep.skipped[0].startswith(f"{f}:2: duplicate id 'a'") and "line 1" in rep.skipped[0]
    card = prepare_corpus(DataParams(source="jsonl", path=str(f), on_error="skip"), tmp_path / "out")
    assert card["passages"] == 2 and card["read"]["skipped"] == 2
    rows = pq.read_table(tmp_path / "out/passages.parquet").to_pylist()
    assert [(r["doc_id"], r["text"]) for r in rows] == [("a", "first"), ("b", "other")]


def test_beir_duplicate_corpus_id_names_both_lines(tmp_path):
    root = tmp_path / "beir"
    root.mkdir()
    _jsonl(root / "corpus.jsonl", [{"_id": "d0", "text": "zero"}, {"_id": "d1", "text": "one"}, {"_id": "d0", "text": "again"}])
    with pytest.raises(DataError, match=r"corpus\.jsonl:3: duplicate _id 'd0': line 3 repeats the id of line 1"):
        prepare_corpus(DataParams(source="beir", path=str(root)), tmp_path / "out")
    card = prepare_corpus(DataParams(source="beir", path=str(root), on_error="skip"), tmp_path / "out")
    assert card["passages"] == 2 and card["read"]["skipped"] == 1 and ":3: duplicate _id" in card["read"]["skipped_examples"][0]


def test_duplicate_id_across_files_of_one_prefix_names_both_files(tmp_path):
    from components.data.corpus import _read_s3_files

    a = _jsonl(tmp_path / "a.jsonl", [{"id": "x", "text": "from a"}])
    b = _jsonl(tmp_path / "b.jsonl", [{"id": "y", "text": "from b"}, {"id": "x", "text": "again"}])
    p = DataParams(source="s3", path="s3://bucket/prefix")
    with pytest.raises(DataError, match=rf"b\.jsonl:2: duplicate id 'x'.*{a}:1"):
        _read_s3_files(p, [a, b])
    data = _read_s3_files(p.model_copy(update={"on_error": "skip"}), [a, b])
    assert [d["doc_id"] for d in data.passages] == ["x", "y"] and len(data.report.skipped) == 1


@pytest.mark.parametrize("source, name, body", [
    ("jsonl", "c.jsonl", '{"id": "a", "text": "first passage"}\n{"id": "b", "text": "second"}\n'),
    ("txt", "c.txt", "first passage\n\nsecond\n"),
])
def test_a_utf8_bom_is_stripped(tmp_path, source, name, body):
    f = tmp_path / name
    f.write_bytes((BOM + body).encode("utf-8"))  # what Windows editors write ("UTF-8 with BOM")
    card = prepare_corpus(DataParams(source=source, path=str(f)), tmp_path / "out")
    rows = pq.read_table(tmp_path / "out/passages.parquet").to_pylist()
    assert card["passages"] == 2 and rows[0]["text"] == "first passage" and BOM not in rows[0]["doc_id"]


def test_a_bom_in_a_beir_folder_is_stripped(tmp_path):
    root = tmp_path / "beir"
    (root / "qrels").mkdir(parents=True)
    (root / "corpus.jsonl").write_text(BOM + '{"_id": "d0", "text": "zero"}\n{"_id": "d1", "text": "one"}\n', encoding="utf-8")
    (root / "queries.jsonl").write_text(BOM + '{"_id": "q0", "text": "which?"}\n', encoding="utf-8")
    (root / "qrels/test.tsv").write_text(BOM + "query-id\tcorpus-id\tscore\nq0\td0\t1\n", encoding="utf-8")
    card = prepare_corpus(DataParams(source="beir", path=str(root)), tmp_path / "out")
    assert card["passages"] == 2 and sum(card["queries"].values()) == 1


def test_failed_run_keeps_previous_output(tmp_path):
    good = _jsonl(tmp_path / "good.jsonl", [{"text": "kept passage"}])
    out = tmp_path / "out"
    prepare_corpus(DataParams(source="jsonl", path=str(good)), out)
    before = (out / "passages.parquet").read_bytes()
    bad = _jsonl(tmp_path / "bad.jsonl", [{"text": "x"}, "{broken"])
    with pytest.raises(DataError):
        prepare_corpus(DataParams(source="jsonl", path=str(bad)), out)
    assert (out / "passages.parquet").read_bytes() == before
    assert not list(tmp_path.glob(".tmp-*"))
