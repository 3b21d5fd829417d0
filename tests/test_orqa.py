"""ORQA's open-QA fine-tuning against slow pair-by-pair references: the retrieval (early update) loss
over a beam with has-answer marks, the joint (block, span) softmax with the retrieval score added,
the MLP span scorer, and the per-step search that always reads the query tower as it is now."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from components.data.qa_batch import QACollator, find_answer_spans, word_boundaries
from components.data.special_tokens import MISSING_ROW
from components.data.text import normalize_answer
from components.data.tokenize import train_wordpiece
from components.models.biencoder import BiEncoder
from components.models.reader import OpenQA, SpanReader
from components.models.span_scores import SpanMLP
from components.retrieval.search import dense_search, frozen_search_fn, tower_search_fn
from tests.test_reader import BLOCKS, tiny_reader_config, tokenized_blocks  # the same seven blocks

QUESTIONS = [
    ("What pet did Thutax keep?", ["ferret"]),
    ("Who founded Sesger?", ["Thutax"]),
    ("How long is the Drusyusk?", ["1154 km", "1154"]),
    ("What colour is the sky?", ["blue"]),  # in no block
]
# fixed beams for the loss references: question 2's answer block (2) is in its beam past the top
# k; question 1's beam has an empty slot (-1: the index returned fewer)
BEAMS = [[0, 4, 2, 1, 3], [1, 3, 6, 0, -1], [5, 6, 4, 2, 0], [4, 5, 6, 0, 1]]
QLEN, PLEN, K, A, D, S = 16, 40, 3, 4, 32, 8


@pytest.fixture(scope="module")
def tok():
    return train_wordpiece((BLOCKS + [q for q, _ in QUESTIONS]) * 3, vocab_size=160, min_frequency=1)


@pytest.fixture(scope="module")
def blocks(tok) -> list[dict]:
    return tokenized_blocks(tok, BLOCKS)


@pytest.fixture(scope="module")
def block_vecs() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(len(BLOCKS), D)).astype(np.float32)


def rows() -> list[dict]:
    return [{"question": q, "answers": a} for q, a in QUESTIONS]


def make_model(vocab: int, scorer: str = "linear", softmax: str = "per_block", seed: int = 0) -> OpenQA:
    torch.manual_seed(seed)
    cfg = tiny_reader_config(vocab, hidden=D)
    reader = SpanReader.from_config(cfg, span_scorer=scorer, span_hidden=S)
    if reader.span_mlp is not None:
        for p in reader.span_mlp.parameters():
            torch.nn.init.normal_(p, std=0.5)
    return OpenQA(BiEncoder.from_config(cfg), reader, max_answer_tokens=A, span_softmax=softmax).eval()


def fixed_beams(texts, n):
    by_q = {q: b for (q, _), b in zip(QUESTIONS, BEAMS)}
    return np.array([by_q[t][:n] for t in texts])


def query_vec(model: OpenQA, tok, question: str) -> np.ndarray:
    x = tok(question, add_special_tokens=False)["input_ids"][: QLEN - 2]
    ids = torch.tensor([[tok.cls_token_id, *x, tok.sep_token_id]])
    with torch.no_grad():
        return model.retriever.encode_query(ids, torch.ones_like(ids))[0].double().numpy()


def ref_has_answer(text: str, answers) -> bool:
    """Word-sequence containment, written independently of qa_batch.has_answer."""
    words = normalize_answer(text).split()
    for a in answers:
        g = normalize_answer(a).split()
        if g and any(words[i : i + len(g)] == g for i in range(len(words) - len(g) + 1)):
            return True
    return False


def _logsumexp(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


# ----------------------------------------------------------------------------------------------
# (a) the retrieval loss over the beam
# ----------------------------------------------------------------------------------------------
def test_retrieval_loss_over_the_beam_equals_pair_by_pair_reference(tok, blocks, block_vecs):
    model = make_model(len(tok))
    collate = QACollator(tok, blocks, block_vecs, query_len=QLEN, passage_len=PLEN, top_k=K, max_answer_tokens=A,
                         retrieve=fixed_beams, beam=5)
    batch = collate(rows())
    assert batch["beam_rows"].tolist() == [[r if r >= 0 else MISSING_ROW for r in b] for b in BEAMS]
    assert batch["candidate_rows"].tolist() == [[r if r >= 0 else MISSING_ROW for r in b[:K]] for b in BEAMS]
    want = []
    for (question, answers), beam in zip(QUESTIONS, BEAMS):
        q = query_vec(model, tok, question)
        live = [r for r in beam if r >= 0]
        scores = [float(q @ block_vecs[r].astype(np.float64)) for r in live]
        marks = [ref_has_answer(BLOCKS[r], answers) for r in live]
        hit = [s for s, m in zip(scores, marks) if m]
        want.append(_logsumexp(scores) - _logsumexp(hit) if hit else 0.0)
    got = model.beam_retrieval_nll(batch)
    assert got.tolist() == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert want[2] > 0 and want[3] == 0.0  # 2: the answer is in its beam past the top k; 3: nowhere -> masked
    out = model(batch)
    assert out["retrieval_loss"].item() == pytest.approx(sum(want) / len(want), rel=1e-5)
    assert out["beam_answerable"].item() == 0.75
    # the marks: every block where the reader can find an answer span is marked, empty slots never
    for b, (_, answers) in enumerate(QUESTIONS):
        for j, r in enumerate(BEAMS[b]):
            mark = bool(batch["beam_has_answer"][b, j])
            assert mark == (r >= 0 and ref_has_answer(BLOCKS[r], answers))
            if r >= 0 and find_answer_spans(blocks[r]["offsets"], BLOCKS[r], answers, A):
                assert mark


def test_beam_gradients_reach_the_query_tower_only(tok, blocks, block_vecs):
    model = make_model(len(tok)).train()
    collate = QACollator(tok, blocks, block_vecs, query_len=QLEN, passage_len=PLEN, top_k=K, max_answer_tokens=A,
                         retrieve=fixed_beams, beam=5)
    batch = collate(rows())
    batch["beam_embeddings"].requires_grad_(True)
    model.beam_retrieval_nll(batch).mean().backward()
    assert batch["beam_embeddings"].grad is None
    assert sum(p.grad.abs().sum().item() for p in model.retriever.parameters() if p.grad is not None) > 0
    assert all(p.grad is None for p in model.reader.parameters())


# ----------------------------------------------------------------------------------------------
# (b) the joint span softmax, (c) the MLP span scorer
# ----------------------------------------------------------------------------------------------
def ref_reader_outputs(reader: SpanReader, ids: torch.Tensor, types: torch.Tensor):
    """One unpadded sequence through the reader: (start, end) logits (linear) or hidden states (mlp)."""
    if reader.span_mlp is None:
        return reader(ids, torch.ones_like(ids), types)
    return reader.qa_model.base_model(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=types).last_hidden_state[0]


def ref_span_score(reader: SpanReader, outputs, i: int, j: int) -> float:
    """f(i, j), one pair at a time."""
    if reader.span_mlp is None:
        start, end = outputs
        return float(start[0, i] + end[0, j])
    h = outputs
    mlp = reader.span_mlp
    # ORQA's W [h_i; h_j]: one (2H -> S) kernel over the concatenation
    H = h.shape[-1]
    w_s, w_e = mlp.proj.weight[:S], mlp.proj.weight[S:]  # (S, H) each
    W = torch.cat([w_s, w_e], dim=1)  # (S, 2H)
    b = mlp.proj.bias[:S] + mlp.proj.bias[S:]
    hidden = torch.relu(W @ torch.cat([h[i], h[j]]) + b)
    assert W.shape == (S, 2 * H)
    mu, var = hidden.mean(), hidden.var(unbiased=False)
    normed = (hidden - mu) / torch.sqrt(var + mlp.norm.eps) * mlp.norm.weight + mlp.norm.bias
    return float(mlp.out.weight[0] @ normed + mlp.out.bias[0])


@torch.no_grad()
def ref_joint(model: OpenQA, tok, blocks, block_vecs, question: str, answers, cand: list[int]):
    """{(k, i, j): log p(z_k, s_ij | x)} over every (block, span) of the top k and the reader NLL."""
    cls, sep = tok.cls_token_id, tok.sep_token_id
    x = tok(question, add_special_tokens=False)["input_ids"][: QLEN - 2]
    q = query_vec(model, tok, question)
    logits, correct = {}, set()
    for k, row in enumerate(cand):
        if row < 0:
            continue
        z, offs = blocks[row]["input_ids"][: PLEN - 2], blocks[row]["offsets"][: PLEN - 2]
        ids = torch.tensor([[cls, *x, sep, *z, sep]])
        types = torch.tensor([[0] * (len(x) + 2) + [1] * (len(z) + 1)])
        z0 = len(x) + 2
        retrieval = float(q @ block_vecs[row].astype(np.float64))
        ok_s, ok_e = word_boundaries(offs, blocks[row]["text"])
        outputs = ref_reader_outputs(model.reader, ids, types)
        for i in range(len(z)):
            for j in range(i, min(len(z), i + A)):
                if ok_s[i] and ok_e[j]:
                    logits[(k, z0 + i, j - i)] = ref_span_score(model.reader, outputs, z0 + i, z0 + j) + retrieval
        correct |= {(k, z0 + s, e - s) for s, e in find_answer_spans(offs, blocks[row]["text"], answers, A)}
    log_z = _logsumexp(list(logits.values()))
    log_p = {key: v - log_z for key, v in logits.items()}
    nll = -_logsumexp([log_p[c] for c in correct]) if correct else 0.0
    return log_p, nll


@pytest.mark.parametrize("scorer", ["linear", "mlp"])
def test_joint_span_softmax_equals_pair_by_pair_reference(tok, blocks, block_vecs, scorer):
    model = make_model(len(tok), scorer=scorer, softmax="joint")
    collate = QACollator(tok, blocks, block_vecs, query_len=QLEN, passage_len=PLEN, top_k=K, max_answer_tokens=A,
                         retrieve=fixed_beams, beam=5)
    batch = collate(rows())
    with torch.no_grad():
        joint = model.joint_log_probs(batch)  # (B, K, L, A)
    nlls = []
    for b, (question, answers) in enumerate(QUESTIONS):
        log_p, nll = ref_joint(model, tok, blocks, block_vecs, question, answers, BEAMS[b][:K])
        live = (joint[b] > -1e29).nonzero().tolist()
        assert {tuple(e) for e in live} == set(log_p)  # the same (block, span) candidates
        for key, want in log_p.items():
            assert joint[b][key].item() == pytest.approx(want, rel=1e-4, abs=1e-4), key
        assert joint[b][joint[b] > -1e29].exp().sum().item() == pytest.approx(1.0, abs=1e-5)  # one softmax
        nlls.append(nll)
    assert nlls[0] > 0 and nlls[3] == 0.0
    out = model(batch)
    assert out["reader_loss"].item() == pytest.approx(sum(nlls) / len(nlls), rel=1e-4, abs=1e-5)


def test_per_block_softmax_is_a_different_normalisation(tok, blocks, block_vecs):
    joint, per_block = make_model(len(tok), softmax="joint"), make_model(len(tok), softmax="per_block")
    per_block.load_state_dict(joint.state_dict())
    batch = QACollator(tok, blocks, block_vecs, query_len=QLEN, passage_len=PLEN, top_k=K, max_answer_tokens=A,
                       retrieve=fixed_beams, beam=5)(rows())
    with torch.no_grad():
        a, b = joint.joint_log_probs(batch), per_block.joint_log_probs(batch)
        pz = per_block.retrieval_log_probs(batch).exp()
    live = a > -1e29
    assert torch.equal(live, b > -1e29) and not torch.allclose(a[live], b[live], atol=1e-3)
    # per_block: each block's spans sum to p(z | x)
    np.testing.assert_allclose(b.masked_fill(~live, -1e30).exp().sum((2, 3))[:, :2].numpy(), pz[:, :2].numpy(), atol=1e-5)


def test_mlp_span_scorer_equals_pairwise_reference():
    torch.manual_seed(1)
    H, L = 12, 9
    mlp = SpanMLP(H, S)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.5)
    hidden = torch.randn(2, L, H)
    with torch.no_grad():
        got = mlp(hidden, A)  # (2, L, A)
        assert got.shape == (2, L, A)
        for n in range(2):
            for i in range(L):
                for w in range(A):
                    if i + w >= L:
                        continue  # past the sequence: masked by the caller
                    cat = torch.cat([hidden[n, i], hidden[n, i + w]])  # [h_i; h_j]
                    W = torch.cat([mlp.proj.weight[:S], mlp.proj.weight[S:]], dim=1)  # (S, 2H)
                    h = torch.relu(W @ cat + mlp.proj.bias[:S] + mlp.proj.bias[S:])
                    want = mlp.out(torch.nn.functional.layer_norm(h, (S,), mlp.norm.weight, mlp.norm.bias, mlp.norm.eps))
                    assert got[n, i, w].item() == pytest.approx(want.item(), rel=1e-5, abs=1e-5), (n, i, w)
    # ORQA's init: truncated normal 0.02 kernels, zero biases
    fresh = SpanMLP(H, S)
    assert fresh.proj.weight.abs().max().item() <= 0.04 and not fresh.proj.bias.any()


def test_mlp_reader_and_joint_softmax_save_and_load(tok, blocks, block_vecs, tmp_path):
    model = make_model(len(tok), scorer="mlp", softmax="joint")
    batch = QACollator(tok, blocks, block_vecs, query_len=QLEN, passage_len=PLEN, top_k=K, max_answer_tokens=A,
                       retrieve=fixed_beams, beam=5)(rows())
    again = OpenQA.from_pretrained(model.save_pretrained(tmp_path / "openqa", tok)).eval()
    assert again.span_softmax == "joint" and again.reader.span_scorer == "mlp" and again.reader.span_hidden == S
    assert again(batch)["loss"].item() == pytest.approx(model(batch)["loss"].item(), abs=1e-6)


# ----------------------------------------------------------------------------------------------
# (d) the per-step search reads the current tower
# ----------------------------------------------------------------------------------------------
def exact_top(model: OpenQA, tok, block_vecs, n: int) -> list[list[int]]:
    out = []
    for question, _ in QUESTIONS:
        scores = block_vecs.astype(np.float64) @ query_vec(model, tok, question)
        out.append([int(r) for r in np.argsort(-scores, kind="stable")[:n]])
    return out


def test_every_batch_is_retrieved_with_the_query_tower_as_it_is_now(tok, blocks, block_vecs):
    model = make_model(len(tok)).train()
    search = tower_search_fn(model.retriever, tok, QLEN, lambda q, n: dense_search(q, block_vecs, n))
    collate = QACollator(tok, blocks, block_vecs, query_len=QLEN, passage_len=PLEN, top_k=K, max_answer_tokens=A,
                         retrieve=search, beam=5)
    opt = torch.optim.SGD(model.retriever.parameters(), lr=5.0)
    seen = []
    # a stale selection in the rows is ignored: the collator searches
    stale = [{**r, "block_rows": [4, 4, 4]} for r in rows()]
    for _ in range(3):
        batch = collate(stale)
        assert model.retriever.training  # the search restores the tower's mode
        assert batch["beam_rows"].tolist() == exact_top(model, tok, block_vecs, 5)
        assert batch["candidate_rows"].tolist() == exact_top(model, tok, block_vecs, K)
        seen.append(batch["candidate_rows"].tolist())
        opt.zero_grad()
        model(batch)["loss"].backward()
        opt.step()
    # a changed tower retrieves other blocks, never the set from before fine-tuning
    with torch.no_grad():
        for p in model.retriever.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    now = collate(stale)["candidate_rows"].tolist()
    assert now == exact_top(model, tok, block_vecs, K) and now != seen[0]


def test_fixed_search_keeps_the_beams_of_the_tower_before_fine_tuning(tok, blocks, block_vecs):
    """`finetune.qa_search: fixed`, the ablation: every batch reads the beam the tower had before the
    first step, however far the tower moves; the retrieval loss still scores it with the tower now."""
    model = make_model(len(tok)).train()
    search = tower_search_fn(model.retriever, tok, QLEN, lambda q, n: dense_search(q, block_vecs, n))
    before = exact_top(model, tok, block_vecs, 5)
    fixed = frozen_search_fn(search, [q for q, _ in QUESTIONS] + [QUESTIONS[0][0]], 5)  # a repeat is one entry
    collate = QACollator(tok, blocks, block_vecs, query_len=QLEN, passage_len=PLEN, top_k=K, max_answer_tokens=A,
                         retrieve=fixed, beam=5)
    with torch.no_grad():
        for p in model.retriever.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    assert exact_top(model, tok, block_vecs, 5) != before  # the tower moved ...
    batch = collate(rows())
    assert batch["beam_rows"].tolist() == before  # ... the beams did not
    assert batch["candidate_rows"].tolist() == [b[:K] for b in before]
    model(batch)["loss"].backward()  # the beam's scores come from the tower now: it still learns
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.retriever.parameters())
    with pytest.raises(KeyError, match="built without 1 of these questions"):
        fixed(["Who is not in the table?"], 5)
    with pytest.raises(ValueError, match="top 5, not 6"):
        fixed([QUESTIONS[0][0]], 6)


def test_evaluation_retrieves_as_training_does(tok, blocks, block_vecs):
    """OpenQAPredictor.select (evaluate) = the training collator's top k for the same tower."""
    from types import SimpleNamespace

    from components.eval.open_qa import OpenQAPredictor

    class Index:
        def search(self, q, n):
            return dense_search(q, block_vecs, n)

    model = make_model(len(tok), scorer="mlp", softmax="joint")
    ft = SimpleNamespace(query_len=QLEN, passage_len=PLEN, qa_top_k=K, max_answer_tokens=A, qa_retrieval_beam=5)
    search = tower_search_fn(model.retriever, tok, QLEN, Index().search)
    train_collate = QACollator.from_params(tok, blocks, block_vecs, ft, retrieve=search)
    qa = OpenQAPredictor(model, ft, tok, blocks, block_vecs, Index(), batch_size=2)
    selected = qa.select([{"id": str(i), **r} for i, r in enumerate(rows())])
    assert [r["block_rows"] for r in selected] == train_collate(rows())["candidate_rows"].tolist()
