"""The corpus that ships in the repo (corpora/squad-v1.1-dev-a0-11), gzip input for every file source,
the SQuAD-schema `data.source: hf` conversion, wide-encoding errors and the empty-passage count.

Pure and offline: nothing here reads the developers' data folder, which a user's clone has not.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from components.config import load_params
from components.config_stages import DataParams
from components.data import beir
from components.data.corpus import load_source, read_beir_source
from components.data.line_readers import read_jsonl, read_txt
from components.data.errors import DataError
from components.data.prepare import prepare_corpus
from components.data.squad import squad_to_beir
from tests.conftest import ROOT

SHIPPED = ROOT / "corpora" / "squad-v1.1-dev-a0-11"
DATA_FILES = ("corpus.jsonl.gz", "queries.jsonl.gz", "qa.jsonl.gz", "qrels/test.tsv.gz")


def _build_script():
    """scripts/build_shipped_corpus.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("build_shipped_corpus", ROOT / "scripts" / "build_shipped_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _records(data) -> dict:
    """A SourceData as comparable plain values."""
    return {"passages": data.passages, "queries": data.queries, "qrels": data.qrels, "qrels_split": data.qrels_split,
            "qa": data.qa, "records_read": data.report.records_read, "skipped": data.report.skipped}


def _gunzip_folder(src: Path, dest: Path) -> Path:
    """The shipped folder as a plain BEIR folder (every .gz decompressed, names without .gz)."""
    for f in src.rglob("*.gz"):
        out = dest / f.relative_to(src).with_suffix("")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(gzip.decompress(f.read_bytes()))
    return dest


# --------------------------------------------------------------------------------------------
# (a) the shipped corpus
# --------------------------------------------------------------------------------------------
def test_shipped_corpus_loads_as_any_beir_folder():
    data = read_beir_source(SHIPPED)  # the loader every BEIR folder goes through
    assert len(data.passages) == 620 and len(data.queries) == 3468 and len(data.qa) == 3468
    assert not data.report.skipped and all(p["text"].strip() for p in data.passages)
    doc_ids = {p["doc_id"] for p in data.passages}
    assert all(r["answers"] and r["positive_ctx"] in doc_ids for r in data.qa)
    assert {q["qid"] for q in data.queries} == {r["id"] for r in data.qa} == set(data.qrels)
    assert all(len(rels) == 1 and set(rels.values()) == {1} for rels in data.qrels.values())
    split = beir.load_beir(SHIPPED, "test")  # the eval sets' loader reads it too
    assert len(split.corpus) == 620 and len(split.queries) == 3468


def test_shipped_corpus_is_what_the_small_preset_reads_and_is_tracked_by_git():
    p = load_params(ROOT / "params.yaml", presets=[ROOT / "params/small.yaml"])
    assert p.data.source == "beir" and (ROOT / p.data.path).resolve() == SHIPPED
    for name in ("README.md", "LICENSE", *DATA_FILES):
        assert (SHIPPED / name).is_file(), name
    assert "CC BY-SA 4.0" in (SHIPPED / "README.md").read_text() and "by-sa/4.0/legalcode" in (SHIPPED / "LICENSE").read_text()
    ignore = (ROOT / ".gitignore").read_text().splitlines()
    assert not any(line.strip().strip("/").startswith("corpora") for line in ignore)


def test_shipped_files_are_reproducible_gzip_from_the_build_script(tmp_path):
    build = _build_script()
    for name in DATA_FILES:
        head = (SHIPPED / name).read_bytes()[:10]
        assert head[:2] == b"\x1f\x8b" and head[3] & 0x08 == 0 and head[4:8] == b"\0\0\0\0", name  # no name, mtime 0
    recs = build.records_from_beir(_gunzip_folder(SHIPPED, tmp_path / "plain"))
    assert build.differences(SHIPPED, build.folder_files(recs)) == []  # rebuilt byte for byte


def test_squad_conversion_reproduces_the_shipped_records(tmp_path):
    """The hub's rows of these articles, as far as the shipped files hold them, convert back to them:
    the ids, the article/paragraph order, the titles and the answer de-duplication agree."""
    build = _build_script()
    shipped = build.records_from_beir(_gunzip_folder(SHIPPED, tmp_path / "plain"))
    ctx = {d["_id"]: d for d in shipped.corpus}
    rows = [{"id": r["id"], "title": ctx[r["positive_ctx"]]["title"].replace(" ", "_"), "context": ctx[r["positive_ctx"]]["text"],
             "question": r["question"], "answers": {"text": r["answers"], "answer_start": r["answer_starts"]}} for r in shipped.qa]
    conv = squad_to_beir(rows)
    assert (conv.corpus, conv.queries, conv.qrels, conv.qa) == (shipped.corpus, shipped.queries, shipped.qrels, shipped.qa)
    assert build.folder_files(conv) == build.folder_files(shipped)  # --from-hf would write the same bytes
    assert len(squad_to_beir(rows, articles=range(0, 2)).corpus) == sum(d["_id"] < "02" for d in shipped.corpus)


# --------------------------------------------------------------------------------------------
# (b) gzip reads exactly as the plain file
# --------------------------------------------------------------------------------------------
def _jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows), encoding="utf-8")
    return path


def _tiny_beir(root: Path, qrels_splits: tuple[str, ...] = ("test",)) -> Path:
    _jsonl(root / "corpus.jsonl", [{"_id": f"d{i}", "title": f"Tïtle {i}", "text": f"passage {i} about thing {i}"} for i in range(4)]
           + [{"_id": "empty", "title": "", "text": "   "}])
    _jsonl(root / "queries.jsonl", [{"_id": f"q{i}", "text": f"what is thing {i}? "} for i in range(6)])
    (root / "qrels").mkdir(parents=True, exist_ok=True)
    for n, split in enumerate(qrels_splits):
        rows = "".join(f"q{i}\td{i % 4}\t1\n" for i in range(6) if i % len(qrels_splits) == n)
        (root / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + rows, encoding="utf-8")
    _jsonl(root / "qa.jsonl", [{"question": f"what is thing {i}? ", "answers": [f"thing {i % 4}"], "positive_ctx": f"d{i % 4}"} for i in range(6)])
    return root


def _gzip_copy(src: Path, dest: Path, *, keep_name: set[str] = frozenset()) -> Path:
    """Every file of `src` gzip-compressed under `dest` as `<name>.gz` (or under its own name: `keep_name`)."""
    for f in src.rglob("*"):
        if f.is_file():
            rel = f.relative_to(src)
            out = dest / (rel if str(rel) in keep_name else rel.with_name(rel.name + ".gz"))
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(gzip.compress(f.read_bytes(), mtime=0))
    return dest


@pytest.mark.parametrize("splits", [("test",), ("train", "test")])
def test_gzip_beir_folder_gives_the_same_records_as_the_plain_one(tmp_path, splits):
    plain = _tiny_beir(tmp_path / "plain", splits)
    packed = _gzip_copy(plain, tmp_path / "gz")
    assert (packed / "corpus.jsonl.gz").exists() and not (packed / "corpus.jsonl").exists()
    assert _records(read_beir_source(packed)) == _records(read_beir_source(plain))
    a, b = beir.load_beir(plain, "test"), beir.load_beir(packed, "test")
    assert (a.corpus, a.queries, a.qrels) == (b.corpus, b.queries, b.qrels)
    assert beir.read_qa(plain / "qa.jsonl") == beir.read_qa(packed / "qa.jsonl.gz")  # default ids: qa-<line> from both
    card_a = prepare_corpus(DataParams(source="beir", path=str(plain)), tmp_path / "out_a")
    card_b = prepare_corpus(DataParams(source="beir", path=str(packed)), tmp_path / "out_b")
    assert {k: v for k, v in card_a.items() if k not in ("path", "read")} == {k: v for k, v in card_b.items() if k not in ("path", "read")}


def test_gzip_is_detected_by_magic_bytes_not_the_name(tmp_path):
    plain = _tiny_beir(tmp_path / "plain")
    disguised = _gzip_copy(plain, tmp_path / "gz", keep_name={"corpus.jsonl", "qrels/test.tsv"})
    assert (disguised / "corpus.jsonl").read_bytes()[:2] == b"\x1f\x8b"
    assert _records(read_beir_source(disguised)) == _records(read_beir_source(plain))


@pytest.mark.parametrize("name, reader", [
    ("c.jsonl", lambda f: read_jsonl(f)),
    ("c.txt", lambda f: read_txt(f, "paragraph")),
    ("c.txt", lambda f: read_txt(f, "line")),
])
def test_gzip_plain_file_sources_read_as_the_plain_file(tmp_path, name, reader):
    plain = tmp_path / name
    if name.endswith(".jsonl"):
        _jsonl(plain, [{"text": "first passage", "title": "T"}, {"id": 7, "text": "second"}, "", {"text": "third"}])
    else:
        plain.write_text("first passage\ncontinues\n\nsecond\n\nthird\n", encoding="utf-8")
    packed = tmp_path / "gz" / (name + ".gz")
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(plain.read_bytes()))

    def comparable(out):
        passages, report = out
        return [{k: v for k, v in p.items() if k != "_at"} for p in passages], report.records_read, report.skipped

    assert comparable(reader(packed)) == comparable(reader(plain))  # ids included: c-1, not c.jsonl-1
    src = "jsonl" if name.endswith(".jsonl") else "txt"
    card = prepare_corpus(DataParams(source=src, path=str(packed)), tmp_path / "out")
    assert card["digest"] == prepare_corpus(DataParams(source=src, path=str(plain)), tmp_path / "out2")["digest"]


def test_a_beir_folder_with_both_plain_and_gzip_files_is_refused_naming_both(tmp_path):
    root = _tiny_beir(tmp_path / "b")
    (root / "corpus.jsonl.gz").write_bytes(gzip.compress((root / "corpus.jsonl").read_bytes()))
    with pytest.raises(DataError) as e:
        read_beir_source(root)
    assert str(root / "corpus.jsonl") in str(e.value) and str(root / "corpus.jsonl.gz") in str(e.value)
    (root / "corpus.jsonl.gz").unlink()
    (root / "qrels/test.tsv.gz").write_bytes(gzip.compress((root / "qrels/test.tsv").read_bytes()))
    with pytest.raises(DataError, match=r"test\.tsv and .*test\.tsv\.gz"):
        beir.load_beir(root, "test")


def test_a_corrupt_gzip_names_the_file_and_line(tmp_path):
    f = tmp_path / "c.jsonl.gz"
    body = "".join(json.dumps({"text": hashlib.sha256(str(i).encode()).hexdigest() * 3}) + "\n" for i in range(200)).encode()
    f.write_bytes(gzip.compress(body)[:-400])  # truncated: the end of the stream is gone
    with pytest.raises(DataError) as e:
        read_jsonl(f)
    assert str(e.value).startswith(f"{f}:") and "gzip" in str(e.value) and e.value.line is not None


# --------------------------------------------------------------------------------------------
# (c) data.source: hf on a SQuAD-schema dataset == the BEIR loader on the same rows' folder
# --------------------------------------------------------------------------------------------
SQUAD_ROWS = [
    {"id": "a1", "title": "First_Article", "context": "Paris is the capital of France.", "question": "What is the capital of France? ",
     "answers": {"text": ["Paris", "Paris", "Paris"], "answer_start": [0, 0, 0]}},
    {"id": "a2", "title": "First_Article", "context": "Paris is the capital of France.", "question": "Paris is the capital of what?",
     "answers": {"text": ["France", "France."], "answer_start": [24, 24]}},
    {"id": "a3", "title": "First_Article", "context": "The Seine flows through Paris.", "question": "Which river flows through Paris?",
     "answers": {"text": ["The Seine", "Seine"], "answer_start": [0, 4]}},
    {"id": "b1", "title": "Second_(article)", "context": "Water boils at 100 degrees Celsius at sea level.",
     "question": "At what temperature does water boil?", "answers": {"text": ["100 degrees Celsius"], "answer_start": [15]}},
    {"id": "b2", "title": "Second_(article)", "context": "Water boils at 100 degrees Celsius at sea level.",
     "question": "Where does water boil at 100 degrees?", "answers": {"text": ["at sea level", "sea level"], "answer_start": [35, 38]}},
]


def _save_squad(path: Path, rows: list[dict], split: str | None) -> Path:
    import datasets

    ds = datasets.Dataset.from_list(rows)
    (datasets.DatasetDict({split: ds}) if split else ds).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("split", ["validation", None])  # a DatasetDict folder, and a bare Dataset folder
def test_hf_squad_dataset_gives_the_records_of_its_beir_folder(tmp_path, split):
    hf = _save_squad(tmp_path / "hf", SQUAD_ROWS, split)
    from_hf = load_source(DataParams(source="hf", path=str(hf), hf_split=split or "train"))  # hf_format: auto
    folder = tmp_path / "beir"
    _build_script().write_folder(folder, squad_to_beir(SQUAD_ROWS))  # the shipped layout, from the same rows
    from_beir = read_beir_source(folder)
    assert _records(from_hf) == _records(from_beir)
    assert [p["doc_id"] for p in from_hf.passages] == ["00-000", "00-001", "01-000"]
    assert from_hf.passages[2]["title"] == "Second (article)"
    assert from_hf.qa[0] == {"id": "a1", "question": "What is the capital of France? ", "answers": ["Paris"], "positive_ctx": "00-000"}
    assert from_hf.qrels == {"a1": {"00-000": 1}, "a2": {"00-000": 1}, "a3": {"00-001": 1}, "b1": {"01-000": 1}, "b2": {"01-000": 1}}
    p = DataParams(source="hf", path=str(hf), hf_split=split or "train", hf_format="squad", split={"dev": 0.2, "test": 0.2, "seed": 1})
    card = prepare_corpus(p, tmp_path / "out")
    assert card["passages"] == 3 and sum(card["queries"].values()) == 5 and sum(card["qa"].values()) == 5


def test_hf_squad_bad_rows_and_schema(tmp_path):
    rows = SQUAD_ROWS + [{**SQUAD_ROWS[0], "id": "e1", "question": "  "}, {**SQUAD_ROWS[1]}]  # an empty question, a repeated id
    with pytest.raises(DataError, match=r"hf: row 5: question 'e1' is missing or empty"):
        load_source(DataParams(source="hf", path=str(_save_squad(tmp_path / "hf", rows, "train"))))
    data = load_source(DataParams(source="hf", path=str(tmp_path / "hf"), on_error="skip"))
    assert len(data.report.skipped) == 2 and "row 6: duplicate id 'a2'" in data.report.skipped[1] and len(data.qa) == 5
    unanswerable = [{**SQUAD_ROWS[0], "id": "v2", "answers": {"text": [], "answer_start": []}}]
    conv = squad_to_beir(SQUAD_ROWS + unanswerable)
    assert conv.unanswerable == 1 and len(conv.queries) == 6 and len(conv.qa) == 5  # a query, not a QA record
    import datasets

    datasets.Dataset.from_dict({"text": ["a doc"], "id": ["x"]}).save_to_disk(str(tmp_path / "plain"))
    with pytest.raises(DataError, match=r"hf_format is squad .*'answers'.*'context'"):
        load_source(DataParams(source="hf", path=str(tmp_path / "plain"), hf_format="squad"))


# --------------------------------------------------------------------------------------------
# (d) UTF-16 / UTF-32: one error naming the encoding and the iconv fix
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding, bom, family", [("utf-16-le", codecs.BOM_UTF16_LE, "UTF-16"), ("utf-16-be", codecs.BOM_UTF16_BE, "UTF-16"),
                                                  ("utf-32-le", codecs.BOM_UTF32_LE, "UTF-32")])
def test_a_wide_encoding_is_named_with_the_fix(tmp_path, encoding, bom, family):
    body = '{"_id": "d0", "text": "zero"}\n{"_id": "d1", "text": "one"}\n'
    f = tmp_path / "corpus.jsonl"
    f.write_bytes(bom + body.encode(encoding))  # with its byte-order mark, as Windows tools write it
    for read in (lambda: read_jsonl(f), lambda: read_jsonl(f, on_error="skip"), lambda: beir.read_corpus(f, on_error="skip")):
        with pytest.raises(DataError) as e:
            read()
        msg = str(e.value)
        assert msg.startswith(f"{f}:1: ") and family in msg and f"iconv -f {family} -t UTF-8" in msg and "latin1" not in msg
    g = tmp_path / "c.txt.gz"
    g.write_bytes(gzip.compress("some text\n".encode("utf-16")))  # Python's utf-16 writes the mark
    with pytest.raises(DataError, match=r"c\.txt\.gz:1: .*UTF-16"):
        read_txt(g)


# --------------------------------------------------------------------------------------------
# (e) empty passages are dropped and counted in the data card
# --------------------------------------------------------------------------------------------
def test_empty_passages_are_counted_in_the_data_card(tmp_path):
    f = _jsonl(tmp_path / "c.jsonl", [{"text": "kept"}, {"text": ""}, {"text": " \t "}, {"text": "x"}, {"text": "kept"}])
    card = prepare_corpus(DataParams(source="jsonl", path=str(f), min_chars=2), tmp_path / "out")
    assert card["passages"] == 1 and card["dropped_empty"] == 2
    assert card["dedupe"] == {"input": 5, "empty_dropped": 2, "too_short_dropped": 1, "duplicates_dropped": 1, "output": 1}
    on_disk = json.loads((tmp_path / "out/data_card.json").read_text())
    assert on_disk["dropped_empty"] == 2
    root = _tiny_beir(tmp_path / "b")  # a BEIR corpus line with whitespace-only text
    assert prepare_corpus(DataParams(source="beir", path=str(root)), tmp_path / "out_b")["dropped_empty"] == 1
