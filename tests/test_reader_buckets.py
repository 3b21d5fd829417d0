"""The reader's length bucketing (`finetune.reader_chunk_rows`): rows run longest first in chunks,
each cut to its own longest row, then put back in their own order at the batch's width. Against the
reference (`chunk_rows=0`, one forward over all rows): the same span scores on every valid span, the
same gradients, for both span scorers, in training and under inference_mode, whatever the chunk size
(1, a few, more than the rows), by rows or by the token budget the Trainer sets (`compute.length_chunk_tokens`),
which takes the place of the rows."""

from __future__ import annotations

import pytest
import torch

from components.config import load_params
from components.config_file import ParamsError
from components.models.biencoder import BiEncoder
from components.models.reader import OpenQA, SpanReader
from components.models.span_scores import NEG, span_valid
from tests.conftest import ROOT
from tests.test_reader import ROWS, A, block_vecs, blocks, collate, tiny_reader_config, tok  # noqa: F401 (fixtures)

N, L, VOCAB = 7, 24, 50
LENGTHS = [9, 24, 3, 17, 12, 5, 20]  # distinct, unsorted, one row at the full width, one tiny
CHUNKS = [1, 3, N + 5]  # one row per forward, a few, more than there are rows


def rows_of_lengths(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """`[CLS] x [SEP] z [SEP]`-like rows right-padded to L: random ids, type 1 after a short question."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (len(lengths), L), generator=g)
    mask = (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]).long()  # (N, L)
    types = (torch.arange(L)[None, :] >= 2).long() * mask
    return {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": types}


def valid_spans(rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, L, A) spans inside each row's own tokens: the positions bucketing must keep."""
    inside = rows["attention_mask"].bool()
    return span_valid(inside, inside, A)


def make_reader(scorer: str, seed: int = 0) -> SpanReader:
    torch.manual_seed(seed)
    return SpanReader.from_config(tiny_reader_config(VOCAB), span_scorer=scorer, span_hidden=16)


def scores_and_grads(reader: SpanReader, rows: dict, chunk_rows: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    reader.zero_grad()
    scores = reader.span_scores(rows["input_ids"], rows["attention_mask"], rows["token_type_ids"], A, chunk_rows)
    valid = valid_spans(rows)
    weights = torch.linspace(-1, 1, valid.numel()).view_as(valid)  # a loss that reads every valid span differently
    (scores.masked_fill(~valid, 0) * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in reader.named_parameters() if p.grad is not None}
    return scores.detach(), grads


@pytest.mark.parametrize("scorer", ["linear", "mlp"])
@pytest.mark.parametrize("chunk_rows", CHUNKS)
def test_bucketed_scores_and_gradients_equal_the_single_forward(scorer, chunk_rows):
    rows, reader = rows_of_lengths(LENGTHS), make_reader(scorer)
    valid = valid_spans(rows)
    ref, ref_grads = scores_and_grads(reader, rows, 0)
    got, got_grads = scores_and_grads(reader, rows, chunk_rows)
    assert got.shape == ref.shape == (N, L, A) and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-5, atol=1e-5)
    assert set(got_grads) == set(ref_grads) and ref_grads
    for name, g in ref_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("scorer", ["linear", "mlp"])
def test_each_row_comes_back_in_its_own_place(scorer):
    """Row n of the bucketed output = row n read alone at its own length; past a chunk's width, NEG."""
    rows, reader = rows_of_lengths(LENGTHS, seed=1), make_reader(scorer).eval()
    with torch.inference_mode():
        got = reader.span_scores(rows["input_ids"], rows["attention_mask"], rows["token_type_ids"], A, 2)
        valid = valid_spans(rows)
        for n, length in enumerate(LENGTHS):
            alone = reader.span_scores(*(rows[k][n : n + 1, :length] for k in ("input_ids", "attention_mask", "token_type_ids")),
                                       A, 0)[0]  # (length, A)
            torch.testing.assert_close(got[n, :length][valid[n, :length]], alone[valid[n, :length]], rtol=1e-5, atol=1e-5)
    # chunks of 2, longest first: 24 20 | 17 12 | 9 5 | 3. The row of 3 runs alone at width 3.
    assert (got[LENGTHS.index(3), 3:] == NEG).all() and (got[LENGTHS.index(5), 9:] == NEG).all()


def test_a_mask_with_a_hole_is_cut_at_its_last_attended_position():
    """Width = the last attended position, not the mask's sum: a row with a masked token inside
    keeps the tokens after it."""
    rows, reader = rows_of_lengths([10, 6]), make_reader("linear").eval()
    rows["attention_mask"][0, 4] = 0  # sum 9, last attended position 9
    with torch.inference_mode():
        ref = reader.span_scores(rows["input_ids"], rows["attention_mask"], rows["token_type_ids"], A, 0)
        got = reader.span_scores(rows["input_ids"], rows["attention_mask"], rows["token_type_ids"], A, 1)
    valid = valid_spans(rows)
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-5, atol=1e-5)


def make_openqa(vocab: int, scorer: str, chunk_rows: int, softmax: str = "per_block", chunk_tokens: int = 0) -> OpenQA:
    torch.manual_seed(0)
    cfg = tiny_reader_config(vocab)
    reader = SpanReader.from_config(cfg, span_scorer=scorer, span_hidden=16)
    model = OpenQA(BiEncoder.from_config(cfg), reader, max_answer_tokens=A, span_softmax=softmax, reader_chunk_rows=chunk_rows)
    model.length_chunk_tokens = chunk_tokens  # what the Trainer sets from compute.length_chunk_tokens
    return model


# (reader_chunk_rows, length_chunk_tokens): 2 rows a chunk; a token budget of one row a chunk, and of a
# few rows (which takes the place of reader_chunk_rows)
CHUNKINGS = [(2, 0), (0, 1), (8, 64)]


@pytest.mark.parametrize("chunk_rows, chunk_tokens", CHUNKINGS)
@pytest.mark.parametrize("scorer, softmax", [("linear", "per_block"), ("mlp", "joint")])
def test_openqa_loss_gradients_and_predictions_match_the_reference(tok, collate, scorer, softmax, chunk_rows, chunk_tokens):  # noqa: F811
    batch = collate(ROWS)
    ref, got = make_openqa(len(tok), scorer, 0, softmax), make_openqa(len(tok), scorer, chunk_rows, softmax, chunk_tokens)
    out_ref, out_got = ref(batch), got(batch)  # training mode (dropout 0 in the tiny config)
    out_ref["loss"].backward()
    out_got["loss"].backward()
    for key in ("loss", "retrieval_loss", "reader_loss", "span_acc"):
        torch.testing.assert_close(out_got[key], out_ref[key], rtol=1e-5, atol=1e-6)
    ref_grads = dict(ref.named_parameters())
    for name, p in got.named_parameters():
        if ref_grads[name].grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-4, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    texts = [[None if r < 0 else "x" * 200 for r in b] for b in batch["candidate_rows"].tolist()]
    with torch.inference_mode():
        p_ref, p_got = ref.eval().predict_batch(batch, texts), got.eval().predict_batch(batch, texts)
    assert [(p["block"], p["start"], p["end"]) for p in p_got] == [(p["block"], p["start"], p["end"]) for p in p_ref]
    assert [p["score"] for p in p_got] == pytest.approx([p["score"] for p in p_ref], rel=1e-5, abs=1e-5)


def test_chunk_rows_is_validated_and_reaches_a_loaded_model(tok, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="reader_chunk_rows must be >= 0"):
        make_openqa(len(tok), "linear", -1)
    with pytest.raises(ParamsError, match="finetune.reader_chunk_rows"):
        load_params(ROOT / "params.yaml", overrides={"finetune.reader_chunk_rows": -1})
    folder = make_openqa(len(tok), "linear", 4).save_pretrained(tmp_path / "qa")
    assert OpenQA.from_pretrained(folder).reader_chunk_rows == 0  # a run setting: not saved
    assert OpenQA.from_pretrained(folder, 8).reader_chunk_rows == 8


def test_the_trainer_sets_the_token_budget_on_the_reader_in_place_of_its_rows(tok, collate, tmp_path):  # noqa: F811
    from components.config_shared import ComputeParams, TrainParams
    from components.models.encoder import length_chunks
    from components.training.trainer import Trainer

    model = make_openqa(len(tok), "linear", 8)
    compute = ComputeParams(device="cpu", seed=1, precision="fp32", length_chunk_tokens=64)
    Trainer(model, [0], lambda rows, generator=None: {}, TrainParams(max_steps=1, batch_size=1), compute, tmp_path)
    assert model.length_chunk_tokens == 64 and model.reader_chunk_rows == 8
    batch = collate(ROWS)
    B, K, L = batch["input_ids"].shape
    seen = []
    model.reader._span_scores = lambda ids, *a: seen.append(tuple(ids.shape)) or torch.zeros(ids.shape[0], ids.shape[1], A)
    model.span_scores(batch)
    assert len(seen) > 1  # the budget cuts this batch into several chunks
    assert seen == [(len(rows), width) for rows, width in length_chunks(batch["attention_mask"].reshape(B * K, L), 0, 64)[1]]
