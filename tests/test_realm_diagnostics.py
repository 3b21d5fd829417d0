"""The REALM diagnostic (components/eval/realm_diagnostics.py, experiments/realm_diagnostic.py) on a
tiny workspace that ran the real `pretrain_realm` stage body: its gradients are real gradients, r(z)
is the gradient of log p(y|x) w.r.t. the retrieval scores, its outputs have the right shapes and
ranges (no thresholds on results), and the script runs end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import components.eval.realm_diagnostics as D
import components.eval.realm_reading as R
from components.data.special_tokens import MISSING_ROW, NULL_ROW
from tests.conftest import ROOT, TINY, tiny_params
from tests.test_realm_stage import world  # noqa: F401  (the module's tiny world: data/ + models/retromae)


@pytest.fixture(scope="module")
def trained(world, tmp_path_factory) -> Path:  # noqa: F811
    """A workspace that ran `pretrain_realm@refreshed` (the real stage body, no MLflow run), with its params.yaml."""
    from components.stages.pretrain_realm import train_realm
    from flows.set_params import apply_param_overrides

    root = tmp_path_factory.mktemp("realm_diag_ws")
    (root / "models").mkdir()
    os.symlink(world / "data", root / "data")
    os.symlink(world / "models/retromae", root / "models/retromae")
    (root / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    apply_param_overrides(TINY, path=str(root / "params.yaml"))
    cwd = os.getcwd()
    os.chdir(root)
    try:
        train_realm(tiny_params(), None)
    finally:
        os.chdir(cwd)
    return root


@pytest.fixture(scope="module")
def ws(trained) -> D.RealmWorkspace:
    return D.load_workspace(trained)


def _query_grads(loss: torch.Tensor, params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The reference: .grad after a plain backward()."""
    for p in params:
        p.grad = None
    loss.backward()
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in params])


# ----------------------------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------------------------
def test_contrastive_gradient_is_real_cosine_one_with_itself_and_below_one_across_batches(ws):
    batches = D.supervised_batches(ws, 2, 4, seed=0)
    assert len(batches) == 2 and batches[0]["q_input_ids"].shape[0] == 4
    r = ws.model.retriever
    g0 = D.contrastive_gradient(r, batches[0])
    assert g0.numel() == sum(p.numel() for p in D.query_tower_params(r)) and float(g0.norm()) > 0
    assert D.cosine(g0, D.contrastive_gradient(r, batches[0])) == pytest.approx(1.0, abs=1e-6)  # same batch twice
    assert abs(D.cosine(g0, D.contrastive_gradient(r, batches[1]))) < 1.0  # another batch
    # the vector is autograd's gradient: the .grad a backward() leaves
    from components.models.ict import ICTModel

    want = _query_grads(ICTModel(r)(batches[0])["loss"], D.query_tower_params(r))
    torch.testing.assert_close(g0, want, rtol=1e-5, atol=1e-8)


def test_realm_gradient_is_the_marginal_likelihood_gradient_and_leaves_the_reader_trainable(ws):
    qs = D.sample_queries(ws.blocks, ws.params.realm, ws.special, 8, seed=0)
    b0, b1 = (ws.collator.batch(qs[i:i + 4], ws.index.search, ws.model.retriever) for i in (0, 4))
    g0 = D.realm_gradient(ws.model, b0)
    assert float(g0.abs().sum()) > 0
    assert all(p.requires_grad for p in ws.model.knowledge_augmented_encoder.parameters())
    assert D.cosine(g0, D.realm_gradient(ws.model, b0)) == pytest.approx(1.0, abs=1e-6)
    assert abs(D.cosine(g0, D.realm_gradient(ws.model, b1))) < 1.0
    want = _query_grads(ws.model(b0)["loss"], D.query_tower_params(ws.model.retriever))
    torch.testing.assert_close(g0, want, rtol=1e-4, atol=1e-10)
    ws.model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("marginalization", ["per_token", "per_sequence"])
def test_utility_is_the_gradient_of_log_p_y_given_x_wrt_the_scores(marginalization):
    torch.manual_seed(0)
    B, K = 3, 4
    mask_batch = torch.tensor([0, 0, 1, 2, 2, 2])  # tokens per query: 2, 1, 3
    log_py = torch.log_softmax(torch.randn(6, 7), -1)[:, :K]  # (M, K) some log-probabilities
    scores = torch.randn(B, K, requires_grad=True)
    log_pz = torch.log_softmax(scores, -1)
    if marginalization == "per_token":  # the loss REALM trains: each token marginalised on its own, mean per query
        log_pyx = torch.logsumexp(log_py + log_pz[mask_batch], 1)
        obj = torch.zeros(B).index_add(0, mask_batch, log_pyx) / torch.bincount(mask_batch).float()
    else:
        obj = torch.logsumexp(R.per_query(log_py, mask_batch, B) + log_pz, 1)
    (grad,) = torch.autograd.grad(obj.sum(), scores)
    r = D.utility(log_py, log_pz.detach(), mask_batch, marginalization)
    assert r.shape == (B, K)
    torch.testing.assert_close(r, grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r.sum(-1), torch.zeros(B), atol=1e-6, rtol=0)  # sums to 0 over z


def test_reader_path_gives_realms_loss(ws):
    qs = D.sample_queries(ws.blocks, ws.params.realm, ws.special, 4, seed=1)
    batch = ws.collator.batch(qs, ws.index.search, ws.model.retriever)
    with torch.no_grad():
        log_py, correct, mb = R.reader_log_probs(ws.model.knowledge_augmented_encoder, batch)
        log_pz = ws.model.retrieval_log_probs(batch)
        loss = ws.model(batch)["loss"]
    assert log_py.shape == correct.shape == (mb.numel(), batch["z_input_ids"].shape[1])
    torch.testing.assert_close(-torch.logsumexp(log_py + log_pz[mb], 1).mean(), loss, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# documents, shapes and ranges
# ----------------------------------------------------------------------------------------------
def test_fixed_documents_own_answer_and_other_blocks(ws):
    from components.eval.realm_probes import answer_blocks

    qs = D.sample_queries(ws.blocks, ws.params.realm, ws.special, 24, seed=0)
    ans = answer_blocks(qs, ws.blocks)
    titles = list(ws.blocks["title"])
    article = [[r for r, t in enumerate(titles) if t == titles[q.source_row]] for q in qs]
    rows = R.fixed_documents(qs, ans, [set()] * len(qs), len(ws.blocks), np.random.default_rng(0), article)
    assert rows.shape == (len(qs), len(R.SLOTS)) and (rows[:, 0] == NULL_ROW).all()
    assert any(ans) and not all(ans)  # the tiny world has both kinds
    for q, a, same, (_, own, answer, other, in_article) in zip(qs, ans, article, rows):
        assert own == q.source_row
        assert (answer in a) if a else answer == MISSING_ROW
        assert other not in a and other != q.source_row and other >= 0
        left = set(same) - a - {q.source_row}  # x's article's other blocks without the span
        assert (in_article in left) if left else in_article == MISSING_ROW
    assert (rows[:, 4] >= 0).any()


def test_run_diagnostic_shapes_and_ranges(ws):
    out = D.run_diagnostic(ws, n_queries=16, batch_size=4, seed=0)
    assert out["n_queries"] == 16 and out["batch_size"] == 4
    rd, rt, gr = out["reader"], out["retrieval"], out["gradient"]
    for s in ("null", "own_block", "answer_block"):
        assert 0.0 <= rd[f"acc_{s}"] <= 1.0 and rd[f"tokens_{s}"] > 0
    assert rd["tokens_null"] == rd["tokens_own_block"] >= rd["tokens_answer_block"]  # every query has x's block
    assert rd["gap_nats"]["n"] == rd["gap_nats_per_token"]["n"] <= rd["queries_with_answer_block"]
    assert rd["gap_nats_same_article"]["n"] <= rd["queries_with_answer_block"]
    assert rt["entropy"]["n"] == 16 and 0.0 <= rt["entropy"]["mean"] <= rt["log_k"] + 1e-5 <= math.log(out["top_k"]) + 2e-5
    assert 0.0 <= rt["p_null"]["mean"] <= 1.0 and 0.0 <= rt["share_with_answer_candidate"] <= 1.0
    assert rt["utility"]["null"]["n"] == 16
    groups = set(rt["utility"]) - {"null"}  # the tiny world's blocks have titles: split by article
    assert groups and groups <= {f"{a}_{s}_article" for a in ("answer", "no_answer") for s in ("same", "other")}
    assert sum(v["n"] for v in rt["utility"].values()) <= 16 * out["top_k"]
    for v in rt["utility"].values():
        assert -1.0 <= v["mean"] <= 1.0  # |r(z)| <= 1: p(z|x) p(y|x,z) / p(y|x) <= 1
    assert -1.0 <= gr["realm_batch_cosine"]["mean"] <= 1.0
    assert gr["realm_batches"] == 4 and gr["ict_batches"] == 4 and gr["supervised_batches"] >= 2
    for ref in ("realm", "ict"):
        assert -1.0 <= gr[f"{ref}_vs_supervised_mean_cosine"] <= 1.0
    for name in ("realm", "supervised", "ict"):
        assert gr[f"{name}_grad_norm"]["mean"] > 0 and gr[f"{name}_batch_cosine"]["n"] == gr[f"{name}_batches"] - 1
    assert json.loads(json.dumps(out)) == out  # plain JSON


def test_missing_workspace_names_the_stage(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"dvc repro tokenize"):
        D.load_workspace(tmp_path)


def test_at_start_measures_the_retriever_realm_started_from_with_the_index_built_from_it(trained, ws):
    """`at="start"`: ICT's retriever (models/realm/ict_retriever, REALM's start) and index/first, which the
    stage built from it at step 0; the reader is the saved one. The final workspace differs from it."""
    from components.data.realm_batch import passage_batch, passage_columns
    from components.models.retriever import Retriever

    start = D.load_workspace(trained, at="start")
    ict = Retriever.from_pretrained(trained / "models/realm/ict_retriever")
    for (k, a), b in zip(start.model.retriever.state_dict().items(), ict.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    for a, b in zip(start.model.knowledge_augmented_encoder.state_dict().values(),
                    ws.model.knowledge_augmented_encoder.state_dict().values()):
        assert torch.equal(a, b)
    p = start.params.realm
    rows = [{c: start.blocks[i][c] for c in passage_columns(p)} for i in range(len(start.blocks))]
    with torch.no_grad():
        vectors = start.model.retriever.encode_passage(**passage_batch(rows, p, start.special)).numpy()  # (N, d)
    np.testing.assert_allclose(start.index.embeddings(), vectors, rtol=1e-4, atol=1e-4)  # index/first: the start's vectors
    assert start.index.step < ws.index.step
    assert any(not torch.equal(a, b) for a, b in zip(start.model.retriever.state_dict().values(),
                                                     ws.model.retriever.state_dict().values()))  # REALM moved it


def test_at_start_needs_ict_and_says_so(trained, tmp_path):
    ws_dir = tmp_path / "no_ict"
    (ws_dir / "models/realm").mkdir(parents=True)
    for name in ("data", "params.yaml"):
        os.symlink(trained / name, ws_dir / name)
    for item in (trained / "models/realm").iterdir():
        if item.name != "ict_retriever":
            os.symlink(item, ws_dir / "models/realm" / item.name)
    D.load_workspace(ws_dir)  # the final retriever needs no ICT
    with pytest.raises(FileNotFoundError, match=r"ict_retriever is missing.*realm.ict_steps > 0"):
        D.load_workspace(ws_dir, at="start")
    with pytest.raises(ValueError, match="at must be one of"):
        D.load_workspace(ws_dir, at="middle")


# ----------------------------------------------------------------------------------------------
# the script
# ----------------------------------------------------------------------------------------------
def test_script_runs_end_to_end_and_writes_its_json_atomically(trained, tmp_path):
    out = tmp_path / "diag" / "realm_diagnostic.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "experiments.realm_diagnostic", "--workspace", str(trained), "--queries", "16",
                          "--batch-size", "4", "--seed", "1", "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["arm"] == "refreshed" and result["seed"] == 1 and result["n_queries"] == 16
    assert {"reader", "retrieval", "gradient"} <= set(result)
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temp file left beside it
    assert "realm_batch_cosine" in run.stdout and f"wrote {out}" in run.stdout

    bad = subprocess.run([sys.executable, "-m", "experiments.realm_diagnostic", "--workspace", str(tmp_path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "dvc repro" in bad.stderr


def test_script_spans_reads_the_corpus_only(trained, tmp_path):
    """`--spans`: the corpus part from params.yaml and data/tokens alone (a workspace with no model yet)."""
    import datasets

    from experiments.realm_diagnostic import main

    ws_dir = tmp_path / "tokens_only"
    ws_dir.mkdir()
    for name in ("data", "params.yaml"):
        os.symlink(trained / name, ws_dir / name)
    result = main(["--spans", "--workspace", str(ws_dir)])
    out = ws_dir / "metrics" / "realm_span_holders.json"
    assert json.loads(out.read_text()) == result
    assert result["pairs"] > 0 and sum(result["other_blocks"].values()) == pytest.approx(1.0)
    assert result["blocks_with_a_span"] <= result["blocks"] == len(datasets.load_from_disk(str(trained / "data/tokens/blocks")))
    with pytest.raises(FileNotFoundError, match=r"data/tokens/blocks is missing: run `dvc repro tokenize`"):
        main(["--spans", "--workspace", str(tmp_path / "empty")])


# ----------------------------------------------------------------------------------------------
# the reader warm-up study (experiments/reader_warmup_study.py)
# ----------------------------------------------------------------------------------------------
def test_reader_warmup_study_trains_only_the_warmup_and_reads_the_heldout_queries(trained, tmp_path):
    from experiments.reader_warmup_study import main

    out = tmp_path / "study.jsonl"
    argv = ["--workspace", str(trained), "--out", str(out), "--queries", "8",
            "--variant", "none:realm.reader_warmup_steps=0", "--variant", "copy:realm.reader_warmup_steps=3,"
            "realm.reader_warmup_doc=own_block,realm.reader_warmup_doc_len=16,realm.reader_warmup_mask_ratio=0.2"]
    rows = main(argv)
    assert [r["variant"] for r in rows] == ["none", "copy"]
    none, copy = rows
    assert none["before"] == none["after"] and none["warmup"] == {}  # no warm-up: the same reader read twice
    assert copy["warmup"]["reader_warmup_steps"] == 3 and len(copy["curve"]) >= 1
    assert copy["before"] == none["before"]  # the same seeded init and the same held-out queries
    for r in rows:
        for side in ("before", "after"):
            rep = r[side]
            assert 0 < rep["queries"] <= 8 and rep["tokens_own_block"] == rep["tokens_null"] > 0
            assert all(0.0 <= rep[f"acc_{s}"] <= 1.0 for s in ("null", "own_block"))
    assert main(argv) == rows  # rerun: both variants are in the file already, nothing retrained
    assert [json.loads(line)["variant"] for line in out.read_text().splitlines()] == ["none", "copy"]


def test_variant_specs_parse_and_refuse_with_the_item_named():
    from experiments.variants import parse_variant

    assert parse_variant("base:") == ("base", {})
    assert parse_variant("v:realm.top_k=8,realm.query_tower=live,realm.x=") == (
        "v", {"realm.top_k": 8, "realm.query_tower": "live", "realm.x": None})
    with pytest.raises(ValueError, match="expected NAME:key=value"):
        parse_variant("base")
    with pytest.raises(ValueError, match="'realm.top_k' is not"):
        parse_variant("v:realm.top_k")
    with pytest.raises(ValueError, match=r"with a key finetune\.\*"):
        parse_variant("v:realm.top_k=8", prefix="finetune.")
    assert parse_variant("v:compute.seed=2", prefix=("finetune.", "compute.seed")) == ("v", {"compute.seed": 2})
    with pytest.raises(ValueError, match=r"with a key finetune\.\* or compute\.seed\*"):
        parse_variant("v:compute.precision=fp32,", prefix=("finetune.", "compute.seed"))
