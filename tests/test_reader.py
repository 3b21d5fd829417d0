"""Open-QA reader: gold answers -> token spans, the (B, K, L) batch, the retrieval + span marginal
loss against a brute-force loop, zero weight for answerless blocks, no-answer questions (0, finite,
no NaN gradients), gradients into the query tower only, predict / closed-book, save/load."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from transformers import BertConfig, PreTrainedTokenizerFast

from components.data.tokenize import train_wordpiece
from components.data.text import normalize_answer
from components.models.biencoder import BiEncoder
from components.data.qa_batch import QACollator, find_answer_spans, word_boundaries
from components.data.special_tokens import MISSING_ROW, NULL_ROW
from components.models.reader import OpenQA, SpanReader

BLOCKS = [
    "Thutax kept a ferret as a pet and played the bassoon.",  # 0
    "Sesger was founded by Thutax and competes with Tikrex.",  # 1
    "The Drusyusk has a length of 1154 km and is full of perch.",  # 2
    "Navestom was the home town of Thutax.",  # 3
    "Records from this period are incomplete.",  # 4
    "Tikrex is a firm that builds bridges across the Drusyusk.",  # 5
    "Older sources occasionally confuse Drusyusk with Sesger.",  # 6
]
ROWS = [
    {"question": "What pet did Thutax keep?", "answers": ["ferret"], "block_rows": [0, 4, 2]},
    {"question": "Who founded Sesger?", "answers": ["Thutax"], "block_rows": [1, 3, NULL_ROW]},  # 2 answer blocks + null doc
    {"question": "How long is the Drusyusk?", "answers": ["1154 km", "1154"], "block_rows": [2, 5]},  # 1 empty slot
    {"question": "What colour is the sky?", "answers": ["blue"], "block_rows": [4, 5, 6]},  # no answer anywhere
]
QLEN, PLEN, K, A, D = 16, 40, 3, 4, 32


# ----------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------
def tokenized_blocks(tok, texts) -> list[dict]:
    """Retrieval blocks as the tokenize stage writes them: text, input_ids (no specials), offsets."""
    out = []
    for text in texts:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        out.append({"text": text, "input_ids": enc["input_ids"], "offsets": [list(o) for o in enc["offset_mapping"]]})
    return out


def tiny_reader_config(vocab: int, hidden: int = D) -> BertConfig:
    """A 1-layer BERT for reader tests. BERT's 0.02 init makes every span and block
    nearly equally likely, and then any mixing formula looks right; a wider init makes the
    comparisons able to fail."""
    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    cfg.initializer_range = 0.3
    return cfg


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """The tokenize stage's WordPiece trainer on this file's texts (no network)."""
    return train_wordpiece((BLOCKS + [r["question"] for r in ROWS]) * 3, vocab_size=160, min_frequency=1)


@pytest.fixture(scope="module")
def blocks(tok) -> list[dict]:
    return tokenized_blocks(tok, BLOCKS)


@pytest.fixture(scope="module")
def block_vecs() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(len(BLOCKS), D)).astype(np.float32)


@pytest.fixture(scope="module")
def collate(tok, blocks, block_vecs) -> QACollator:
    return QACollator(tok, blocks, block_vecs, query_len=QLEN, passage_len=PLEN, top_k=K, max_answer_tokens=A)


def make_model(vocab: int, seed: int = 0) -> OpenQA:
    torch.manual_seed(seed)
    cfg = tiny_reader_config(vocab)
    return OpenQA(BiEncoder.from_config(cfg), SpanReader.from_config(cfg), max_answer_tokens=A).eval()


# ----------------------------------------------------------------------------------------------
# find_answer_spans
# ----------------------------------------------------------------------------------------------
def regex_offsets(text: str) -> list[list[int]]:
    return [[m.start(), m.end()] for m in re.finditer(r"\w+|[^\w\s]", text)]


def test_find_answer_spans_normalises_case_punctuation_and_articles():
    text = "The Ardel River, near KESSA! was built in 1,200 A.D."
    offs = regex_offsets(text)  # The Ardel River , near KESSA ! was built in 1 , 200 A . D .
    # every span that normalises to the gold counts: with/without the article, the trailing comma
    assert set(find_answer_spans(offs, text, ["ardel river"], 10)) == {(0, 2), (0, 3), (1, 2), (1, 3)}
    assert set(find_answer_spans(offs, text, ["A Kessa"], 10)) == {(5, 5), (5, 6)}  # article + case + "!"
    assert (10, 12) in find_answer_spans(offs, text, ["1200"], 10)  # "1,200": punctuation is deleted
    assert find_answer_spans(offs, text, ["ardel river"], 1) == []  # needs 2 tokens > max_answer_tokens
    assert find_answer_spans(offs, text, ["blue", "the"], 10) == []  # absent; article-only gold normalises to ""


def test_find_answer_spans_never_cuts_a_word():
    text = "Kessaville is big"
    offs = [[0, 5], [5, 10], [11, 13], [14, 17]]  # WordPiece: kessa ##ville is big
    assert find_answer_spans(offs, text, ["kessa"], 10) == []
    assert find_answer_spans(offs, text, ["ville"], 10) == []
    assert find_answer_spans(offs, text, ["Kessaville"], 10) == [(0, 1)]
    assert word_boundaries(offs, text) == ([True, False, True, True], [False, True, True, True])


# ----------------------------------------------------------------------------------------------
# the batch
# ----------------------------------------------------------------------------------------------
def test_collator_builds_question_block_pairs_and_marks_correct_spans(tok, collate, block_vecs):
    batch = collate(ROWS)
    B, L = len(ROWS), batch["input_ids"].shape[-1]
    assert batch["input_ids"].shape == (B, K, L) and batch["correct_spans"].shape == (B, K, L, A)
    x = tok(ROWS[0]["question"], add_special_tokens=False)["input_ids"]
    z = tok(BLOCKS[0], add_special_tokens=False)["input_ids"]
    n = len(x) + len(z) + 3
    assert batch["input_ids"][0, 0, :n].tolist() == [tok.cls_token_id, *x, tok.sep_token_id, *z, tok.sep_token_id]
    assert batch["token_type_ids"][0, 0, :n].tolist() == [0] * (len(x) + 2) + [1] * (len(z) + 1)
    assert batch["context_mask"][0, 0].nonzero().flatten().tolist() == list(range(len(x) + 2, len(x) + 2 + len(z)))
    assert batch["query_input_ids"][0, : len(x) + 2].tolist() == [tok.cls_token_id, *x, tok.sep_token_id]
    # every marked span decodes (through the char offsets) to a gold answer, up to SQuAD normalisation
    surfaces = set()
    for b, k, i, w in batch["correct_spans"].nonzero().tolist():
        s, e = batch["z_char_offsets"][b, k, i, 0].item(), batch["z_char_offsets"][b, k, i + w, 1].item()
        surfaces.add((b, BLOCKS[ROWS[b]["block_rows"][k]][s:e]))
        assert normalize_answer(BLOCKS[ROWS[b]["block_rows"][k]][s:e]) in {normalize_answer(a) for a in ROWS[b]["answers"]}
    assert {(0, "ferret"), (0, "a ferret"), (1, "Thutax"), (2, "1154 km"), (2, "1154")} <= surfaces
    # a word split into pieces (tiny vocabulary) neither starts nor ends a span inside itself
    z_pos = batch["context_mask"]
    assert (z_pos & ~batch["span_start_mask"]).any() and (z_pos & ~batch["span_end_mask"]).any()
    assert not (batch["span_start_mask"] & ~z_pos).any() and not (batch["span_end_mask"] & ~z_pos).any()
    assert batch["answer_in_block"].tolist() == [[True, False, False], [True, True, False], [True, False, False], [False] * 3]
    assert batch["candidate_mask"].tolist() == [[True] * 3, [True] * 3, [True, True, False], [True] * 3]
    # the null document: `[CLS] x [SEP] [SEP]`, no z tokens, embedding 0; empty slots likewise
    assert not batch["context_mask"][1, 2].any() and not batch["context_mask"][2, 2].any()
    assert batch["attention_mask"][1, 2].sum().item() == len(tok(ROWS[1]["question"], add_special_tokens=False)["input_ids"]) + 3
    assert not batch["block_embeddings"][1, 2].any() and not batch["block_embeddings"][2, 2].any()
    np.testing.assert_array_equal(batch["block_embeddings"][0].numpy(), block_vecs[[0, 4, 2]])


def test_collator_drops_answers_cut_off_by_passage_len(tok, blocks, block_vecs):
    z = tok(BLOCKS[2], add_special_tokens=False)["input_ids"]  # "... 1154 km and is full of perch."
    short = QACollator(tok, blocks, block_vecs, query_len=QLEN, passage_len=len(z) - 1, top_k=1, max_answer_tokens=A)
    full = QACollator(tok, blocks, block_vecs, query_len=QLEN, passage_len=len(z) + 2, top_k=1, max_answer_tokens=A)
    row = [{"question": "What fish?", "answers": ["perch"], "block_rows": [2]}]
    assert full(row)["answer_in_block"].item() and not short(row)["answer_in_block"].item()


# ----------------------------------------------------------------------------------------------
# the loss
# ----------------------------------------------------------------------------------------------
def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


@torch.no_grad()
def brute_force(model: OpenQA, tok, rows, blocks, block_vecs) -> float:
    """One (question, block) pair at a time, unpadded, explicit softmaxes over blocks and spans."""
    cls, sep = tok.cls_token_id, tok.sep_token_id
    total = 0.0
    for r in rows:
        x = tok(r["question"], add_special_tokens=False)["input_ids"][: QLEN - 2]
        qi = torch.tensor([[cls, *x, sep]])
        q = model.retriever.encode_query(qi, torch.ones_like(qi))[0].double().numpy()
        cands = [row for row in r["block_rows"][:K] if row != MISSING_ROW]
        pz = _softmax([float(q @ block_vecs[row].astype(np.float64)) if row >= 0 else 0.0 for row in cands])
        ret, read, any_ret, any_read = 0.0, 0.0, False, False
        for row, p in zip(cands, pz):
            if row == NULL_ROW:
                continue  # the null document has no spans
            z, offs = blocks[row]["input_ids"][: PLEN - 2], blocks[row]["offsets"][: PLEN - 2]
            ids = torch.tensor([[cls, *x, sep, *z, sep]])
            types = torch.tensor([[0] * (len(x) + 2) + [1] * (len(z) + 1)])
            start, end = (t[0].double() for t in model.reader(ids, torch.ones_like(ids), types))
            z0 = len(x) + 2
            ok_start, ok_end = word_boundaries(offs, blocks[row]["text"])
            spans = [(i, j) for i in range(len(z)) for j in range(i, min(len(z), i + A)) if ok_start[i] and ok_end[j]]
            ps = _softmax([float(start[z0 + i] + end[z0 + j]) for i, j in spans])
            correct = set(find_answer_spans(offs, blocks[row]["text"], r["answers"], A))
            if correct:
                any_ret, ret = True, ret + p
            for s, pp in zip(spans, ps):
                if s in correct:
                    any_read, read = True, read + p * pp
        total += (-math.log(ret) if any_ret else 0.0) + (-math.log(read) if any_read else 0.0)
    return total / len(rows)


def test_loss_equals_brute_force_marginal_over_blocks_and_spans(tok, blocks, block_vecs, collate):
    model = make_model(len(tok))
    out = model(collate(ROWS))
    assert out["loss"].item() == pytest.approx(brute_force(model, tok, ROWS, blocks, block_vecs), rel=1e-5, abs=1e-5)
    assert out["answerable"].item() == 0.75
    # the retrieval term alone: -log p(answer blocks)
    assert out["retrieval_loss"].item() > 0 and out["reader_loss"].item() > out["retrieval_loss"].item()


@torch.no_grad()
def test_span_and_block_distributions_are_normalised_over_valid_candidates_only(tok, collate):
    model = make_model(len(tok))
    batch = collate(ROWS)
    log_ps, log_pz = model.span_log_probs(batch), model.retrieval_log_probs(batch)  # (B, K, L, A), (B, K)
    ctx = batch["context_mask"]
    for b in range(len(ROWS)):
        for k in range(K):
            n = int(ctx[b, k].sum())
            live = log_ps[b, k] > -1e29
            if n == 0:  # the null document / an empty slot: no span at all (not log 1 = 0 everywhere)
                assert not live.any()
                continue
            ok_s, ok_e = batch["span_start_mask"][b, k], batch["span_end_mask"][b, k]
            want = sum(bool(ok_s[i]) and bool(ok_e[j]) for i in range(len(ctx[b, k])) for j in range(i, i + A)
                       if j < len(ctx[b, k]))  # whole-word spans of <= A tokens inside z
            assert int(live.sum()) == want and want > 0
            assert log_ps[b, k][live].exp().sum().item() == pytest.approx(1.0, abs=1e-5)
            assert ctx[b, k, live.nonzero()[:, 0]].all()  # only z positions start a span
    assert log_pz[2, 2].item() < -1e29  # the empty slot gets no retrieval mass
    assert log_pz.exp().sum(1).tolist() == pytest.approx([1.0] * len(ROWS), abs=1e-6)
    assert log_pz[1, 2].exp().item() > 0  # the null document is a candidate (embedding 0, score 0)


def test_blocks_without_an_answer_get_zero_weight(tok, collate):
    model = make_model(len(tok))
    batch = collate(ROWS[:1])  # blocks 0 (answer), 4 and 2 (no "ferret")
    base = model(batch)["loss"].item()
    ctx = batch["context_mask"]
    for k, should_change in [(1, False), (2, False), (0, True)]:
        changed = {**batch, "input_ids": batch["input_ids"].clone()}
        where = ctx[0, k].nonzero().flatten()[:2]  # the first two z tokens ("thutax kept" in block 0)
        changed["input_ids"][0, k, where] = 7
        loss = model(changed)["loss"].item()
        assert (loss != pytest.approx(base, abs=1e-6)) == should_change, (k, loss, base)


def test_question_without_any_correct_candidate_gives_zero_loss_and_finite_grads(tok, collate):
    model = make_model(len(tok)).train()
    out = model(collate(ROWS[3:]))  # "blue" is in no block
    assert out["loss"].item() == 0.0 and out["retrieval_loss"].item() == 0.0 and out["reader_loss"].item() == 0.0
    out["loss"].backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    # in a mixed batch it counts as 0 in the mean, and nothing turns NaN
    model.zero_grad()
    mixed = model(collate(ROWS))
    three = model(collate(ROWS[:3]))["loss"]
    assert mixed["loss"].item() == pytest.approx(three.item() * 3 / 4, rel=1e-5)
    mixed["loss"].backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_gradients_reach_the_query_tower_but_not_the_frozen_block_embeddings(tok, collate):
    model = make_model(len(tok)).train()
    batch = collate(ROWS)
    batch["block_embeddings"].requires_grad_(True)
    model(batch)["loss"].backward()
    assert batch["block_embeddings"].grad is None
    q_grad = sum(p.grad.abs().sum().item() for p in model.retriever.parameters() if p.grad is not None)
    r_grad = sum(p.grad.abs().sum().item() for p in model.reader.parameters() if p.grad is not None)
    assert q_grad > 0 and r_grad > 0


# ----------------------------------------------------------------------------------------------
# inference and export
# ----------------------------------------------------------------------------------------------
def test_predict_after_overfit_and_closed_book(tok, blocks, block_vecs, collate):
    model = make_model(len(tok))
    model.train()
    batch = collate(ROWS[:3])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):
        out = model(batch)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    assert out["span_acc"].item() == 1.0
    for r in ROWS[:3]:
        rows = [x for x in r["block_rows"] if x >= 0]
        got = model.predict(r["question"], [blocks[x] for x in rows], block_vecs[rows], collate)
        assert normalize_answer(got) in {normalize_answer(a) for a in r["answers"]}, (r["question"], got)
    # blocks given as bare text are tokenized by the collator; same answer
    got = model.predict(ROWS[0]["question"], [{"text": BLOCKS[0]}, {"text": BLOCKS[4]}], block_vecs[[0, 4]], collate)
    assert normalize_answer(got) == "ferret"
    # closed-book: the null document only, nothing to extract
    assert model.predict(ROWS[0]["question"], [], None, collate) == ""
    assert model.training  # predict restores the mode


def test_closed_book_batches_skip_the_forward_with_the_answers_it_gives(tok, collate, monkeypatch):
    """Fast path against the slow reference: a batch of null documents only decodes, from the
    reader's real scores, to the answers the fast path returns without a forward."""
    model = make_model(len(tok)).eval()
    rows = [{**r, "block_rows": [NULL_ROW]} for r in ROWS[:3]]
    batch, texts = collate(rows), [[None] for _ in rows]
    with torch.no_grad():
        slow = model._decode(model.joint_log_probs(batch), batch, texts)
    monkeypatch.setattr(model, "joint_log_probs", lambda b: pytest.fail("a closed-book batch ran the reader"))
    assert model.predict_batch(batch, texts) == slow and {p["answer"] for p in slow} == {""}


def test_save_and_load_round_trip(tok, collate, tmp_path):
    model = make_model(len(tok))
    batch = collate(ROWS)
    path = model.save_pretrained(tmp_path / "openqa", tok)
    again = OpenQA.from_pretrained(path).eval()
    assert again.max_answer_tokens == A
    assert again(batch)["loss"].item() == pytest.approx(model(batch)["loss"].item(), abs=1e-6)


def test_reader_and_query_tower_load_from_an_mlm_encoder_folder(tok, tmp_path):
    """What the stage does: both start from a RetroMAE/MLM output (a BertForMaskedLM folder)."""
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    mlm = BertForMaskedLM(make_model(len(tok)).reader.config)
    mlm.save_pretrained(tmp_path / "encoder")
    reader = SpanReader.from_pretrained(tmp_path / "encoder")  # span head fresh, the encoder loaded
    tower = BiEncoder.from_pretrained(tmp_path / "encoder")
    want = mlm.bert.embeddings.word_embeddings.weight
    torch.testing.assert_close(reader.qa_model.bert.embeddings.word_embeddings.weight, want)
    torch.testing.assert_close(tower.encoder.embeddings.word_embeddings.weight, want)
    torch.testing.assert_close(reader.qa_model.bert.encoder.layer[0].output.dense.weight, mlm.bert.encoder.layer[0].output.dense.weight)


def test_open_qa_predictor_reads_the_index_top_k_like_predict(tok, blocks, block_vecs, caplog, monkeypatch):
    """eval/open_qa.OpenQAPredictor (what evaluate runs) = `predict` on the blocks the index returns;
    a slow reader logs a progress line per batch (here every batch is slower than the clock's limit)."""
    import logging
    import re
    from types import SimpleNamespace

    from components import progress
    from components.eval.open_qa import OpenQAPredictor

    class RowIndex:  # the frozen index: each question's rows, -1 padded, as BlockIndex.search returns
        def search(self, q, k):
            assert q.shape == (len(ROWS[:3]), D)
            rows = np.array([([x for x in r["block_rows"] if x >= 0] + [-1] * k)[:k] for r in ROWS[:3]])
            return np.zeros(rows.shape, dtype=np.float32), rows

    ft = SimpleNamespace(query_len=QLEN, passage_len=PLEN, qa_top_k=K, max_answer_tokens=A)
    model = make_model(len(tok))
    qa = OpenQAPredictor(model, ft, tok, blocks, block_vecs, RowIndex(), batch_size=2, name="open-qa qa:x")
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="components.eval.open_qa")
    preds = qa.predict_all([(str(i), r["question"]) for i, r in enumerate(ROWS[:3])])
    lines = [r.getMessage() for r in caplog.records if r.name == "components.eval.open_qa"]
    assert [re.fullmatch(r"open-qa qa:x (\d)/3 \(\d+%\) questions/s \d+ eta \d+s", m).group(1) for m in lines] == ["2", "3"], lines
    collate = QACollator.from_params(tok, blocks, block_vecs, ft)
    for i, r in enumerate(ROWS[:3]):
        rows = [x for x in r["block_rows"] if x >= 0]
        assert preds[str(i)] == model.predict(r["question"], [blocks[x] for x in rows], block_vecs[rows], collate)
    caplog.clear()
    assert set(qa.predict_all([("q", ROWS[0]["question"])], closed_book=True).values()) == {""}
    assert [r.getMessage().split(" 1/1 ")[0] for r in caplog.records if r.name == "components.eval.open_qa"] == ["open-qa qa:x closed-book"]
