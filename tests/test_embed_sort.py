"""Length bucketing in `embed.embed_blocks` (the one embed every block / passage path runs through:
dense eval, REALM's refresh, its sharded form): rows are embedded longest first and come back in
the caller's order, with the vectors of batches cut in the caller's order (the slow reference)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from components.data.realm_batch import passage_batch
from components.data.special_tokens import SpecialTokens
from components.eval.dense import HFEncoder, add_specials, add_specials_title_body, encode_token_rows
from components.index.embed import embed_and_build, embed_blocks, length_order
from tests.conftest import tiny_params

VOCAB, PAD, CLS, SEP, MASK = 400, 0, 2, 3, 4
LENS = [3, 60, 1, 45, 7, 7, 30, 2, 58, 12, 9, 40, 5, 61, 20, 4, 33, 8, 50, 6, 15]  # very different lengths


def _rows(lens=LENS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, VOCAB, n).tolist() for n in lens]


def _tiny_bert():
    """The tests' real encoder: a BertForMaskedLM at the tiny preset's size, random weights (seed 0)."""
    from components.models.encoder import build_encoder

    torch.manual_seed(0)
    enc = tiny_params(**{"retromae.encoder.num_layers": 2}).retromae.encoder
    return build_encoder(enc, VOCAB, PAD, cls_token_id=CLS, sep_token_id=SEP, mask_token_id=MASK).eval()


# ----------------------------------------------------------------------------------------------
# the order
# ----------------------------------------------------------------------------------------------
def _length_encoder(seen: list):
    """encode_fn whose vector is (row length, first token): shows which row landed where."""

    def encode(rows):
        seen.append([len(r) for r in rows])
        return np.array([[len(r), r[0]] for r in rows], dtype=np.float32)  # (B, 2)

    return encode


@pytest.mark.parametrize("source", ["list", "generator", "hf_dataset"])
def test_rows_come_back_in_the_callers_order_and_batches_go_longest_first(source):
    rows = _rows()
    seen: list = []
    if source == "hf_dataset":
        datasets = pytest.importorskip("datasets")
        blocks = datasets.Dataset.from_dict({"input_ids": rows})
        collate = lambda rs: [r["input_ids"] for r in rs]  # noqa: E731
    else:
        blocks = rows if source == "list" else (r for r in rows)
        collate = None
    emb, stats = embed_blocks(_length_encoder(seen), blocks, 4, collate, progress=False)
    np.testing.assert_array_equal(emb, [[len(r), r[0]] for r in rows])  # row i is rows[i]
    flat = [n for batch in seen for n in batch]
    assert flat == sorted(LENS, reverse=True)  # every batch holds rows of like length, the longest first
    assert [len(b) for b in seen] == [4, 4, 4, 4, 4, 1] and stats["n_blocks"] == len(rows)


def test_length_order_is_stable_and_reads_titles_and_selected_datasets():
    datasets = pytest.importorskip("datasets")
    assert length_order([[1], [1, 2], [3], [1, 2]]).tolist() == [1, 3, 0, 2]  # ties keep their order
    assert length_order([[1, 2, 3], [1, 2], [1]]).tolist() == [0, 1, 2]  # sorted input: unchanged
    pairs = [([1, 2, 3], [1]), ([], [1, 2]), ([1], [1, 2, 3, 4])]
    assert length_order(pairs).tolist() == [2, 0, 1]  # title + body
    ds = datasets.Dataset.from_dict({"input_ids": [[1], [1, 2, 3], [1, 2]], "title_ids": [[1, 2, 3], [], [1]],
                                     "block_id": ["a", "bb", "ccc"]})
    assert length_order(ds).tolist() == length_order(ds.to_list()).tolist() == [0, 1, 2]  # 4, 3, 3
    assert length_order(ds.select([2, 0])).tolist() == [1, 0]  # a select()'s indices, not the table's rows
    assert length_order([[1], [1, 2]], length=None).tolist() == [0, 1]


# ----------------------------------------------------------------------------------------------
# the vectors: bucketed = the reference (batches cut in the caller's order), on a real encoder
# ----------------------------------------------------------------------------------------------
def test_dense_eval_rows_match_the_unsorted_reference_on_a_real_encoder():
    model = _tiny_bert()
    enc = HFEncoder(model)
    tok = SimpleNamespace(cls_token_id=CLS, sep_token_id=SEP, pad_token_id=PAD)
    rows, bs, max_len = _rows(), 4, 52
    fast, _ = encode_token_rows(enc, rows, tok, max_len, bs, "embed blocks")
    want = torch.cat([enc(*add_specials(rows[i : i + bs], CLS, SEP, PAD, max_len)) for i in range(0, len(rows), bs)])
    np.testing.assert_allclose(fast, want.numpy(), rtol=1e-4, atol=1e-5)
    assert not np.allclose(fast[:-1], fast[1:])  # rows differ: a permutation would not pass

    # REALM's document tower in dense eval (realm.doc_input=title_body): (title, body) pairs
    titles = _rows([2, 9, 0, 5] * 5 + [1], seed=1)
    body = getattr(model, "base_model", model)

    def encode3(ids, mask, types):  # (B, L) x3 -> (B, H)
        return body(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state[:, 0]

    fast, _ = encode_token_rows(encode3, rows, tok, max_len, bs, "embed blocks", titles=titles)
    pairs = list(zip(titles, rows))
    with torch.inference_mode():
        want = torch.cat([encode3(*add_specials_title_body(pairs[i : i + bs], CLS, SEP, PAD, max_len))
                          for i in range(0, len(pairs), bs)])
    np.testing.assert_allclose(fast, want.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("doc_input", ["body", "title_body"])
def test_realm_refresh_index_matches_the_unsorted_reference_on_a_real_encoder(doc_input):
    datasets = pytest.importorskip("datasets")
    model = _tiny_bert()
    body = getattr(model, "base_model", model)
    p = tiny_params(**{"realm.doc_input": doc_input}).realm
    special = SpecialTokens(pad=PAD, cls=CLS, sep=SEP, mask=MASK)
    rows = _rows()
    blocks = datasets.Dataset.from_dict({"input_ids": rows, "title_ids": _rows([2, 9, 0, 5] * 5 + [1], seed=1)})
    collate = lambda rs: passage_batch(rs, p, special)  # noqa: E731 - the refresh's own collate

    def encode(batch):  # a document tower: [CLS] of the last layer
        return body(**batch).last_hidden_state[:, 0]  # (B, H)

    index, _ = embed_and_build(encode, blocks, [f"b{i}" for i in range(len(rows))], batch_size=4, collate=collate,
                               index_type="flat")
    ref, _ = embed_blocks(encode, blocks, 4, collate, progress=False, length=None)
    np.testing.assert_allclose(index.embeddings(), ref, rtol=1e-4, atol=1e-5)
    with torch.inference_mode():  # and the reference is what a plain loop over the blocks gives
        loop = torch.cat([encode(collate(blocks.select(range(i, min(i + 4, len(rows)))).to_list()))
                          for i in range(0, len(rows), 4)])
    np.testing.assert_array_equal(ref, loop.numpy())


def test_bf16_autocast_stays_close_to_the_unsorted_reference():
    """Under bf16 the two batchings may round differently: each vector must stay within bf16 noise
    of its reference and nearer to it than to any other row's."""
    enc = HFEncoder(_tiny_bert())
    tok = SimpleNamespace(cls_token_id=CLS, sep_token_id=SEP, pad_token_id=PAD)
    rows = _rows()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast, _ = encode_token_rows(enc, rows, tok, 52, 4, "embed blocks")
        want = torch.cat([enc(*add_specials(rows[i : i + 4], CLS, SEP, PAD, 52)) for i in range(0, len(rows), 4)])
    want = want.float().numpy()  # (N, H)
    assert np.abs(fast - want).max() <= 1e-2 * np.abs(want).max()
    dist = np.linalg.norm(fast[:, None] - want[None], axis=-1)  # (N, N): bucketed row i to reference row j
    assert (dist.argmin(1) == np.arange(len(rows))).all()
