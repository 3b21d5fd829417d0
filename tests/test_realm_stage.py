"""The `pretrain_realm` stage body on a tiny synthetic world: index refresh (sync and async), the
swap at step boundaries, a failing refresh, resume after a kill, outputs, MLflow child runs, and
(slow) the Prefect flow with its `refresh_index` subflows. Also the pieces it drives, on the same
world: the ICT and reader warm-up batches, the probes and their gold."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

import components.index.embed as embed_lib
import components.stages.pretrain_realm as stage
from components import paths
from components.data.ict_batch import ICTCollator, ict_eligible_rows
from components.data.realm_batch import passage_inputs
from components.data.realm_query import context_spans, eligible_rows, fixed_queries, masked_answer
from components.data.token_spans import contains_span, salient_token_spans, sentence_token_spans
from components.data.special_tokens import IGNORE_INDEX, SpecialTokens
from components.eval.realm_probes import answer_blocks, heldout_probes, probe_retrieval, same_entity_gold
from components.index.faiss_index import BlockIndex, IndexStore
from components.models.realm import REALM
from components.models.retriever import Retriever
from components.stages.pretrain_realm import checkpoint_root
from components.tracking import StageRun
from components.training.warmups import ReaderWarmupCollator, ReaderWarmupModel, SalientSpanIndex, cut_around
from tests.conftest import ROOT, TINY, build_data_and_encoders, tiny_params


# ----------------------------------------------------------------------------------------------
# fixtures: one tiny world per module, one fresh workspace (cwd) per test
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """data/corpus + data/tokens (the real stage functions) and a RetroMAE-shaped encoder folder."""
    root = tmp_path_factory.mktemp("realm_world")
    build_data_and_encoders(root, tiny_params())
    return root


@pytest.fixture
def ws(world, tmp_path, monkeypatch) -> Path:
    """A workspace: data/ and models/retromae shared with the world, everything else fresh."""
    (tmp_path / "models").mkdir()
    os.symlink(world / "data", tmp_path / "data")
    os.symlink(world / "models/retromae", tmp_path / "models/retromae")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{world}/mlflow.db")
    monkeypatch.delenv("RR_PARENT_RUN_ID", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    return tmp_path


def run_stage(**overrides) -> tuple[dict, str, object]:
    p = tiny_params(**overrides)
    with StageRun("pretrain_realm", p, ["realm"]) as run:
        summary = stage.train_realm(p, run)
    return summary, run.run_id, p


def mlflow_client() -> MlflowClient:
    return MlflowClient(os.environ["MLFLOW_TRACKING_URI"])


def refresh_children(run_id: str) -> list:
    c = mlflow_client()
    exp = c.get_experiment_by_name("retro-realm")
    runs = c.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'")
    return sorted([r for r in runs if r.data.tags.get("rr.kind") == "refresh_index"], key=lambda r: r.info.start_time)


def metric_steps(run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in mlflow_client().get_metric_history(run_id, key))


def plot_rows() -> list[dict]:
    with open("plots/realm_refresh.csv", newline="") as f:
        return list(csv.DictReader(f))


# ----------------------------------------------------------------------------------------------
# unit pieces
# ----------------------------------------------------------------------------------------------
def _world_blocks(world):
    """The module world's retrieval blocks and special-token ids."""
    import datasets

    from components.data.tokenize import load_tokenizer

    blocks = datasets.load_from_disk(str(world / "data/tokens/blocks"))
    return blocks, SpecialTokens.from_tokenizer(load_tokenizer(world / "data/tokens/tokenizer"))


def test_ict_collator_removes_the_query_sentence_from_its_context(world):
    p = tiny_params().realm
    blocks, sp = _world_blocks(world)
    rows = ict_eligible_rows(blocks)[:6]
    assert rows, "the synthetic world has multi-sentence blocks"

    def unpad(ids, mask):
        return ids[mask.bool()].tolist()[1:-1]  # drop [CLS] / [SEP]

    for rate in (1.0, 0.0):
        b = ICTCollator(blocks, p, sp, rate)(rows, generator=torch.Generator().manual_seed(3))
        for i, r in enumerate(rows):
            ids = list(blocks[r]["input_ids"])
            spans = sentence_token_spans(blocks[r]["text"], blocks[r]["offsets"])
            assert len(spans) >= 2
            q, d = unpad(b["q_input_ids"][i], b["q_attention_mask"][i]), unpad(b["d_input_ids"][i], b["d_attention_mask"][i])
            hits = [(s, e) for s, e in spans if ids[s:e][: p.query_len - 2] == q]
            assert hits, "the query is one of the block's sentences"
            s, e = hits[0]
            want = (ids[:s] + ids[e:]) if rate == 1.0 else ids
            assert d == want[: p.block_len - 2]


@pytest.mark.parametrize("ict_accum, micro", [(1, 4), (2, 2)])
def test_ict_negatives_are_its_own_micro_batch_not_realm_trains(world, tmp_path, monkeypatch, ict_accum, micro):
    """ICT's in-batch negatives are the other contexts of its micro-batch. realm.ict_grad_accum splits
    its batch; realm.train.grad_accum (REALM's memory knob: 2 here) does not."""
    from components.data.tokenize import load_tokenizer
    from components.models.ict import ICTModel
    from components.models.realm import tiny_bert_config
    from components.training.warmups import ict_warmup

    p = tiny_params(**{"realm.ict_steps": 1, "realm.ict_batch_size": 4, "realm.ict_grad_accum": ict_accum,
                       "realm.train.grad_accum": 2})
    blocks, sp = _world_blocks(world)
    seen: list[int] = []
    forward = ICTModel.forward

    def counting_forward(self, batch):
        seen.append(batch["q_input_ids"].shape[0])
        return forward(self, batch)

    monkeypatch.setattr(ICTModel, "forward", counting_forward)
    vocab = len(load_tokenizer(world / "data/tokens/tokenizer"))
    retriever = Retriever.from_config(tiny_bert_config(vocab_size=vocab), retriever_dim=8)
    summary = ict_warmup(retriever, blocks, p, sp, tmp_path / "ict")
    assert summary["ict_steps"] == 1 and seen == [micro] * ict_accum


@pytest.mark.parametrize("every, passes", [(0, 2), (1, 4)])
def test_ict_recomputes_its_towers_layers_as_ict_checkpoint_every_says(world, tmp_path, every, passes):
    """realm.ict_checkpoint_every: ICT's step runs each checkpointed layer again in backward (HF's
    activation checkpointing), and only ICT does: the towers leave the warm-up with it off."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from components.data.tokenize import load_tokenizer
    from components.models.realm import tiny_bert_config
    from components.training.warmups import ict_warmup

    p = tiny_params(**{"realm.ict_steps": 1, "realm.ict_batch_size": 4, "realm.ict_checkpoint_every": every})
    blocks, sp = _world_blocks(world)
    vocab = len(load_tokenizer(world / "data/tokens/tokenizer"))
    retriever = Retriever.from_config(tiny_bert_config(vocab_size=vocab), retriever_dim=8)
    layer = next(m for m in retriever.modules() if isinstance(m, GradientCheckpointingLayer))
    calls = []
    layer.attention.register_forward_hook(lambda *_: calls.append(1))
    ict_warmup(retriever, blocks, p, sp, tmp_path / "ict")
    assert len(calls) == passes  # one step: the query pass and the block pass, each run again in backward when checkpointed
    assert not layer.gradient_checkpointing


def test_reader_warmup_reads_the_own_block_and_its_loss_is_the_masked_lm_loss(world):
    from components.models.realm import KnowledgeAugmentedEncoder, knowledge_augmented_inputs

    p = tiny_params().realm
    blocks, sp = _world_blocks(world)
    rows = eligible_rows(blocks, p, sp.mask, 0)[:5]
    b = ReaderWarmupCollator(blocks, p, sp)(rows, generator=torch.Generator().manual_seed(1))
    assert b["z_input_ids"].shape[:2] == (len(rows), 1)
    for i, r in enumerate(rows):  # z = the query's own block `z [SEP]`, and x is a masked window of it
        z = b["z_input_ids"][i, 0][b["z_attention_mask"][i, 0].bool()].tolist()
        assert z == list(blocks[r]["input_ids"])[: p.block_len - 2] + [sp.sep]
        x, y = b["x_input_ids"][i].tolist(), b["x_labels"][i].tolist()
        hidden = [t for t, lab in zip(x, y) if lab != IGNORE_INDEX]
        assert hidden and set(hidden) == {sp.mask}

    # the fast path (MLM head at the masked tokens only) == cross-entropy of the full MLM logits
    torch.manual_seed(0)
    reader = KnowledgeAugmentedEncoder.from_pretrained(world / "models/retromae/encoder").eval()
    out = ReaderWarmupModel(reader)(b)
    ids, mask, types = knowledge_augmented_inputs(b["x_input_ids"], b["x_attention_mask"], b["z_input_ids"], b["z_attention_mask"])
    with torch.no_grad():
        logits = reader(ids[:, 0], mask[:, 0], types[:, 0])[:, : b["x_labels"].shape[1]]  # (B, Lx, V)
    want = torch.nn.functional.cross_entropy(logits.transpose(1, 2), b["x_labels"], ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(out["loss"].detach(), want, rtol=1e-4, atol=1e-5)


def _z_tokens(b, i: int) -> list[int]:
    return b["z_input_ids"][i, 0][b["z_attention_mask"][i, 0].bool()].tolist()[:-1]  # drop `[SEP]`


def test_answer_docs_state_the_hidden_span_about_what_x_names(world):
    blocks, sp = _world_blocks(world)
    p = tiny_params().realm
    index = SalientSpanIndex(blocks, p.span_tagger)
    queries = fixed_queries(blocks, eligible_rows(blocks, p, sp.mask, 0), p, sp, 1)
    found = [index.answer_docs(q) for q in queries]
    assert 0 < sum(map(bool, found)) < len(queries)  # some facts are stated twice, most are not
    gold = same_entity_gold(queries, answer_blocks(queries, blocks), blocks, p.span_tagger)
    for q, docs, g in zip(queries, found, gold):
        assert q.source_row not in docs
        assert docs <= g  # holds the answer and one of x's other salient spans (the probe's definition) ...
        for r in docs:  # ... with the answer as a salient span of its own, not inside a longer word
            ids = list(blocks[r]["input_ids"])
            assert masked_answer(q) in {tuple(ids[s:e]) for s, e in salient_token_spans(blocks[r], p.span_tagger)}


def test_reader_warmup_answer_block_reads_another_statement_of_the_fact(world):
    blocks, sp = _world_blocks(world)
    p = tiny_params(**{"realm.reader_warmup_doc": "answer_block", "realm.reader_warmup_swap_answer": 0.0}).realm
    rows = eligible_rows(blocks, p, sp.mask, 0)
    index = SalientSpanIndex(blocks, p.span_tagger)
    allowed = set(rows[::2])  # documents may only come from these rows (the held-out blocks stay out)
    col = ReaderWarmupCollator(blocks, p, sp, index, allowed)
    examples = col.examples(rows, np.random.default_rng(3))
    assert len(examples) == len(rows)
    other = 0
    for q, z in examples:
        docs = index.answer_docs(q) & allowed
        assert z in ([list(blocks[r]["input_ids"]) for r in docs] or [list(blocks[q.source_row]["input_ids"])])
        other += bool(docs)
    assert other > 0  # not only the fallback
    b = col(rows[:4], generator=torch.Generator().manual_seed(3))  # the batch carries the same documents
    for i, (q, z) in enumerate(col.examples(rows[:4], np.random.default_rng(3))):  # (__call__ seeds with the generator's seed)
        assert _z_tokens(b, i) == z[: p.block_len - 2]


def test_reader_warmup_swap_replaces_the_answer_in_labels_and_document(world):
    blocks, sp = _world_blocks(world)
    p = tiny_params(**{"realm.reader_warmup_doc": "own_block", "realm.reader_warmup_swap_answer": 0.0}).realm
    rows = eligible_rows(blocks, p, sp.mask, 0)[:20]
    col = ReaderWarmupCollator(blocks, p, sp, SalientSpanIndex(blocks, p.span_tagger), set(rows))
    rng = np.random.default_rng(5)
    for q, z in col.examples(rows, rng):
        answer, labels, z0 = masked_answer(q), list(q.labels), list(z)
        q2, z2 = col.swap_answer(q, z, rng)
        assert q.labels == labels and z == z0  # the inputs are not modified
        new = masked_answer(q2)
        assert q2.input_ids == q.input_ids and len(new) == len(answer) and new != answer
        assert new in col.spans.by_len[len(answer)]  # another salient span of the corpus
        # z2 = z with each occurrence of the answer (the own block has one, where x hides it) replaced by `new`
        starts = [i for i in range(len(z)) if tuple(z[i:i + len(answer)]) == answer]
        assert starts and len(z2) == len(z)
        for i in range(len(z)):
            hit = next((s for s in starts if s <= i < s + len(answer)), None)
            assert z2[i] == (new[i - hit] if hit is not None else z[i])

    # through the batch, with the swap always on: x's label is written in z where the own block had another span
    swapping = ReaderWarmupCollator(blocks, p.model_copy(update={"reader_warmup_swap_answer": 1.0}), sp, col.spans, set(rows))
    b = swapping(rows, generator=torch.Generator().manual_seed(5))
    for i, r in enumerate(rows):
        y = b["x_labels"][i]
        hidden = tuple(y[y != IGNORE_INDEX].tolist())
        z, orig = _z_tokens(b, i), list(blocks[r]["input_ids"])[: p.block_len - 2]
        n = len(hidden)
        assert hidden and len(z) == len(orig)
        assert any(tuple(z[s:s + n]) == hidden and tuple(orig[s:s + n]) != hidden for s in range(len(z) - n + 1))


def test_cut_around_keeps_the_answer_centred_and_the_length():
    z = list(range(100))
    assert cut_around(z, (50, 51), 10) == list(range(46, 56))  # centred on the answer
    assert cut_around(z, (1,), 10) == list(range(10))  # clipped at the start ...
    assert cut_around(z, (99,), 10) == list(range(90, 100))  # ... and at the end
    assert cut_around(z, (7, 9), 10) == list(range(10))  # not in z: its start
    assert cut_around(z[:8], (3,), 10) == z[:8]  # shorter than n: whole


def test_reader_warmup_doc_len_and_mask_ratio(world):
    blocks, sp = _world_blocks(world)
    p = tiny_params(**{"realm.reader_warmup_doc": "own_block", "realm.reader_warmup_doc_len": 12,
                       "realm.reader_warmup_mask_ratio": 0.5}).realm
    rows = eligible_rows(blocks, p, sp.mask, 0)[:12]
    col = ReaderWarmupCollator(blocks, p, sp)
    b = col(rows, generator=torch.Generator().manual_seed(2))
    plain = ReaderWarmupCollator(blocks, p.model_copy(update={"reader_warmup_doc_len": None, "reader_warmup_mask_ratio": 0.0}), sp)
    ref = plain(rows, generator=torch.Generator().manual_seed(2))  # the same queries, before the two knobs
    extra = 0
    for i in range(len(rows)):
        y, y0 = b["x_labels"][i], ref["x_labels"][i]
        span = tuple(y0[y0 != IGNORE_INDEX].tolist())
        z = _z_tokens(b, i)
        assert len(z) <= 12 and any(tuple(z[s:s + len(span)]) == span for s in range(len(z)))  # the answer stays in z
        keep = y0 != IGNORE_INDEX
        assert torch.equal(y[keep], y0[keep])  # the salient span is still a target
        more = (y != IGNORE_INDEX) & ~keep  # the extra targets: x's own tokens, now masked
        assert (b["x_input_ids"][i][more] == sp.mask).all() and torch.equal(y[more], ref["x_input_ids"][i][more])
        assert not set(y[more].tolist()) & set(sp.special)
        extra += int(more.sum())
    assert extra > 0


def test_fixed_queries_draws_give_one_query_per_distinct_span(world):
    blocks, sp = _world_blocks(world)
    p = tiny_params().realm
    rows = eligible_rows(blocks, p, sp.mask, 0)[:30]
    one = fixed_queries(blocks, rows, p, sp, 1)
    many = fixed_queries(blocks, rows, p, sp, 1, draws=8)
    assert [q.source_row for q in one] == rows and len(many) > len(one)
    keys = [(q.source_row, masked_answer(q)) for q in many]
    assert len(set(keys)) == len(keys)  # no span twice
    for r in rows:  # at most `draws` per block, and only spans the block has
        mine = [a for row, a in keys if row == r]
        ids = list(blocks[r]["input_ids"])
        assert 1 <= len(mine) <= 8
        assert all(a in {tuple(ids[s:e]) for s, e in salient_token_spans(blocks[r], p.span_tagger)} for a in mine)
    assert fixed_queries(blocks, rows, p, sp, 1, draws=8) == many  # fixed for a seed


def test_probe_retrieval_recall_and_rank():
    emb = np.eye(4, dtype=np.float32)
    index = BlockIndex.build(emb, ["b0", "b1", "b2", "b3"], "flat")
    doc = np.asarray(["d0", "d0", "d1", "d2"])
    q = np.asarray([[0, 0, 1, 0.5], [0, 0, 0.2, 1.0]], dtype=np.float32)  # ranks: d1 first; d2 first
    out = probe_retrieval(q, index, [{"d1"}, {"d0"}], doc, k=1)
    assert out["recall_at_k"] == 0.5
    assert out["mean_rank"] == pytest.approx((1 + 3) / 2)  # second query: b3, b2, then a d0 block


def test_probe_retrieval_leaves_out_the_source_block():
    emb = np.eye(3, dtype=np.float32)
    index = BlockIndex.build(emb, ["b0", "b1", "b2"], "flat")
    q = np.asarray([[1.0, 0.5, 0.2]], dtype=np.float32)  # b0, b1, b2
    keys = np.asarray(["b0", "b1", "b2"])
    assert probe_retrieval(q, index, [{"b0"}], keys, k=1)["recall_at_k"] == 1.0
    out = probe_retrieval(q, index, [{"b2"}], keys, k=1, exclude=[0])  # b0 gone: b1 first, b2 second
    assert out["recall_at_k"] == 0.0 and out["mean_rank"] == 2.0


def test_heldout_gold_is_the_other_blocks_holding_the_masked_answer():
    from components.data.realm_query import RealmQuery

    blocks = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 6, 7]}, {"input_ids": [7, 6, 1]}, {"input_ids": [6, 7, 6]}]
    q = RealmQuery(input_ids=[5, 4, 4, 8], labels=[-100, 6, 7, -100], source_row=0, masked=(1, 3), masked_positions=[1, 2])
    assert answer_blocks([q], blocks) == [{1, 3}]  # the span in order, never the source block
    p = tiny_params().realm
    sp = SpecialTokens(cls=2, sep=3, pad=0, mask=4)
    pr = heldout_probes([q], blocks, np.asarray(["a", "b", "c", "d"]), p, sp)
    assert pr.level == "block" and pr.gold == [{"b", "d"}] and pr.exclude == [0]
    lonely = RealmQuery(input_ids=[4], labels=[99], source_row=2, masked=(0, 1), masked_positions=[0])
    assert heldout_probes([lonely], blocks, np.asarray(["a", "b", "c", "d"]), p, sp) is None  # unanswerable: dropped


def test_same_entity_gold_keeps_the_answer_blocks_that_share_a_salient_span_with_x(world):
    p = tiny_params().realm
    blocks, sp = _world_blocks(world)
    ids = np.asarray(blocks["block_id"])
    queries = fixed_queries(blocks, eligible_rows(blocks, p, sp.mask, 0), p, sp, 1)
    loose = heldout_probes(queries, blocks, ids, p, sp)
    tight = heldout_probes(queries, blocks, ids, p, sp, same_entity=True)
    assert tight.kind == "heldout_masked_same_entity" and 0 < len(tight) < len(loose)
    loose_gold = dict(zip(loose.exclude, loose.gold))
    by_row = {q.source_row: q for q in queries}
    row_of = {b: r for r, b in enumerate(ids)}
    for src, gold in zip(tight.exclude, tight.gold):
        assert gold <= loose_gold[src]  # still blocks that hold the answer
        ctx = context_spans(by_row[src], blocks[src], p.span_tagger)
        assert ctx and masked_answer(by_row[src]) not in ctx
        for b in gold:  # ... and that name one of the entities / dates x shows
            assert any(contains_span(list(blocks[row_of[b]]["input_ids"]), c) for c in ctx)
    assert sum(map(len, tight.gold)) < sum(len(loose_gold[s]) for s in tight.exclude)  # coincidences dropped


# ----------------------------------------------------------------------------------------------
# the stage body
# ----------------------------------------------------------------------------------------------
def test_sync_refresh_outputs_child_runs_and_step_boundary_swap(ws):
    summary, run_id, p = run_stage(**{"realm.refresh_mode": "sync", "realm.retriever_init": "retromae"})

    assert summary["step"] == 4 and summary["refreshes"] == 2 and summary["failures"] == 0
    assert summary["retriever_init"] == "retromae" and summary["knowledge_augmented_encoder_init"] == "retromae"
    # both warm-ups ran before REALM: ICT on the RetroMAE towers, and the reader on its own blocks
    assert summary["ict_steps"] == 2 and summary["reader_warmup_steps"] == 2 and "reader_warmup_final_reader_acc" in summary
    assert [s for s, _ in metric_steps(run_id, "reader_warmup_loss")] == [1, 2]
    # both warm-ups count the tokens they read, so their progress lines carry tokens/s
    assert all(metric_steps(run_id, f"{w}_tokens_per_s") for w in ("ict", "reader_warmup"))
    assert 0.0 <= summary["recall_at_k"] <= 1.0 and summary["probe_set"] == "dev_questions"
    assert summary["heldout_n"] > 0 and 0.0 <= summary["heldout_recall_at_k_start"] <= 1.0
    assert 0.0 <= summary["eval_mlm_acc_start"] <= 1.0 and 0.0 <= summary["heldout_recall_at_k"] <= 1.0
    assert json.loads(Path("metrics/pretrain_realm.json").read_text())["refreshes"] == 2

    # the index a step searched: v1 for steps 1-2, the step-2 refresh from step 3 on
    assert [v for _, v in metric_steps(run_id, "index_version")] == [1, 1, 2, 2]
    assert [s for s, _ in metric_steps(run_id, "probe_recall_at_k")] == [0, 2, 4]
    assert [s for s, _ in metric_steps(run_id, "heldout_recall_at_k")] == [0, 2, 4]
    assert [s for s, _ in metric_steps(run_id, "heldout_entity_recall_at_k")] == [0, 2, 4]
    assert summary["heldout_entity_n"] > 0 and 0.0 <= summary["heldout_entity_recall_at_k"] <= 1.0

    rows = plot_rows()
    assert {"step", "version", "recall_at_k", "mean_rank", "staleness", "refresh_seconds"} <= set(rows[0])
    assert [int(r["step"]) for r in rows] == [0, 2, 4]
    assert [int(r["version"]) for r in rows] == [1, 2, 3]

    kids = refresh_children(run_id)
    assert [k.data.tags["rr.refresh_reason"] for k in kids] == ["initial", "cadence", "cadence"]
    assert [int(k.data.tags["rr.index_version"]) for k in kids] == [1, 2, 3]
    for k in kids:
        m = k.data.metrics
        assert m["blocks_per_s"] > 0 and m["tokens_per_s"] > 0 and m["index_size"] > 0 and m["refresh_seconds"] > 0
        assert k.info.status == "FINISHED"
    assert all(0.0 <= k.data.metrics["staleness"] <= 1.0 for k in kids[1:])
    stage_run = mlflow_client().get_run(run_id)
    assert stage_run.data.tags["realm.retriever_init"] == "retromae"

    # outputs load back, and the final index holds exactly the saved retriever's block embeddings
    first, final = BlockIndex.load("models/realm/index/first"), BlockIndex.load("models/realm/index/final")
    assert (first.version, first.step) == (1, 0) and (final.version, final.step) == (3, 4)
    retriever = Retriever.from_pretrained("models/realm/retriever").eval()
    REALM.from_pretrained("models/realm")
    import datasets
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    AutoModelForMaskedLM.from_pretrained("models/realm/knowledge_augmented_encoder")
    tok = AutoTokenizer.from_pretrained("models/realm/knowledge_augmented_encoder")
    blocks = datasets.load_from_disk("data/tokens/blocks")
    x = passage_inputs(blocks[:5]["input_ids"], p.realm, SpecialTokens.from_tokenizer(tok))
    with torch.no_grad():
        emb = retriever.encode_passage(x["input_ids"], x["attention_mask"]).numpy()
    np.testing.assert_allclose(emb, final.embeddings()[:5], rtol=1e-4, atol=1e-4)
    assert len(final) == len(blocks) and list(final.ids[:5]) == blocks[:5]["block_id"]


def test_async_refresh_builds_in_the_background_ict_init(ws, monkeypatch):
    threads = []
    real_embed = embed_lib.embed_blocks

    def spy(*a, **kw):
        threads.append(threading.current_thread().name)
        return real_embed(*a, **kw)

    monkeypatch.setattr(embed_lib, "embed_blocks", spy)
    summary, run_id, _ = run_stage(**{"realm.refresh_mode": "async", "realm.retriever_init": "ict",
                                      "realm.train.max_steps": 6})

    assert summary["retriever_init"] == "ict" and summary["ict_steps"] == 2
    assert any(t.startswith("refresh_index@") for t in threads), threads  # cadence builds off the training thread
    assert summary["refreshes"] >= 1 and summary["failures"] == 0
    assert 0.0 <= summary["fraction_hidden"] <= 1.0 and summary["refresh_build_s"] > 0
    rows = plot_rows()
    versions = [int(r["version"]) for r in rows]
    assert versions == sorted(set(versions)) and int(rows[-1]["step"]) == 6
    kids = refresh_children(run_id)
    cadence = [k for k in kids if k.data.tags["rr.refresh_reason"] == "cadence"]
    assert cadence and all("staleness" in k.data.metrics and k.data.metrics["blocks_per_s"] > 0 for k in cadence)
    assert BlockIndex.load("models/realm/index/final").step == 6
    assert mlflow_client().get_run(run_id).data.tags["realm.retriever_init"] == "ict"


def test_the_arms_share_their_warm_ups_the_second_resumes_them(ws, monkeypatch):
    """Both arms start from the same warm-ups (they differ only in the refresh cadence): the first
    trains them, the second resumes their final checkpoints and starts REALM from the same model,
    whose first index and held-out accuracy at step 0 it reads instead of computing them again."""
    p = tiny_params(**{"realm.refresh_mode": "sync", "realm.retriever_init": "ict"})
    embeds = []
    real_embed = embed_lib.embed_blocks
    monkeypatch.setattr(embed_lib, "embed_blocks", lambda *a, **k: embeds.append(1) or real_embed(*a, **k))
    arms, n_embeds = {}, {}
    for arm in ("refreshed", "stale"):
        embeds.clear()
        with StageRun(f"pretrain_realm@{arm}", p, ["realm"]) as run:
            arms[arm] = (stage.train_realm(p, run, arm=arm), run.run_id)
        n_embeds[arm] = len(embeds)
    (first, first_id), (second, second_id) = arms["refreshed"], arms["stale"]
    # every refresh embeds the blocks (ICT's warm-up embeds none) but the second arm's initial one
    kids = {arm: refresh_children(run_id) for arm, (_, run_id) in arms.items()}
    assert n_embeds == {"refreshed": len(kids["refreshed"]), "stale": len(kids["stale"]) - 1}
    assert [k.data.metrics["shared_start"] for k in (kids["refreshed"][0], kids["stale"][0])] == [0.0, 1.0]
    first_vecs = [BlockIndex.load(f"models/{d}/index/first").embeddings() for d in ("realm", "realm-stale")]
    np.testing.assert_array_equal(*first_vecs)
    assert (stage.warmup_root(p) / "first_index_heldout_eval.json").is_file()
    assert first["ict_resumed_from"] == 0 and first["reader_warmup_resumed_from"] == 0
    assert second["ict_resumed_from"] == p.realm.ict_steps and second["reader_warmup_resumed_from"] == p.realm.reader_warmup_steps
    assert metric_steps(first_id, "reader_warmup_loss") and not metric_steps(second_id, "reader_warmup_loss")  # trained once
    for key in ("reader_warmup_final_reader_acc", "ict_final_ict_acc"):
        assert second[key] == first[key]
    # the same model before the first REALM step: the same first index, the same held-out accuracy at the start
    for key in ("eval_mlm_acc_start", "heldout_recall_at_k_start", "recall_at_k_start"):
        assert second[key] == first[key], key
    # the warm-ups live in the one shared folder, none in either arm's own
    assert (stage.warmup_root(p) / "reader_warmup").is_dir() and (stage.warmup_root(p) / "ict").is_dir()
    stale_root = stage.checkpoint_root(p.model_copy(update={"realm": p.realm.for_arm("stale")}), "stale")
    for root in (stage.checkpoint_root(p), stale_root):
        assert root.is_dir() and not (root / "reader_warmup").exists() and not (root / "ict").exists()


def test_refresh_every_zero_never_refreshes_during_training(ws):
    summary, run_id, _ = run_stage(**{"realm.refresh_mode": "sync", "realm.retriever_init": "random", "realm.refresh_every": 0})

    assert summary["step"] == 4 and summary["refreshes"] == 0 and "mean_staleness" not in summary
    assert [v for _, v in metric_steps(run_id, "index_version")] == [1, 1, 1, 1]  # every step searched the step-0 index
    # the final index is still rebuilt from the final weights (for the outputs and the fresh-index figures)
    assert [(int(r["step"]), r["reason"]) for r in plot_rows()] == [(0, "initial"), (4, "final")]
    assert "heldout_recall_at_k_train_index" in summary and "eval_mlm_acc_train_index" in summary


def test_failed_refresh_keeps_the_old_index_and_the_next_cadence_succeeds(ws, monkeypatch):
    calls = []
    real_embed = embed_lib.embed_blocks

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 2:  # the first cadence refresh (step 2); the initial build is call 1
            raise RuntimeError("injected embed failure")
        return real_embed(*a, **kw)

    monkeypatch.setattr(embed_lib, "embed_blocks", flaky)
    summary, run_id, _ = run_stage(**{"realm.refresh_mode": "sync", "realm.retriever_init": "random",
                                      "realm.train.max_steps": 6})

    assert summary["failures"] == 1 and summary["refreshes"] == 2
    # steps 1-4 searched v1 (the step-2 refresh failed), steps 5-6 the step-4 refresh
    assert [v for _, v in metric_steps(run_id, "index_version")] == [1, 1, 1, 1, 2, 2]
    assert [s for s, _ in metric_steps(run_id, "refresh_failed")] == [2]
    assert [int(r["step"]) for r in plot_rows()] == [0, 4, 6]
    kids = refresh_children(run_id)
    assert [k.info.status for k in kids] == ["FINISHED", "FAILED", "FINISHED", "FINISHED"]


def test_resume_after_a_kill_rebuilds_from_resumed_weights_and_ignores_partial_index(ws, monkeypatch):
    overrides = {"realm.refresh_mode": "sync", "realm.retriever_init": "random", "realm.train.max_steps": 4}
    real_forward = REALM.forward
    calls = []

    def dies_at_step_3(self, batch):
        calls.append(1) if self.training else None  # training steps only (the held-out eval runs in eval mode)
        if self.training and len(calls) == 3:
            raise KeyboardInterrupt("killed")  # what a kill looks like to the stage (after step 2's checkpoint)
        return real_forward(self, batch)

    monkeypatch.setattr(REALM, "forward", dies_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        run_stage(**overrides)
    monkeypatch.setattr(REALM, "forward", real_forward)

    root = checkpoint_root(tiny_params(**overrides)) / "index"
    assert IndexStore(root).versions() == [1, 2]
    # a half-written index from the kill: a valid-looking index of the wrong dim that would break search if loaded
    BlockIndex.build(np.eye(3, dtype=np.float32), None, "flat").save(root / ".tmp-v0009")
    cut = root.parent / ".tmp-refresh_history.json.k1ll3d"  # and a history write the kill cut short
    cut.write_text('{"ver')

    summary, run_id, _ = run_stage(**overrides)
    assert summary["resumed_from"] == 2 and summary["step"] == 4
    assert not (root / ".tmp-v0009").exists() and 9 not in IndexStore(root).versions()
    assert not cut.exists()
    kids = refresh_children(run_id)
    assert [(k.data.tags["rr.refresh_reason"], int(k.data.metrics["step"])) for k in kids] == [("initial", 2), ("cadence", 4)]
    assert [int(k.data.tags["rr.index_version"]) for k in kids] == [3, 4]
    assert [v for _, v in metric_steps(run_id, "index_version")] == [3, 3]  # steps 3-4 searched the rebuilt index
    rows = plot_rows()  # the history spans the kill
    assert [(int(r["step"]), int(r["version"])) for r in rows] == [(0, 1), (2, 2), (2, 3), (4, 4)]
    assert BlockIndex.load("models/realm/index/first").version == 1


def _retrieval_systems() -> list[str]:
    """The systems evaluate's retrieval rows hold in this workspace (the test split)."""
    from components.data.tokenize import load_tokenizer
    from components.eval.rows import eval_sets, retrieval_rows

    p = tiny_params()
    tok = load_tokenizer(paths.TOKENS / "tokenizer")
    with torch.inference_mode():
        return [r["system"] for r in retrieval_rows(p, eval_sets(p, tok)[0], tok, Path("metrics/eval"))]


def test_the_ict_row_is_the_retriever_realm_starts_from(ws, monkeypatch):
    """ICT on the RetroMAE towers, then REALM: models/realm/ict_retriever holds exactly the retriever
    of REALM's first training forward (before its first optimiser step), and evaluate reports it."""
    from components.models.encoder import load_encoder

    start: dict[str, torch.Tensor] = {}
    real_forward = REALM.forward

    def first_step(self, batch):
        if self.training and not start:
            start.update({k: v.detach().clone() for k, v in self.retriever.state_dict().items()})
        return real_forward(self, batch)

    monkeypatch.setattr(REALM, "forward", first_step)
    summary, _, _ = run_stage(**{"realm.refresh_mode": "sync", "realm.retriever_init": "retromae"})
    assert summary["ict_steps"] == 2 and start
    ict = Retriever.from_pretrained(paths.REALM_OUT / paths.ICT_RETRIEVER).state_dict()
    assert ict.keys() == start.keys() and all(torch.equal(ict[k], start[k]) for k in start)
    assert 'Retriever.from_pretrained("models/realm/ict_retriever")' in (paths.REALM_OUT / "model_card.md").read_text()
    final = Retriever.from_pretrained(paths.REALM_OUT / "retriever").state_dict()
    assert not all(torch.equal(final[k], start[k]) for k in start)  # REALM trained on from it
    retromae = load_encoder("models/retromae/encoder").state_dict()
    assert not all(torch.equal(ict[f"query_encoder.{k}"], v) for k, v in retromae.items())  # ... and ICT before it
    systems = _retrieval_systems()
    assert systems[systems.index("ict"):][:2] == ["ict", "realm"]


def test_without_ict_there_is_no_ict_retriever_and_no_row(ws):
    summary, _, _ = run_stage(**{"realm.refresh_mode": "sync", "realm.ict_steps": 0})
    assert "ict_steps" not in summary and (paths.REALM_OUT / "retriever").is_dir()
    assert not (paths.REALM_OUT / paths.ICT_RETRIEVER).exists()
    systems = _retrieval_systems()
    assert "realm" in systems and "ict" not in systems


# ----------------------------------------------------------------------------------------------
# the Prefect flow
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_flow_runs_each_refresh_as_a_prefect_subflow(ws, shared_prefect_api, monkeypatch):
    from flows.set_params import apply_param_overrides

    (ws / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    apply_param_overrides({**TINY, "realm.refresh_mode": "async", "realm.train.max_steps": 4}, path=str(ws / "params.yaml"))
    env = {**os.environ, "PREFECT_API_URL": shared_prefect_api, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "flows.pretrain_realm"], cwd=ws, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    c = mlflow_client()
    exp = c.get_experiment_by_name("retro-realm")
    runs = c.search_runs([exp.experiment_id], filter_string="attributes.run_name = 'pretrain_realm@refreshed'",
                         order_by=["attributes.start_time DESC"], max_results=1)
    assert runs and runs[0].info.status == "FINISHED"
    run_id, parent_flow = runs[0].info.run_id, runs[0].data.tags["prefect.flow_run_id"]
    assert {"retriever", "knowledge_augmented_encoder", "index_final", "model_card.md"} <= {a.path for a in c.list_artifacts(run_id)}
    assert c.get_run(run_id).data.metrics["refreshes"] >= 1  # the flow logs the stage summary
    kids = refresh_children(run_id)
    assert kids and all(k.data.tags.get("prefect.flow_run_id") for k in kids)

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    monkeypatch.setenv("PREFECT_API_URL", shared_prefect_api)
    sub_ids = [k.data.tags["prefect.flow_run_id"] for k in kids]
    with get_client(sync_client=True) as client:
        subs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=sub_ids)))
        assert len(subs) == len(kids)
        for fr in subs:
            assert client.read_flow(fr.flow_id).name == "refresh_index"
            assert fr.state.is_completed() and fr.parent_task_run_id is not None
            assert str(client.read_task_run(fr.parent_task_run_id).flow_run_id) == parent_flow  # a true subflow of the stage flow
    assert BlockIndex.load(ws / "models/realm/index/final").step == 4


@pytest.mark.slow
def test_torchrun_two_ranks_build_alike_and_only_rank0_publishes(ws):
    """compute.nproc=2 under torchrun (gloo): each refresh is sharded over the two ranks (each embeds
    half, all-gather, both build the same index), rank 0 alone publishes and writes the outputs, so
    versions are 1..n with no gaps or doubles."""
    from components.training.distributed import torchrun_command
    from flows.set_params import apply_param_overrides

    (ws / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    overrides = {**TINY, "compute.nproc": 2, "realm.refresh_mode": "sync", "realm.retriever_init": "retromae", "realm.train.max_steps": 4}
    apply_param_overrides(overrides, path=str(ws / "params.yaml"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RR_PARAMS": "params.yaml", "RR_STAGE_ITEM": "refreshed"}
    out = subprocess.run(torchrun_command("components.stages.pretrain_realm", [], nproc=2), cwd=ws, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    summary = json.loads((ws / "metrics/pretrain_realm.json").read_text())
    assert summary["step"] == 4 and summary["refreshes"] == 2
    assert [(int(r["step"]), int(r["version"])) for r in plot_rows()] == [(0, 1), (2, 2), (4, 3)]
    root = checkpoint_root(tiny_params(**overrides)) / "index"
    assert IndexStore(root).versions() == [1, 2, 3]  # pruning keeps first + last two; no second publisher
    assert BlockIndex.load(ws / "models/realm/index/final").step == 4
    assert (ws / paths.REALM_OUT / paths.ICT_RETRIEVER / "retriever_config.json").exists()  # rank 0 kept ICT's retriever
