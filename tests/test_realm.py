"""REALM: batched marginal likelihood vs a brute-force reference, gradients, null document,
source-block exclusion, save/load, and a tiny overfit."""

from __future__ import annotations

from tests.conftest import overfit
import numpy as np
import pytest
import torch

from components.config_stages import RealmParams
from components.data.realm_batch import (
    IGNORE_INDEX, MISSING_ROW, NULL_ROW, SpecialTokens, build_batch, collate, passage_inputs, retrieve_candidates,
)
from components.data.realm_query import RealmQuery
from components.models.realm import REALM, KnowledgeAugmentedEncoder, knowledge_augmented_inputs, tiny_bert_config
from components.models.retriever import Retriever

SP = SpecialTokens(cls=2, sep=3, pad=0, mask=4)
VOCAB = 100
P = RealmParams(query_len=12, block_len=10, top_k=4, retriever_dim=16)


def make_model(marginalization="per_token", share_towers=False, seed=0, dropout=0.0, rescore_dropout=True) -> REALM:
    torch.manual_seed(seed)
    cfg = tiny_bert_config(vocab_size=VOCAB, hidden=32, layers=1, heads=2)
    cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = dropout
    # BERT's 0.02 init makes p(y|x,z) and p(z|x) nearly flat in z, and then any mixing formula looks
    # right; a wider init makes the documents matter, so the comparisons below can fail.
    cfg.initializer_range = 0.25
    model = REALM(Retriever.from_config(cfg, P.retriever_dim, share_towers), KnowledgeAugmentedEncoder.from_config(cfg),
                  marginalization, rescore_dropout=rescore_dropout)
    return model.eval()


def make_blocks(n=12, seed=0) -> list[list[int]]:
    g = np.random.default_rng(seed)
    return [g.integers(5, VOCAB, size=int(g.integers(3, 9))).tolist() for _ in range(n)]


def make_queries(seed=0) -> list[RealmQuery]:
    """Three queries of different lengths with 1, 2 and 3 masked tokens."""
    g = np.random.default_rng(seed)
    out = []
    for b, (n, span) in enumerate([(6, (1, 2)), (9, (3, 5)), (4, (0, 3))]):
        ids = g.integers(5, VOCAB, size=n).tolist()
        labels = [IGNORE_INDEX] * n
        for j in range(*span):
            labels[j], ids[j] = ids[j], SP.mask
        out.append(RealmQuery(ids, labels, source_row=b, masked=span))
    return out


def make_batch(blocks=None, missing=True) -> dict:
    blocks = blocks or make_blocks()
    cand = np.array([[NULL_ROW, 5, 7, 1], [NULL_ROW, 2, 0, 9], [NULL_ROW, 11, 4, MISSING_ROW if missing else 3]])
    return collate(make_queries(), cand, blocks, P, SP)


# ----------------------------------------------------------------------------------------------
# brute-force reference: one (x, z) pair at a time, plain log_softmax, explicit dot products
# ----------------------------------------------------------------------------------------------
def brute_force(model: REALM, batch: dict, mode: str) -> tuple[float, float]:
    ka, ret = model.knowledge_augmented_encoder, model.retriever
    total, n_tokens, p_null = 0.0, 0, []
    B, K, _ = batch["z_input_ids"].shape
    for b in range(B):
        lx = int(batch["x_attention_mask"][b].sum())
        x = batch["x_input_ids"][b, :lx]
        labels = batch["x_labels"][b, :lx]
        pos = (labels != IGNORE_INDEX).nonzero().flatten().tolist()
        q = ret.encode_query(x[None], torch.ones(1, lx, dtype=torch.long))[0]
        scores, token_lp = [], []
        for k in range(K):
            if not batch["candidate_mask"][b, k]:
                continue
            lz = int(batch["z_attention_mask"][b, k].sum())
            z = batch["z_input_ids"][b, k, :lz]
            doc = torch.cat([torch.tensor([SP.cls]), z])[None]
            d = ret.encode_passage(doc, torch.ones_like(doc))[0]
            scores.append(torch.dot(q, d))
            pair = torch.cat([x, z])[None]
            types = torch.tensor([[0] * lx + [1] * lz])
            logp = torch.log_softmax(ka(pair, torch.ones_like(pair), types)[0], dim=-1)  # (L, V)
            token_lp.append(torch.stack([logp[j, labels[j]] for j in pos]))  # (n_b,)
        log_pz = torch.log_softmax(torch.stack(scores), dim=0)  # (K_b,)
        p_null.append(float(log_pz[0].exp()))
        lp = torch.stack(token_lp)  # (K_b, n_b): log p(y_j | x, z)
        if mode == "per_token":
            total += float(torch.logsumexp(lp + log_pz[:, None], dim=0).sum())
        else:
            total += float(torch.logsumexp(lp.sum(1) + log_pz, dim=0))
        n_tokens += len(pos)
    return -total / n_tokens, float(np.mean(p_null))


@pytest.mark.parametrize("mode", ["per_token", "per_sequence"])
@pytest.mark.parametrize("share", [False, True])
def test_marginal_likelihood_matches_brute_force(mode, share):
    model = make_model(mode, share_towers=share)
    batch = make_batch()
    with torch.no_grad():
        out = model(batch)
        ref_loss, ref_p_null = brute_force(model, batch, mode)
    # the loss's 6 masked tokens; tokens/s counts every real token the reader read: x once per candidate, plus each z
    K = batch["z_input_ids"].shape[1]
    assert out["num_masked"].item() == 6
    assert out["num_tokens"].item() == K * batch["x_attention_mask"].sum().item() + batch["z_attention_mask"].sum().item()
    pz = model.retrieval_log_probs(batch).exp()
    assert (pz.max(-1).values - pz[:, :3].min(-1).values).min() > 0.05  # p(z|x) is far from uniform
    assert out["loss"].item() == pytest.approx(ref_loss, abs=1e-5)
    assert out["p_null"].item() == pytest.approx(ref_p_null, abs=1e-5)


def test_two_modes_differ_when_spans_have_several_tokens():
    batch = make_batch()
    with torch.no_grad():
        a = make_model("per_token")(batch)["loss"].item()
        b = make_model("per_sequence")(batch)["loss"].item()
    assert abs(a - b) > 1e-4


def test_missing_candidate_gets_zero_probability():
    model = make_model()
    batch = make_batch()
    log_pz = model.retrieval_log_probs(batch)
    assert torch.isinf(log_pz[2, 3]) and log_pz[2, 3] < 0
    assert torch.allclose(log_pz.exp().sum(-1), torch.ones(3))


def test_gradient_flows_into_both_retriever_towers():
    model = make_model(share_towers=False).train()
    model(make_batch())["loss"].backward()
    ret = model.retriever
    for name, module in [("query_encoder", ret.query_encoder), ("query_projection", ret.query_projection),
                         ("passage_encoder", ret.passage_encoder), ("passage_projection", ret.passage_projection),
                         ("reader", model.knowledge_augmented_encoder)]:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        assert grads and sum(float(g.abs().sum()) for g in grads) > 0, name


def test_shared_towers_are_one_module_and_stored_once():
    model = make_model(share_towers=True)
    assert model.retriever.passage_encoder is model.retriever.query_encoder
    names = list(model.state_dict())
    assert not any("passage" in n for n in names)


# ----------------------------------------------------------------------------------------------
# null document
# ----------------------------------------------------------------------------------------------
def test_null_document_is_slot_zero_and_an_empty_z():
    batch = make_batch()
    z, zm = batch["z_input_ids"], batch["z_attention_mask"]
    assert (z[:, 0, 0] == SP.sep).all() and (z[:, 0, 1:] == SP.pad).all()
    assert (zm[:, 0, 0] == 1).all() and (zm[:, 0, 1:] == 0).all()
    ids, mask, types = knowledge_augmented_inputs(batch["x_input_ids"], batch["x_attention_mask"], z, zm)
    for b, q in enumerate(make_queries()):
        n = int(mask[b, 0].sum())
        assert ids[b, 0, :n].tolist() == [SP.cls, *q.input_ids, SP.sep, SP.sep]  # [CLS] x [SEP] [SEP]
        assert types[b, 0, :n].tolist() == [0] * (n - 1) + [1]
        # a real document follows x directly: [CLS] x [SEP] z [SEP]
        lz = int(zm[b, 1].sum())
        assert ids[b, 1, n - 1:n - 1 + lz].tolist() == z[b, 1, :lz].tolist()
        assert types[b, 1, :n - 1].sum() == 0 and types[b, 1, n - 1:n - 1 + lz].tolist() == [1] * lz


class _FixedScoreRetriever(Retriever):
    """Scores the null document (`[CLS] [SEP]`, 2 tokens) `null_score`, every other document 0."""

    def __init__(self, base: Retriever, null_score: float):
        super().__init__(base.query_encoder, base.query_projection)
        self.null_score = null_score

    def encode_query(self, input_ids, attention_mask):
        return torch.ones(input_ids.shape[0], 1)

    def encode_passage(self, input_ids, attention_mask):
        return (attention_mask.sum(1, keepdim=True) == 2).float() * self.null_score


@pytest.mark.parametrize("null_score, expect_high", [(5.0, True), (-5.0, False)])
def test_p_null_follows_the_retriever(null_score, expect_high):
    model = make_model()
    model.retriever = _FixedScoreRetriever(model.retriever, null_score)
    with torch.no_grad():
        p_null = model(make_batch(missing=False))["p_null"].item()
    assert (p_null > 0.5) == expect_high
    expected = np.exp(null_score) / (np.exp(null_score) + 3)
    assert p_null == pytest.approx(expected, rel=1e-5)


# ----------------------------------------------------------------------------------------------
# retrieval: source exclusion, null, K
# ----------------------------------------------------------------------------------------------
def _search_returning(rows: np.ndarray):
    calls = []

    def search(q, k):
        calls.append(k)
        r = rows[: len(q), :k]
        return np.zeros(r.shape, np.float32), r

    return search, calls


def test_source_block_is_excluded_even_when_top_hit():
    rows = np.array([[3, 8, 1, 6, 2, 9], [4, 3, 7, 0, 5, 1], [2, 2, 5, -1, -1, -1]])
    search, calls = _search_returning(rows)
    cand = retrieve_candidates(np.zeros((3, 4), np.float32), search, [3, 7, 5], k=4)
    assert calls == [4]  # k - 1 documents + 1 spare for the source block
    assert cand.shape == (3, 4) and (cand[:, 0] == NULL_ROW).all()
    assert cand[0].tolist() == [NULL_ROW, 8, 1, 6]  # top hit 3 is the source
    assert cand[1].tolist() == [NULL_ROW, 4, 3, 0]  # source 7 dropped, the spare fills in
    assert cand[2].tolist() == [NULL_ROW, 2, MISSING_ROW, MISSING_ROW]  # duplicates and -1 not kept
    for b, src in enumerate([3, 7, 5]):
        assert src not in cand[b]


def test_source_block_not_retrieved_keeps_top_k_minus_1():
    rows = np.array([[8, 1, 6, 2]])
    search, _ = _search_returning(rows)
    assert retrieve_candidates(torch.zeros(1, 4), search, [3], k=4).tolist() == [[NULL_ROW, 8, 1, 6]]


def test_build_batch_end_to_end_with_a_flat_index():
    faiss = pytest.importorskip("faiss")
    model = make_model(share_towers=True)
    blocks = make_blocks(12)
    with torch.no_grad():
        pin = passage_inputs(blocks, P, SP)
        emb = model.retriever.encode_passage(pin["input_ids"], pin["attention_mask"]).numpy()
    index = faiss.IndexFlatIP(emb.shape[1])
    index.add(emb)
    queries = make_queries()
    batch = build_batch(queries, model.retriever, index.search, blocks, P, SP)
    cand = batch["candidate_rows"]
    assert cand.shape == (3, P.top_k) and (cand[:, 0] == NULL_ROW).all()
    for b, q in enumerate(queries):
        assert q.source_row not in cand[b].tolist()
        for k in range(1, P.top_k):
            r = int(cand[b, k])
            lz = int(batch["z_attention_mask"][b, k].sum())
            assert batch["z_input_ids"][b, k, :lz].tolist() == blocks[r][: P.block_len - 2] + [SP.sep]
    out = model(batch)
    assert torch.isfinite(out["loss"]) and 0 <= out["p_null"] <= 1


# ----------------------------------------------------------------------------------------------
# persistence and learning
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("share", [True, False])
def test_save_and_load_round_trip(tmp_path, share):
    model = make_model("per_sequence", share_towers=share)
    batch = make_batch()
    with torch.no_grad():
        before = model(batch)
    model.save_pretrained(tmp_path / "realm")
    model.save_pretrained(tmp_path / "realm")  # overwriting an existing folder works too
    assert (tmp_path / "realm" / "retriever" / "query_encoder" / "model.safetensors").exists()
    assert (tmp_path / "realm" / "retriever" / "passage_encoder").exists() != share
    loaded = REALM.from_pretrained(tmp_path / "realm").eval()
    assert loaded.marginalization == "per_sequence" and loaded.retriever.share_towers == share
    with torch.no_grad():
        after = loaded(batch)
    for k in before:
        assert after[k].item() == pytest.approx(before[k].item(), abs=1e-6), k
    # the retriever folder alone is loadable, and its encoder folder is a plain HF model
    ret = Retriever.from_pretrained(tmp_path / "realm" / "retriever")
    assert ret.retriever_dim == P.retriever_dim
    from transformers import AutoModel
    assert AutoModel.from_pretrained(tmp_path / "realm" / "retriever" / "query_encoder").config.hidden_size == 32


def test_retriever_from_encoder_folder(tmp_path):
    from transformers import BertModel
    enc = BertModel(tiny_bert_config(), add_pooling_layer=True)
    enc.save_pretrained(tmp_path / "retromae")
    ret = Retriever.from_encoder(tmp_path / "retromae", retriever_dim=32, share_towers=False)
    assert ret.query_encoder.pooler is None
    torch.testing.assert_close(ret.query_encoder.embeddings.word_embeddings.weight, enc.embeddings.word_embeddings.weight)
    x = torch.tensor([[2, 10, 11, 3]])
    # square orthogonal projection: inner products of [CLS] vectors are preserved at init
    with torch.no_grad():
        cls = enc(input_ids=x).last_hidden_state[:, 0]
        assert ret.encode_query(x, torch.ones_like(x)).norm().item() == pytest.approx(cls.norm().item(), rel=1e-4)


@pytest.mark.parametrize("mode", ["per_token", "per_sequence"])
def test_loss_falls_on_a_tiny_overfit_batch(mode):
    model = make_model(mode, share_towers=True).train()
    batch = make_batch()
    losses = overfit(model, batch, torch.optim.Adam(model.parameters(), lr=3e-3))
    assert losses[-1] < 0.3 * losses[0], losses
    assert model(batch)["mlm_acc"].item() == 1.0


def test_bf16_autocast_forward_backward():
    model = make_model().train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(make_batch())
    out["loss"].backward()
    assert out["loss"].dtype == torch.float32 and torch.isfinite(out["loss"])
    assert model.retriever.query_projection.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------
# realm.freeze_reader, realm.rescore_dropout, realm.train.retriever_lr: on the real Trainer
# ----------------------------------------------------------------------------------------------
def _fit(model: REALM, out_dir, **train):
    """A few REALM steps of the shared Trainer on make_batch(), with the stage's lr groups."""
    from components.stages.pretrain_realm import retriever_lr_groups
    from components.training.trainer import Trainer
    from tests.conftest import tiny_params

    p = tiny_params(**{f"realm.train.{k}": v for k, v in {"max_steps": 3, "batch_size": 3, "lr": 1e-3, "warmup_ratio": 0.0,
                                                          "checkpoint_every": 10, **train}.items()})
    batch = make_batch()
    trainer = Trainer(model, list(range(3)), lambda rows: batch, p.realm.train, p.compute, out_dir, progress=False,
                      lr_groups=retriever_lr_groups(p.realm.train))
    trainer.fit()
    return trainer


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_frozen_reader_keeps_its_weights_and_reads_without_a_graph(tmp_path):
    model = make_model(dropout=0.1).freeze_reader()
    reader = model.knowledge_augmented_encoder
    reader0, retriever0 = _state(reader), _state(model.retriever)
    reads = []
    real_read = reader.masked_log_probs

    def spy(*args):
        out = real_read(*args)
        reads.append((torch.is_grad_enabled(), out.requires_grad, reader.training, model.training))
        return out

    reader.masked_log_probs = spy
    trainer = _fit(model, tmp_path)
    assert reads and all(r == (False, False, False, True) for r in reads)  # no graph, no dropout, in a training step
    after = _state(reader)
    assert all(torch.equal(after[k], reader0[k]) for k in reader0)
    after = _state(model.retriever)
    assert not all(torch.equal(after[k], retriever0[k]) for k in retriever0)
    reader_ids = {id(p) for p in reader.parameters()}
    assert not reader_ids & {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}  # no optimiser state
    assert not reader_ids & {id(p) for p in trainer.optimizer.state}


def test_frozen_reader_leaves_the_retriever_gradient_unchanged():
    """d loss / d retriever needs log p(y|x,z) only as a value per z: the same gradient without the reader's graph."""
    grads = []
    for frozen in (False, True):
        model = make_model().train()
        if frozen:
            model.freeze_reader()
        model(make_batch())["loss"].backward()
        grads.append({n: p.grad.clone() for n, p in model.retriever.named_parameters()})
        reader_grads = [p.grad for p in model.knowledge_augmented_encoder.parameters()]
        assert all(g is None for g in reader_grads) == frozen
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("rescore_dropout", [True, False])
def test_rescoring_without_dropout_scores_a_batch_alike_twice_in_training(rescore_dropout):
    model = make_model(dropout=0.1, rescore_dropout=rescore_dropout).train()
    batch = make_batch(missing=False)
    a, b = model.retrieval_log_probs(batch), model.retrieval_log_probs(batch)
    assert model.training and a.requires_grad and model.knowledge_augmented_encoder.training  # the reader keeps its dropout
    assert torch.equal(a, b) != rescore_dropout
    a.sum().backward()  # still trained through
    assert all(p.grad is not None for p in model.retriever.parameters())


def test_retriever_lr_is_its_own_param_group(tmp_path):
    model = make_model()
    retriever_ids = {id(p) for p in model.retriever.parameters()}
    trainer = _fit(model, tmp_path / "grouped", lr=1e-4, retriever_lr=1e-3)
    groups = trainer.optimizer.param_groups
    grouped = {id(p) for g in groups if g["group"] == "retriever" for p in g["params"]}
    assert grouped == retriever_ids
    assert not retriever_ids & {id(p) for g in groups if g["group"] != "retriever" for p in g["params"]}
    assert {g["group"]: g["lr_scale"] for g in groups} == {"": 1.0, "retriever": pytest.approx(10.0)}
    lr = {g["group"]: g["lr"] for g in groups}  # the last step's rates: one schedule, scaled per group
    assert lr[""] > 0 and lr["retriever"] == pytest.approx(10 * lr[""])
    same = _fit(make_model(), tmp_path / "one")  # null: one rate, no group
    assert {g["group"] for g in same.optimizer.param_groups} == {""}


@pytest.mark.parametrize("every, recomputed", [(1, [2, 2]), (2, [2, 1])])
@pytest.mark.parametrize("masks", ["torch", "fast"])
def test_activation_checkpointing_recomputes_layers_and_keeps_ict_gradients_with_dropout(every, recomputed, masks):
    """`activation_checkpointing` (ICT's memory knob, realm.ict_checkpoint_every) runs every N-th layer
    again in backward and leaves every gradient as it was, dropout included: the recompute replays the
    generator, so it draws the same masks (torch's and the fast ones alike). Off again on exit."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from components.models.encoder import activation_checkpointing
    from components.models.ict import ICTModel
    from components.models.ops.dropout import use_fast_dropout

    cfg = tiny_bert_config(layers=2)
    cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = 0.2  # dropout on: a replay that drew new masks would differ
    torch.manual_seed(0)
    model = ICTModel(Retriever.from_config(cfg, retriever_dim=8)).train()
    if masks == "fast":
        use_fast_dropout(model)
    g = torch.Generator().manual_seed(1)
    batch = {"q_input_ids": torch.randint(5, 100, (4, 12), generator=g), "q_attention_mask": torch.ones(4, 12, dtype=torch.long),
             "d_input_ids": torch.randint(5, 100, (4, 30), generator=g), "d_attention_mask": torch.ones(4, 30, dtype=torch.long)}
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    calls = [0] * len(layers)
    for i, layer in enumerate(layers):  # hooked inside the layer: HF checkpoints a layer's forward, not its hooks
        layer.attention.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))

    def grads(seed: int, n: int) -> tuple[dict[str, torch.Tensor], list[int]]:
        calls[:] = [0] * len(layers)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        with activation_checkpointing(model, n) as set_:
            assert set_ == (1 if n else 0)  # one encoder: the towers are shared
            model(batch)["loss"].backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}, [c // 2 for c in calls]  # 2 calls a pass (q, d)

    want, passes = grads(7, 0)
    assert passes == [1, 1]
    got, passes = grads(7, every)
    assert passes == recomputed  # the checkpointed layers ran again in backward
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7, msg=k)
    other, _ = grads(8, 0)  # the test can tell: other masks give other gradients
    assert any(not torch.allclose(other[k], want[k]) for k in want)
    assert not any(m.gradient_checkpointing for m in layers)  # restored on exit
    assert model.retriever.query_encoder.config.use_cache is True
