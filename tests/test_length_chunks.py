"""Length chunks in the training towers (`compute.length_chunk_tokens`, encoder.run_length_chunks): a
batch's rows run longest first in chunks of about a token budget, each cut to its own widest row, and
come back in their own order. Each fast path against the reference (0: one forward at the batch's
width), with dropout off so both see the same function: the same outputs and the same gradients, for
the bare helper (per-row and per-token outputs), the DPR bi-encoder, ICT and REALM (retriever towers and
reader pairs), whatever the budget (one row per chunk, a few, every row in one). And the Trainer sets
it on exactly the modules that read it."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertModel

from components.models.biencoder import BiEncoder
from components.models.encoder import cls_pool, length_chunks, run_length_chunks, set_length_chunk_tokens
from components.models.ict import ICTModel
from components.models.retriever import Retriever
from tests.test_realm import make_batch, make_model

VOCAB, L = 60, 20
LENGTHS = [7, 20, 2, 13, 9, 4, 16, 11]  # unsorted, one row at the full width, one of [CLS] [SEP] only
CHUNKS = [1, 45, 1000]  # tokens: one row per forward, a few rows (a ragged last chunk), every row in one


def tiny_bert(seed: int = 0) -> BertModel:
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    return BertModel(cfg, add_pooling_layer=False).eval()


def rows(lengths: list[int], width: int = L, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()  # (N, L), right-padded
    return torch.randint(5, VOCAB, (len(lengths), width), generator=g) * mask, mask


def grads_of(module: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    module.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=k)


def test_chunks_run_longest_first_each_at_its_widest_row():
    _, mask = rows(LENGTHS)
    order, chunks = length_chunks(mask, chunk_rows=3)
    assert [int(LENGTHS[i]) for i in order] == sorted(LENGTHS, reverse=True)
    assert [(list(map(int, r)), w) for r, w in chunks] == [([1, 6, 3], 20), ([7, 4, 0], 11), ([5, 2], 4)]
    # a token budget: as many rows as fit at the chunk's width (20 -> 2 rows, 13 -> 3, 7 -> 5), at least one
    _, chunks = length_chunks(mask, chunk_tokens=40)
    assert [(list(map(int, r)), w) for r, w in chunks] == [([1, 6], 20), ([3, 7, 4], 13), ([0, 5, 2], 7)]
    assert [len(r) for r, _ in length_chunks(mask, chunk_tokens=5)[1]] == [1] * len(LENGTHS)
    with pytest.raises(ValueError, match="chunk_rows > 0 or chunk_tokens > 0"):
        length_chunks(mask)


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_cls_vectors_and_their_gradients_equal_one_forward(chunk_tokens):
    bert, (ids, mask) = tiny_bert(), rows(LENGTHS)
    weights = torch.linspace(-1, 1, 32)  # a loss that weighs every row and feature differently
    ref = cls_pool(bert, ids, mask)  # (N, H)
    ref_grads = grads_of(bert, (ref * weights * torch.arange(1, len(LENGTHS) + 1)[:, None]).sum())
    got = cls_pool(bert, ids, mask, chunk_tokens)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)  # the rows' own order, not the sorted one
    assert_same(grads_of(bert, (got * weights * torch.arange(1, len(LENGTHS) + 1)[:, None]).sum()), ref_grads)


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_per_token_outputs_come_back_at_full_width_padded_with_the_value(chunk_tokens):
    bert, (ids, mask) = tiny_bert(), rows(LENGTHS)
    hidden = lambda i, m: bert(input_ids=i, attention_mask=m).last_hidden_state  # noqa: E731
    ref = hidden(ids, mask)  # (N, L, H)
    got = run_length_chunks(hidden, ids, mask, chunk_tokens=chunk_tokens, pad_value=-7.0)
    assert got.shape == ref.shape
    inside = mask.bool()
    torch.testing.assert_close(got[inside], ref[inside], rtol=1e-4, atol=1e-5)  # every real token
    for r, width in length_chunks(mask, chunk_tokens=chunk_tokens)[1]:  # past a chunk's width: the pad value
        assert (got[torch.as_tensor(r), width:] == -7.0).all()


def test_zero_is_the_single_forward_and_one_chunk_keeps_the_order():
    calls = []
    fn = lambda i, m: calls.append(tuple(i.shape)) or i[:, :1].float()  # noqa: E731
    ids, mask = rows(LENGTHS)
    run_length_chunks(fn, ids, mask)
    assert calls == [(8, 20)]
    calls.clear()
    _, short = rows([3, 5, 2])
    out = run_length_chunks(fn, short * 0 + torch.arange(L), short, chunk_tokens=100)  # one chunk: cut to 5, rows as given
    assert calls == [(3, 5)] and out.squeeze(1).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_biencoder_loss_and_gradients_equal_one_forward(chunk_tokens):
    q_ids, q_mask = rows([5, 9, 3, 7], width=10, seed=1)
    p_ids, p_mask = rows(LENGTHS, seed=2)  # 4 queries x (positive + 1 hard negative)
    batch = {"query_input_ids": q_ids, "query_attention_mask": q_mask, "passage_input_ids": p_ids, "passage_attention_mask": p_mask}
    model = BiEncoder(tiny_bert(), temperature=0.5).eval()
    ref = model(batch)["loss"]
    ref_grads = grads_of(model, ref)
    assert set_length_chunk_tokens(model, chunk_tokens) == 1
    got = model(batch)["loss"]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert_same(grads_of(model, got), ref_grads)


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_ict_loss_and_gradients_equal_one_forward(chunk_tokens):
    q_ids, q_mask = rows([5, 9, 3, 7, 4, 6, 8, 2], width=10, seed=1)
    d_ids, d_mask = rows(LENGTHS, seed=2)
    batch = {"q_input_ids": q_ids, "q_attention_mask": q_mask, "d_input_ids": d_ids, "d_attention_mask": d_mask}
    torch.manual_seed(0)
    model = ICTModel(Retriever(tiny_bert(), torch.nn.Linear(32, 8))).eval()
    ref = model(batch)["loss"]
    ref_grads = grads_of(model, ref)
    assert set_length_chunk_tokens(model, chunk_tokens) == 1  # the retriever; ICTModel itself reads nothing
    got = model(batch)["loss"]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert_same(grads_of(model, got), ref_grads)


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_realm_marginal_likelihood_and_gradients_equal_one_forward(chunk_tokens):
    """Both halves: the retriever's candidate rows and the reader's (x, z) pairs, which differ in length
    (the null document is x alone) and whose masked positions lie in x."""
    model, batch = make_model(), make_batch()
    ref = model(batch)
    ref_grads = grads_of(model, ref["loss"])
    assert set_length_chunk_tokens(model, chunk_tokens) == 2  # the retriever and the reader
    got = model(batch)
    for k in ("loss", "mlm_acc", "retrieval_entropy", "p_null", "retrieval_utility"):
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)
    assert_same(grads_of(model, got["loss"]), ref_grads)


def test_the_trainer_sets_the_chunk_size_on_the_towers(tmp_path):
    from components.config_shared import ComputeParams, TrainParams
    from components.training.trainer import Trainer

    model = make_model()
    compute = ComputeParams(device="cpu", seed=1, precision="fp32", length_chunk_tokens=512)
    Trainer(model, [0], lambda rows, generator=None: {}, TrainParams(max_steps=1, batch_size=1), compute, tmp_path)
    assert model.retriever.length_chunk_tokens == 512 and model.knowledge_augmented_encoder.length_chunk_tokens == 512
    untouched = make_model()
    Trainer(untouched, [0], lambda rows, generator=None: {}, TrainParams(max_steps=1, batch_size=1),
            ComputeParams(device="cpu", seed=1, precision="fp32", length_chunk_tokens=0), tmp_path / "b")
    assert untouched.retriever.length_chunk_tokens == 0
