"""The eval table asks each paper's own question (issue 14, item 3), pinned without thresholds:

- each `ft:*` row fine-tunes from the encoder it names, with the same data order;
- each open-QA system trains its own reader and gives per-question predictions;
- every comparison's delta and p-value are `paired_test` on the two systems' per-query files;
- `evaluate.split: dev` reports the dev questions; the first line names the split (and the smoke test);
- the warm-start reference row pools as its sentence-transformers folder says.

One tiny world per module: data, three distinct random encoders (init / mlm / retromae, so a
mix-up of start folders shows), a tiny REALM run, then `finetune` and `evaluate` (~15 s on 2 cores).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch

from components import paths
from components.eval.comparisons import per_query_path, read_per_query, run_comparisons, Comparison
from components.eval.significance import paired_test, per_query_metric
from tests.conftest import build_data_and_encoders, tiny_params


def _save_random_encoder(p, tok, folder: Path, seed: int) -> None:
    from components.models.encoder import build_encoder, save_encoder

    torch.manual_seed(seed)
    enc = build_encoder(p.retromae.encoder, len(tok), tok.pad_token_id, cls_token_id=tok.cls_token_id,
                        sep_token_id=tok.sep_token_id, mask_token_id=tok.mask_token_id)
    save_encoder(enc, tok, folder)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A workspace after pretrain_realm, finetune and evaluate (test split)."""
    from components.data.tokenize import load_tokenizer
    from components.stages.evaluate import evaluate
    from components.stages.finetune import finetune
    from components.stages.pretrain_realm import train_realm

    root = tmp_path_factory.mktemp("eval_table")
    saved = {k: os.environ.pop(k, None) for k in ("RR_PARENT_RUN_ID", "MLFLOW_RUN_ID")}
    with contextlib.chdir(root):
        p = tiny_params(**{"finetune.qa_gold_steps": 2})
        build_data_and_encoders(Path("."), p, ("retromae/encoder",))
        tok = load_tokenizer(paths.TOKENS / "tokenizer")
        _save_random_encoder(p, tok, paths.INIT_ENCODER, 1)
        _save_random_encoder(p, tok, paths.MLM_ENCODER, 2)
        train_realm(p, None, log_artifacts=False)
        summary = finetune(p)
        out = evaluate(p)
    os.environ.update({k: v for k, v in saved.items() if v is not None})
    return {"root": root, "params": p, "finetune": summary, "eval": out}


# ----------------------------------------------------------------------------------------------
# RetroMAE's question: one recipe from each start
# ----------------------------------------------------------------------------------------------
def test_each_ft_row_fine_tunes_from_the_encoder_it_names(world):
    from components.models.biencoder import weights_digest
    from components.models.encoder import load_encoder

    root, s = world["root"], world["finetune"]
    folders = {"init": paths.INIT_ENCODER, "mlm": paths.MLM_ENCODER, "retromae": paths.RETROMAE_ENCODER,
               "realm": paths.REALM_OUT / "retriever" / "query_encoder"}
    assert s["retrieval_inits"] == "init,mlm,retromae,realm"
    digests = {}
    for name, folder in folders.items():
        assert s[f"retrieval.{name}.start"] == str(folder)
        digests[name] = weights_digest(load_encoder(root / folder))
        assert s[f"retrieval.{name}.start_sha256"] == digests[name], name  # the weights the trainer was handed
        assert (root / paths.FINETUNE_RETRIEVERS / name / "config.json").exists()
        assert s[f"retrieval.{name}.steps"] == world["params"].finetune.train.max_steps
    assert len(set(digests.values())) == 4  # four different starts: a mix-up would show
    systems = [r["system"] for r in world["eval"]["rows"]]
    assert [x for x in systems if x.startswith("ft:")] == ["ft:init", "ft:mlm", "ft:retromae", "ft:realm"]
    assert {"bm25", "init", "retromae", "mlm", "realm", "realm-stale"} <= set(systems)


def test_every_start_sees_the_same_batches(world, monkeypatch):
    """Same recipe: the trainer draws the same questions and negatives in the same order for each start."""
    from components.data.finetune_data import BiEncoderCollator
    from components.data.tokenize import load_tokenizer
    from components.stages import finetune as stage

    seen: list[list[tuple]] = []
    real_call = BiEncoderCollator.__call__

    def spy(self, rows, generator=None):
        batch = real_call(self, rows, generator)
        seen.append((tuple(r["qid"] for r in rows), tuple(batch["passage_keys"].tolist())))
        return batch

    monkeypatch.setattr(BiEncoderCollator, "__call__", spy)
    monkeypatch.chdir(world["root"])
    p = tiny_params(**{"finetune.train.max_steps": 3, "finetune.retrieval_inits": ["init", "retromae", "realm"]})
    monkeypatch.setattr(stage, "RETRIEVER_OUT", world["root"] / "ft_order_check")
    stage.finetune_retrievers(p, None, load_tokenizer(paths.TOKENS / "tokenizer"))
    assert len(seen) == 9, len(seen)
    assert seen[0:3] == seen[3:6] == seen[6:9]


def test_missing_start_is_skipped_and_none_is_an_error(world, monkeypatch, tmp_path):
    from components.stages import finetune as stage

    monkeypatch.chdir(world["root"])
    monkeypatch.setitem(stage.START_FOLDERS, "mlm", tmp_path / "nothing")
    p = tiny_params(**{"finetune.retrieval_inits": ["mlm"]})
    with pytest.raises(FileNotFoundError, match="finetune.retrieval_inits"):
        stage.finetune_retrievers(p, None, None)


# ----------------------------------------------------------------------------------------------
# REALM's question: four open-QA systems, one reader recipe
# ----------------------------------------------------------------------------------------------
def test_each_qa_system_trains_its_reader_and_answers_every_question(world):
    from components.data.beir import read_qa

    root, s = world["root"], world["finetune"]
    assert s["qa_systems"] == "bm25,realm,realm-stale"  # closed-book has nothing to train
    for system in ("bm25", "realm", "realm-stale"):
        assert (root / paths.FINETUNE_OPEN_QA / system / "openqa_config.json").exists()
        assert s[f"qa.{system}.steps"] == world["params"].finetune.qa_train.max_steps
    cfg = json.loads((root / paths.FINETUNE_OPEN_QA / "bm25" / "openqa_config.json").read_text())
    assert cfg["retriever_type"] is None  # BM25: no dense query tower, uniform p(z|x)
    test_ids = {r["id"] for r in read_qa(root / paths.CORPUS / "qa/test.jsonl")}
    rows = {r["system"]: r for r in world["eval"]["rows"] if r["system"].startswith("qa:")}
    assert list(rows) == ["qa:closed-book", "qa:bm25", "qa:realm", "qa:realm-stale"]
    for system, row in rows.items():
        per_q = [json.loads(x) for x in per_query_path(root / paths.METRICS / "eval", "main", system).read_text().splitlines()]
        assert {r["qid"] for r in per_q} == test_ids and all("prediction" in r for r in per_q)
        assert row["em"] == pytest.approx(sum(r["em"] for r in per_q) / len(per_q))
        assert row["f1"] == pytest.approx(sum(r["f1"] for r in per_q) / len(per_q))
    closed = per_query_path(root / paths.METRICS / "eval", "main", "qa:closed-book").read_text().splitlines()
    assert all(json.loads(x)["prediction"] == "" for x in closed)  # the extractive floor


def test_gold_phase_reads_each_question_own_paragraph_block():
    """The reader's own-paragraph phase: the first block of `positive_ctx` that holds an answer."""
    from components.retrieval.search import gold_qa_blocks

    qa = [{"id": "a", "question": "q", "answers": ["Paris"], "positive_ctx": "d1"},
          {"id": "b", "question": "q", "answers": ["Rome"], "positive_ctx": "d1"},   # not in its paragraph
          {"id": "c", "question": "q", "answers": ["the Alps"], "positive_ctx": "d2"},
          {"id": "d", "question": "q", "answers": ["Paris"]}]                        # no positive_ctx
    doc_ids = ["d0", "d1", "d1", "d2"]
    texts = ["Paris in d0.", "d1 part one.", "d1 part two: PARIS.", "Alps."]
    assert [(r["id"], r["block_rows"]) for r in gold_qa_blocks(qa, doc_ids, texts)] == [("a", [2]), ("c", [3])]


def test_every_system_reader_starts_from_the_one_gold_phase(world, monkeypatch):
    """finetune.qa_gold_steps: the phase runs once, and each system's reader starts from its weights."""
    import datasets

    from components.data.finetune_data import load_qa
    from components.data.tokenize import load_tokenizer
    from components.stages import finetune as ft_stage

    s = world["finetune"]
    assert s["qa.gold.steps"] == 2 and 0 < s["qa.gold.questions"] <= s["qa_questions"]
    starts: dict[str, dict] = {}
    real_trainer = ft_stage.Trainer

    def spy(model, *args, **kw):
        name = "gold" if kw["param_prefix"] == "finetune.qa_gold" else f"system{len(starts)}"
        starts[name] = {k: v.clone() for k, v in model.reader.state_dict().items()}
        return real_trainer(model, *args, **kw)

    monkeypatch.setattr(ft_stage, "Trainer", spy)
    with contextlib.chdir(world["root"]):
        tok = load_tokenizer(paths.TOKENS / "tokenizer")
        blocks = datasets.load_from_disk(str(paths.TOKENS / "blocks"))
        gold_state, _ = ft_stage.gold_reader(world["params"], None, tok, blocks, load_qa(paths.CORPUS, "train"))
        ft_stage.finetune_readers(world["params"], None, tok)
    systems = [k for k in starts if k.startswith("system")]
    assert len(systems) == 3 and "gold" in starts
    for name in systems:  # the systems' trainers start from the trained gold reader, not from its init
        assert all(torch.equal(starts[name][k], gold_state[k]) for k in gold_state)
    assert not all(torch.equal(starts["gold"][k], gold_state[k]) for k in gold_state)  # the phase trained


def test_bm25_reader_scores_blocks_uniformly():
    """A system without a query tower: p(z|x) uniform over the top k, whatever the batch holds."""
    from components.models.reader import OpenQA

    model = OpenQA(None, reader=torch.nn.Identity(), max_answer_tokens=2)  # the reader is not called here
    cand = torch.tensor([[True, True, True, False]])
    log_pz = model.retrieval_log_probs({"candidate_mask": cand, "block_embeddings": torch.randn(1, 4, 8)})
    assert torch.allclose(log_pz[0, :3].exp(), torch.full((3,), 1 / 3))


# ----------------------------------------------------------------------------------------------
# significance: computed from the per-query files
# ----------------------------------------------------------------------------------------------
def test_every_comparison_is_the_paired_test_of_its_per_query_files(world):
    out_dir = world["root"] / paths.METRICS / "eval"
    comps = world["eval"]["comparisons"]
    pairs = {(c["a"], c["b"]) for c in comps}
    assert pairs == {("ft:retromae", "ft:mlm"), ("ft:retromae", "ft:init"), ("retromae", "mlm"), ("retromae", "init"),
                     ("realm", "realm-stale"), ("realm", "retromae"), ("qa:realm", "qa:closed-book"),
                     ("qa:realm", "qa:realm-stale"), ("qa:realm", "qa:bm25")}
    for c in comps:
        a = per_query_metric(read_per_query(per_query_path(out_dir, c["dataset"], c["a"])), c["metric"])
        b = per_query_metric(read_per_query(per_query_path(out_dir, c["dataset"], c["b"])), c["metric"])
        r = paired_test(a, b)
        assert (c["delta"], c["p_value"], c["n"]) == (r.delta, r.p_value, r.n), c
    saved = json.loads((world["root"] / paths.METRICS / "eval.json").read_text())
    assert saved["comparisons"] == json.loads(json.dumps(comps)) and saved["split"] == "test"
    report = (out_dir / "results.md").read_text()
    assert "Paired comparisons" in report and "| ft:retromae | ft:mlm | main | nDCG@10 |" in report
    assert (out_dir / "comparisons.csv").read_text().count("\n") == len(comps) + 1


def test_comparison_reads_two_systems_per_query_files(tmp_path):
    """Fed two hand-written per-query files, the comparison's p-value is paired_test on them."""
    a = {f"q{i}": {"ndcg_at_10": 0.1 * i} for i in range(20)}
    b = {f"q{i}": {"ndcg_at_10": 0.1 * i - (0.05 if i % 3 else -0.02)} for i in range(20)}
    for name, scores in (("ft:x", a), ("y", b)):
        path = per_query_path(tmp_path, "set", name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"qid": q, **v}) + "\n" for q, v in scores.items()))
    (res,) = run_comparisons(tmp_path, "set", [Comparison("ft:x", "y", ("ndcg_at_10", "recall_at_20"), "?"),
                                                Comparison("ft:x", "missing", ("ndcg_at_10",), "?")])
    expect = paired_test({q: v["ndcg_at_10"] for q, v in a.items()}, {q: v["ndcg_at_10"] for q, v in b.items()})
    assert (res["delta"], res["p_value"], res["n"]) == (expect.delta, expect.p_value, 20)
    assert (tmp_path / "set" / "ft_x.jsonl").exists()  # `:` is not in the file name


def test_flow_logs_the_comparisons_as_metrics(world):
    from flows.evaluate import _metrics

    m = _metrics(world["eval"])
    c = world["eval"]["comparisons"][0]
    assert m[f"cmp.main.{c['a']} vs {c['b']}.{c['metric']}.p_value"] == c["p_value"]
    assert "main.ft:retromae.ndcg_at_10" in m


# ----------------------------------------------------------------------------------------------
# evaluate.split and the first line
# ----------------------------------------------------------------------------------------------
def test_split_dev_reads_the_dev_questions(world, monkeypatch):
    from components.data.beir import read_qa, read_qrels, read_queries
    from components.stages.evaluate import evaluate

    root = world["root"]
    monkeypatch.chdir(root)
    monkeypatch.setattr("components.stages.evaluate.METRICS", root / "metrics_dev")
    monkeypatch.setattr("components.stages.evaluate.PLOTS", root / "plots_dev")
    out = evaluate(tiny_params(**{"evaluate.split": "dev"}))
    queries = read_queries(root / paths.CORPUS / "beir/queries.jsonl")
    dev = {q for q, rels in read_qrels(root / paths.CORPUS / "beir/qrels/dev.tsv", known_queries=queries).items()
           if any(v > 0 for v in rels.values())}
    assert dev and not dev & {r["qid"] for r in map(json.loads, (root / paths.METRICS / "eval/main/bm25.jsonl").read_text().splitlines())}
    got = {r["qid"] for r in map(json.loads, (root / "metrics_dev/eval/main/bm25.jsonl").read_text().splitlines())}
    assert got == dev
    dev_qa = {r["id"] for r in read_qa(root / paths.CORPUS / "qa/dev.jsonl")}
    got_qa = {r["qid"] for r in map(json.loads, (root / "metrics_dev/eval/main/qa_realm.jsonl").read_text().splitlines())}
    assert got_qa == dev_qa
    first = (root / "metrics_dev/eval/results.md").read_text().splitlines()[0]
    assert "evaluate.split: dev" in first and out["report"].splitlines()[0] == first


def test_first_line_says_smoke_test_only_without_a_warm_start(tmp_path):
    from components.stages.evaluate import title_line

    tiny = title_line(tiny_params())
    assert tiny.startswith("tiny preset: a smoke test on a synthetic world") and tiny.endswith("evaluate.split: test")
    warm = title_line(tiny_params(**{"warm_start.path": str(tmp_path)}))
    assert "smoke test" not in warm and warm == "evaluate.split: test"
    assert title_line(tiny_params(**{"evaluate.banner": "", "evaluate.split": "dev"})) == "evaluate.split: dev"
    assert title_line(tiny_params(**{"evaluate.banner": "custom"})) == "custom | evaluate.split: test"


# ----------------------------------------------------------------------------------------------
# the off-the-shelf reference row
# ----------------------------------------------------------------------------------------------
def test_warm_start_row_pools_in_its_own_mode(world, tmp_path):
    """A sentence-transformers folder (mean pooling + Normalize) is scored with mean-pooled,
    normalised vectors and its own tokenizer; the row is named after the pooling."""
    import datasets
    from transformers import BertConfig, BertModel

    from components.data.tokenize import load_tokenizer
    from components.stages.evaluate import _warm_start_system

    root = world["root"]
    tok = load_tokenizer(root / paths.TOKENS / "tokenizer")
    folder = tmp_path / "st"
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32), add_pooling_layer=False).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                                                     {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                                                     {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling/config.json").write_text(json.dumps({"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    blocks = datasets.load_from_disk(str(root / paths.TOKENS / "blocks"))
    name, enc, own_tok, own_blocks = _warm_start_system(tiny_params(**{"warm_start.path": str(folder)}), blocks)
    assert name == "warm-start:mean" and len(own_blocks["input_ids"]) == len(blocks)
    ids = torch.tensor([[tok.cls_token_id, 7, 8, tok.sep_token_id, tok.pad_token_id]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state[0, :4]  # (4, H) real tokens
    expect = torch.nn.functional.normalize(hidden.mean(0), dim=0)
    assert torch.allclose(enc(ids, mask)[0], expect, atol=1e-5)
    assert _warm_start_system(tiny_params(), blocks) is None  # no warm start, no row
