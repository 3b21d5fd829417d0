"""Bad-input campaign: the corpus readers, the BEIR/QA readers and the params loader under fuzzed
input (hypothesis), plus the edge cases a real corpus brings (empty, tiny, over-long documents,
dangling qrels, answers found nowhere).

The contract under test: every input either loads or raises `DataError` / `ParamsError` whose
message names the file (and the line, for line-based formats) or the dotted key; no other
exception type escapes; in `on_error="skip"` mode no record is lost silently
(loaded + skipped == non-blank lines).

Examples are derandomized (the same inputs every run, so CI never flakes). For a real campaign:
    RR_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest tests/test_fuzz_inputs.py -q
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from components.config import Params, load_params
from components.config_file import ParamsError
from components.data.line_readers import read_jsonl, read_txt
from components.data.errors import DataError
from components.data import beir
from tests.conftest import ROOT

_N = int(os.environ.get("RR_FUZZ_EXAMPLES", "120"))
FUZZ = settings(max_examples=_N, derandomize="RR_FUZZ_EXAMPLES" not in os.environ, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ----------------------------------------------------------------------------------------------
# oracles (independent of the readers: what a line *is* follows the file format, not the code)
# ----------------------------------------------------------------------------------------------
def _lines(data: bytes) -> list[bytes]:
    """Lines as a binary file iterator yields them (split on \\n only), without the newline."""
    parts = data.split(b"\n")
    return parts[:-1] if data.endswith(b"\n") else parts


def _non_blank(data: bytes, bom_first: bool = False) -> int:
    """Lines that carry something: undecodable ones count (they are records gone bad)."""
    n = 0
    for i, raw in enumerate(_lines(data)):
        try:
            text = raw.decode("utf-8-sig" if (bom_first and i == 0) else "utf-8")
        except UnicodeDecodeError:
            n += 1
            continue
        n += bool(text.rstrip("\r\n").strip())
    return n


def _visible_chars(data: bytes) -> str:
    """Every non-whitespace character of the decodable lines, in order (a BOM opening the file is
    not a character: the readers strip it)."""
    out = []
    for i, raw in enumerate(_lines(data)):
        try:
            out.append("".join(raw.decode("utf-8-sig" if i == 0 else "utf-8").split()))
        except UnicodeDecodeError:
            pass
    return "".join(out)


def _check_error(err: DataError, path: Path, data: bytes, line_based: bool = True) -> None:
    msg = str(err)
    assert msg.startswith(str(path)), msg  # names the file
    if err.line is not None:
        assert msg.startswith(f"{path}:{err.line}: "), msg
        assert 1 <= err.line <= max(1, len(_lines(data))), (err.line, msg)
    elif line_based and data.strip():
        # a line-based reader only raises without a line for whole-file problems
        assert any(w in msg for w in ("empty", "header", "no header")), msg


def _write(data: bytes, name: str) -> tuple[tempfile.TemporaryDirectory, Path]:
    d = tempfile.TemporaryDirectory()
    p = Path(d.name) / name
    p.write_bytes(data)
    return d, p


# ----------------------------------------------------------------------------------------------
# strategies
# ----------------------------------------------------------------------------------------------
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False),
                        st.text(max_size=12))
json_value = st.recursive(json_scalar, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=6), c, max_size=3)),
                          max_leaves=6)
record_keys = st.sampled_from(["_id", "id", "text", "title", "question", "answers", "positive_ctx", "split", "body"])
record = st.dictionaries(record_keys, st.one_of(json_value, st.text(max_size=20), st.lists(st.text(max_size=8), max_size=3)), max_size=5)
line_bytes = st.one_of(
    record.map(lambda r: json.dumps(r).encode()),                        # plausible records
    st.text(max_size=30).map(lambda t: t.encode("utf-8", "surrogatepass")),  # any text, maybe not JSON
    st.binary(max_size=30),                                              # any bytes, maybe not UTF-8
    st.sampled_from([b"", b"   ", b"\r", b"\t\x0b", b"\xef\xbb\xbf{}", b"[1, 2]", b'"s"', b"null", b"{", b'{"text": 1}']),
)
file_bytes = st.lists(line_bytes, max_size=12).flatmap(
    lambda ls: st.sampled_from([b"\n", b"\r\n"]).map(lambda nl: nl.join(ls))) | st.binary(max_size=200)

# JSON the stdlib parser refuses with something other than JSONDecodeError.
DEEP = b"[" * 100_000 + b"]" * 100_000  # RecursionError
HUGE_INT = b'{"text": "a", "id": ' + b"1" * 5000 + b"}"  # ValueError (int max str digits)


# ----------------------------------------------------------------------------------------------
# passage readers (data.source: jsonl / txt)
# ----------------------------------------------------------------------------------------------
@FUZZ
@given(data=file_bytes, on_error=st.sampled_from(["raise", "skip"]))
@example(data=DEEP, on_error="raise")
@example(data=HUGE_INT + b"\n" + b'{"text": "ok"}', on_error="skip")
def test_read_jsonl_loads_or_names_file_and_line(data, on_error):
    d, path = _write(data, "corpus.jsonl")
    with d:
        try:
            passages, report = read_jsonl(path, on_error=on_error)
        except DataError as e:
            _check_error(e, path, data)
            return
        assert all(isinstance(p["text"], str) and isinstance(p["doc_id"], str) for p in passages)
        assert len(passages) + len(report.skipped) == _non_blank(data, bom_first=True), report.skipped
        if on_error == "raise":
            assert not report.skipped
        assert all(s.startswith(f"{path}:") for s in report.skipped)


@FUZZ
@given(data=file_bytes, mode=st.sampled_from(["line", "paragraph"]), on_error=st.sampled_from(["raise", "skip"]))
def test_read_txt_keeps_every_visible_character(data, mode, on_error):
    d, path = _write(data, "corpus.txt")
    with d:
        try:
            passages, report = read_txt(path, mode, on_error)
        except DataError as e:
            _check_error(e, path, data)
            return
        # nothing lost: every non-whitespace character of every decodable line is in a passage
        assert "".join("".join(p["text"].split()) for p in passages) == _visible_chars(data)
        bad = sum(1 for raw in _lines(data) if not _decodes(raw))
        assert len(report.skipped) == bad
        if mode == "line":
            assert len(passages) + bad == _non_blank(data, bom_first=True)


def _decodes(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_jsonl_skip_counts_match_a_known_mix(tmp_path):
    """A hand-built mix where the oracle is certain: 3 good records, 5 bad, 2 blank lines."""
    lines = [b'{"text": "one"}', b"", b"{bad json", b'{"title": "no text"}', b"[1, 2]", b"\xff\xfe not utf-8",
             b'{"text": "two", "id": 7}', b"   ", b'{"text": 3}', b'{"text": "three"}']
    path = tmp_path / "mix.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    passages, report = read_jsonl(path, on_error="skip")
    assert [p["text"] for p in passages] == ["one", "two", "three"]
    assert [int(s.split(":")[1]) for s in report.skipped] == [3, 4, 5, 6, 9]
    with pytest.raises(DataError, match=rf"^{path}:3: malformed JSON"):
        read_jsonl(path)


# ----------------------------------------------------------------------------------------------
# BEIR / QA readers
# ----------------------------------------------------------------------------------------------
READERS = {
    "corpus": lambda p, on_error, skipped: beir.read_corpus(p, on_error=on_error, skipped=skipped),
    "queries": lambda p, on_error, skipped: beir.read_queries(p, on_error=on_error, skipped=skipped),
    "qa": lambda p, on_error, skipped: beir.read_qa(p, on_error=on_error, skipped=skipped),
}


@FUZZ
@given(data=file_bytes, which=st.sampled_from(sorted(READERS)), on_error=st.sampled_from(["raise", "skip"]))
@example(data=DEEP, which="corpus", on_error="raise")
@example(data=HUGE_INT, which="qa", on_error="skip")
@example(data=b"{}", which="corpus", on_error="skip")  # two missing fields on one line: one skipped line
def test_beir_readers_load_or_name_file_and_line(data, which, on_error):
    d, path = _write(data, f"{which}.jsonl")
    with d:
        skipped: list[str] = []
        try:
            out = READERS[which](path, on_error, skipped)
        except DataError as e:
            _check_error(e, path, data)
            return
        # one entry per bad line (a line with two bad fields is still one skipped record)
        assert len(out) + len(skipped) == _non_blank(data, bom_first=True), skipped
        assert all(s.startswith(f"{path}:") for s in skipped)


qrels_row = st.one_of(
    st.tuples(st.sampled_from(["q1", "q2", "qX", ""]), st.sampled_from(["d1", "d2", "dX", ""]),
              st.sampled_from(["1", "0", "2", "x", "1.5", "", "-1"])).map(lambda t: "\t".join(t).encode()),
    st.text(max_size=20).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.binary(max_size=12),
)


@FUZZ
@given(rows=st.lists(qrels_row, max_size=10), header=st.booleans(), on_error=st.sampled_from(["raise", "skip"]))
def test_read_qrels_loads_or_names_file_and_line(rows, header, on_error):
    data = b"\n".join(([b"query-id\tcorpus-id\tscore"] if header else []) + rows) + b"\n"
    d, path = _write(data, "test.tsv")
    with d:
        skipped: list[str] = []
        try:
            qrels = beir.read_qrels(path, known_queries={"q1", "q2"}, known_docs={"d1", "d2"}, on_error=on_error, skipped=skipped)
        except DataError as e:
            _check_error(e, path, data)
            return
        judged = sum(len(v) for v in qrels.values())
        body_rows = _non_blank(data, bom_first=True) - 1  # minus the header
        # a duplicate (q, d) row with the same score is merged, not lost: count distinct pairs + merged
        assert judged + len(skipped) <= body_rows
        assert set(qrels) <= {"q1", "q2"} and all(set(v) <= {"d1", "d2"} for v in qrels.values())


def test_qrels_row_naming_an_unknown_doc_names_the_line(tmp_path):
    f = tmp_path / "test.tsv"
    f.write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\tghost\t1\n")
    with pytest.raises(DataError, match=rf"^{f}:3: corpus-id 'ghost' is not in corpus.jsonl"):
        beir.read_qrels(f, known_queries={"q1"}, known_docs={"d1"})
    skipped: list[str] = []
    assert beir.read_qrels(f, known_queries={"q1"}, known_docs={"d1"}, on_error="skip", skipped=skipped) == {"q1": {"d1": 1}}
    assert len(skipped) == 1 and skipped[0].startswith(f"{f}:3:")


# ----------------------------------------------------------------------------------------------
# params loader
# ----------------------------------------------------------------------------------------------
def _leaf_keys(model: type[BaseModel] = Params, prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _leaf_keys(ann, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


LEAVES = _leaf_keys()
param_value = st.one_of(st.none(), st.booleans(), st.integers(-10**9, 10**9), st.floats(), st.text(max_size=10),
                        st.lists(st.integers(0, 200), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
dotted_key = st.one_of(st.sampled_from(LEAVES), st.sampled_from(LEAVES).map(lambda k: k.replace("_", "", 1)),  # typos
                       st.lists(st.sampled_from(["data", "train", "retromae", "x", "lr", "seed", ""]), min_size=1, max_size=4).map(".".join))


@FUZZ
@given(overrides=st.dictionaries(dotted_key, param_value, min_size=1, max_size=3))
@example(overrides={"retromae.train.max_steps": 0})
@example(overrides={"compute.seed.x": 1})
@example(overrides={"retromae.encoder.num_heads": 3})
def test_dotted_overrides_load_or_name_the_key(overrides):
    try:
        load_params(ROOT / "params.yaml", overrides=overrides)
    except ParamsError as e:
        msg = str(e)
        # the message names an offending key: one of the overrides, or a section above it
        prefixes = {".".join(k.split(".")[:i]) for k in overrides for i in range(1, k.count(".") + 2)}
        assert any(p in msg for p in prefixes if p) or "<root>" in msg, msg


def _yaml_doc():
    section = st.dictionaries(st.sampled_from(["train", "seed", "device", "max_len", "encoder", "lr", "x"]),
                              st.one_of(json_scalar, st.dictionaries(st.sampled_from(["max_steps", "lr", "y"]), json_scalar, max_size=2)),
                              max_size=3)
    top = st.dictionaries(st.sampled_from(["compute", "tracking", "data", "retromae", "realm", "nope"]), st.one_of(section, json_scalar), max_size=4)
    return st.one_of(top.map(lambda d: yaml.safe_dump(d).encode()), json_value.map(lambda v: yaml.safe_dump(v).encode()),
                     st.text(max_size=60).map(lambda t: t.encode("utf-8", "surrogatepass")), st.binary(max_size=60))


@FUZZ
@given(data=_yaml_doc())
@example(data=b"compute: {seed: 2001-02-30}\n")  # a YAML timestamp that is no date: ValueError
@example(data=b"\xff\xfe\x00c\x00o")  # not UTF-8: UnicodeDecodeError
@example(data=b"compute:\n  seed: " + b"9" * 5000 + b"\n")  # int over 4300 digits: ValueError
def test_params_file_loads_or_names_the_file(data):
    d, path = _write(data, "params.yaml")
    with d:
        try:
            load_params(path)
        except ParamsError as e:
            assert str(path) in str(e), str(e)


# ----------------------------------------------------------------------------------------------
# corpus edge cases
# ----------------------------------------------------------------------------------------------
def test_empty_corpus_and_all_bad_corpus_stop_with_the_file_named(tmp_path):
    from components.config_stages import DataParams
    from components.data.prepare import prepare_corpus

    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=rf"^{empty}: file is empty"):
        prepare_corpus(DataParams(source="jsonl", path=str(empty)), tmp_path / "out")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n{oops\n')
    with pytest.raises(DataError, match=rf"^{bad}: no passages left"):
        prepare_corpus(DataParams(source="jsonl", path=str(bad), on_error="skip"), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_document_longer_than_the_block_is_packed_without_loss(tmp_path):
    """One 600-word passage, 16-token pre-training blocks, 12-token retrieval blocks: every token
    lands in exactly one block of each kind, in order, and every block fits."""
    import datasets

    from components.config_stages import DataParams, TokenizeParams
    from components.data.prepare import prepare_corpus
    from components.data.tokenize import load_tokenizer, tokenize_corpus

    words = [f"w{i % 97}x{i % 13}" for i in range(600)]
    src = tmp_path / "c.txt"
    src.write_text(" ".join(words) + "\n\nshort second passage\n")
    prepare_corpus(DataParams(source="txt", path=str(src)), tmp_path / "corpus")
    tp = TokenizeParams(vocab_size=200, min_frequency=1, pretrain_block_len=16, retrieval_block_len=12)
    card = tokenize_corpus(tp, tmp_path / "corpus", tmp_path / "tokens")
    assert card["pretrain_tokens"] == card["tokens"] == card["retrieval_tokens"]
    tok = load_tokenizer(tmp_path / "tokens" / "tokenizer")
    expected = tok(" ".join(words), add_special_tokens=False)["input_ids"]
    assert len(expected) > 10 * 16  # really longer than a block
    pre = datasets.load_from_disk(str(tmp_path / "tokens" / "pretrain"))
    assert max(len(x) for x in pre["input_ids"]) <= 16
    flat = [t for ids in pre["input_ids"] for t in ids]
    assert flat[: len(expected)] == expected
    blocks = datasets.load_from_disk(str(tmp_path / "tokens" / "blocks"))
    long_doc = [b for b in blocks if b["doc_id"] == "c-1"]
    assert len(long_doc) > 10 and max(len(b["input_ids"]) for b in long_doc) <= 12
    assert [t for b in long_doc for t in b["input_ids"]] == expected
    assert " ".join(b["text"] for b in long_doc).split() == words  # the block texts cover the passage


def test_answer_absent_from_every_document_gives_zero_loss_not_nan():
    """Open QA: an answer found in no retrieved block has no correct span; its loss term is 0
    (the row teaches nothing) and gradients stay finite."""
    import torch
    from transformers import BertConfig

    from components.data.qa_batch import find_answer_spans
    from components.models.reader import OpenQA, SpanReader
    from components.models.span_scores import marginal_nll

    text = "The Ardel River flows past Kessaville."
    offs = [[0, 3], [4, 9], [10, 15], [16, 21], [22, 26], [27, 37], [37, 38]]
    assert find_answer_spans(offs, text, ["Ardel River"], 4) == [(0, 2), (1, 2)]  # "The Ardel River" normalises the same
    assert find_answer_spans(offs, text, ["Mount Orro"], 4) == []
    assert find_answer_spans(offs, text, ["kessa"], 4) == []  # never half a word
    assert marginal_nll(torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.bool)).item() == 0.0

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, max_position_embeddings=32)
    model = OpenQA(torch.nn.Identity(), SpanReader.from_config(cfg), max_answer_tokens=3).eval()  # no dropout: comparable calls
    B, K, L = 2, 2, 8
    ctx = torch.zeros(B, K, L, dtype=torch.bool)
    ctx[..., 4:7] = True
    correct = torch.zeros(B, K, L, 3, dtype=torch.bool)
    correct[0, 1, 4, 1] = True  # row 0 answerable (block 1, tokens 4..5); row 1 answer found nowhere
    batch = {
        "query_input_ids": torch.randint(5, 50, (B, 6)), "query_attention_mask": torch.ones(B, 6, dtype=torch.long),
        "candidate_mask": torch.ones(B, K, dtype=torch.bool),
        "input_ids": torch.randint(5, 50, (B, K, L)), "attention_mask": torch.ones(B, K, L, dtype=torch.long),
        "token_type_ids": ctx.long(), "context_mask": ctx, "correct_spans": correct,
        "answer_in_block": correct.flatten(2).any(-1),
    }
    out = model(batch)
    assert torch.isfinite(out["loss"]) and out["answerable"].item() == 0.5
    # the unanswerable row adds exactly 0: the loss is half the answerable row's term
    only = {k: v[:1] for k, v in batch.items()}
    assert torch.allclose(out["loss"], model(only)["loss"] / 2)
    none = {**batch, "correct_spans": torch.zeros_like(correct), "answer_in_block": torch.zeros(B, K, dtype=torch.bool)}
    loss = model(none)["loss"]
    assert loss.item() == 0.0
    loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
