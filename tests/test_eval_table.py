"""The eval table asks each paper's own question (issue 14, item 3), pinned without thresholds:

- each `ft:*` row fine-tunes from the encoder it names, with the same data order;
- each open-QA system trains its own reader and gives per-question predictions;
- every comparison's delta and p-value are `paired_test` on the two systems' per-query files;
- `evaluate.split: dev` reports the dev questions; the first line names the split (and the smoke test);
- the warm-start reference row pools as its sentence-transformers folder says.

One tiny world per module: data, three distinct random encoders (init / mlm / retromae, so a
mix-up of start folders shows), both tiny REALM arms, then every `finetune_retriever@<start>-<size>`
(sizes 8 and all), every `finetune_reader@<system>` and `evaluate`, through the stage bodies.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
from pathlib import Path

import pytest
import torch

from components import paths
from components.config_stages import REALM_ARMS
from components.eval.comparisons import per_query_path, read_per_query, run_comparisons, Comparison
from components.eval.significance import paired_test, per_query_metric
from tests.conftest import build_data_and_encoders, tiny_params


def _save_random_encoder(p, tok, folder: Path, seed: int) -> None:
    from components.models.encoder import build_encoder, save_encoder

    torch.manual_seed(seed)
    enc = build_encoder(p.retromae.encoder, len(tok), tok.pad_token_id, cls_token_id=tok.cls_token_id,
                        sep_token_id=tok.sep_token_id, mask_token_id=tok.mask_token_id)
    save_encoder(enc, tok, folder)


def _save_sentence_transformers(tok, folder: Path):
    """A sentence-transformers folder (mean pooling + Normalize) over a tiny random BERT; returns the BERT."""
    from transformers import BertConfig, BertModel

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
    return model


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A workspace after pretrain_realm, finetune and evaluate (test split)."""
    from components.data.tokenize import load_tokenizer
    from components.stages.evaluate import evaluate
    from components.stages.finetune_reader import finetune_reader
    from components.stages.finetune_retriever import finetune_retriever
    from components.stages.pretrain_realm import train_realm

    root = tmp_path_factory.mktemp("eval_table")
    saved = {k: os.environ.pop(k, None) for k in ("RR_PARENT_RUN_ID", "MLFLOW_RUN_ID")}
    with contextlib.chdir(root):
        overrides = {"finetune.qa_gold_steps": 2, "finetune.train_sizes": [8, "all"]}
        p = tiny_params(**overrides)
        build_data_and_encoders(Path("."), p, ("retromae/encoder",))
        tok = load_tokenizer(paths.TOKENS / "tokenizer")
        _save_random_encoder(p, tok, paths.INIT_ENCODER, 1)
        _save_random_encoder(p, tok, paths.MLM_ENCODER, 2)
        _save_sentence_transformers(tok, root / "warm")
        realm = {arm: train_realm(p, None, arm=arm) for arm in REALM_ARMS}
        retrievers = {f"{s}-{n}": finetune_retriever(p, None, f"{s}-{n}") for s in p.finetune.retrieval_inits
                      for n in p.finetune.train_sizes}
        readers = {s: finetune_reader(p, None, s) for s in ("bm25", "realm", "realm-stale")}
        # evaluated with an off-the-shelf reference (a tiny sentence-transformers folder): the curve's flat line
        out = evaluate(tiny_params(**overrides, **{"warm_start.path": str(root / "warm")}))
    os.environ.update({k: v for k, v in saved.items() if v is not None})
    return {"root": root, "params": p, "realm": realm, "retrievers": retrievers, "readers": readers, "eval": out}


# ----------------------------------------------------------------------------------------------
# RetroMAE's question: one recipe from each start
# ----------------------------------------------------------------------------------------------
def test_each_ft_row_fine_tunes_from_the_encoder_it_names(world):
    from components.models.biencoder import weights_digest
    from components.models.encoder import load_encoder

    root = world["root"]
    folders = {"init": paths.INIT_ENCODER, "mlm": paths.MLM_ENCODER, "retromae": paths.RETROMAE_ENCODER,
               "realm": paths.REALM_OUT / "retriever" / "query_encoder"}
    digests = {}
    for name, folder in folders.items():
        digests[name] = weights_digest(load_encoder(root / folder))
        for size in (8, "all"):
            s = world["retrievers"][f"{name}-{size}"]
            assert s["start"] == str(folder) and s["size"] == str(size)
            assert s["start_sha256"] == digests[name], name  # the weights the trainer was handed
            assert (root / paths.retriever_out(name, size) / "config.json").exists()
            assert s["steps"] == world["params"].finetune.train.max_steps
            assert json.loads((root / paths.stage_metrics(f"finetune_retriever@{name}-{size}")).read_text())["steps"] == s["steps"]
    assert len(set(digests.values())) == 4  # four different starts: a mix-up would show
    systems = [r["system"] for r in world["eval"]["rows"]]
    # the largest size is the single-size ft:<start> row; the smaller ones are the curve's points
    assert [x for x in systems if x.startswith("ft:")] == ["ft:init", "ft:init@8", "ft:mlm", "ft:mlm@8", "ft:retromae",
                                                           "ft:retromae@8", "ft:realm", "ft:realm@8"]
    assert {"bm25", "init", "retromae", "mlm", "ict", "realm", "realm-stale"} <= set(systems)  # ict: realm.ict_steps > 0


# ----------------------------------------------------------------------------------------------
# RetroMAE's claim as a label-efficiency curve: plots/label_efficiency.csv, its PNG, per-size tests
# ----------------------------------------------------------------------------------------------
def _curve_csv(root: Path) -> list[dict]:
    return list(csv.DictReader((root / "plots/label_efficiency.csv").open()))


def test_curve_has_one_point_per_start_and_size_and_the_reference_at_each(world):
    from components.data.finetune_data import load_pairs

    root, p = world["root"], world["params"]
    n_train = len(load_pairs(root / paths.CORPUS, "train", with_answers=False))
    assert n_train > 8  # else the two sizes are one point
    points = _curve_csv(root)
    assert (root / paths.METRICS / "eval/label_efficiency.csv").read_text() == (root / "plots/label_efficiency.csv").read_text()
    rows = {r["system"]: r for r in world["eval"]["rows"]}
    ft = [r for r in points if r["kind"] == "fine-tuned"]
    assert sorted((r["start"], r["size"]) for r in ft) == sorted((s, str(n)) for s in p.finetune.retrieval_inits for n in (8, "all"))
    for start in p.finetune.retrieval_inits:
        line = [r for r in ft if r["start"] == start]
        assert [int(r["questions"]) for r in line] == [8, n_train]  # numeric, increasing; `all` is the count
        for r, name in zip(line, (f"ft:{start}@8", f"ft:{start}")):
            assert float(r["ndcg_at_10"]) == pytest.approx(rows[name]["ndcg_at_10"])
            assert float(r["recall_at_20"]) == pytest.approx(rows[name]["recall_at_20"])
    ref = [r for r in points if r["kind"] == "reference"]
    assert {r["start"] for r in ref} == {"warm-start:mean"}
    assert [int(r["questions"]) for r in ref] == [8, n_train]  # a flat line at every size
    assert [float(r["ndcg_at_10"]) for r in ref] == pytest.approx([rows["warm-start:mean"]["ndcg_at_10"]] * 2)
    png = (root / paths.METRICS / "eval/label_efficiency.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
    saved = json.loads((root / paths.METRICS / "eval.json").read_text())
    assert [(x["start"], x["size"], x["questions"]) for x in saved["label_efficiency"]] == \
        [(r["start"], r["size"], int(r["questions"])) for r in points]


def test_curve_without_a_reference_row_has_no_flat_line(world):
    from components.eval.curve import curve_points

    rows = [r for r in world["eval"]["rows"] if not r["system"].startswith("warm-start:")]
    points = curve_points(rows, world["params"].finetune, 100)
    assert points and all(x["kind"] == "fine-tuned" for x in points)
    assert {x["questions"] for x in points} == {8, 100}


def test_per_size_tests_are_the_paired_tests_and_in_the_report(world):
    """ft:retromae@N vs ft:mlm@N and vs ft:init@N at every size (the largest: the single-size rows),
    each the comparison run on the per-query files, in eval.json and in results.md."""
    root = world["root"]
    tests = world["eval"]["label_efficiency_tests"]
    comps = {(c["a"], c["b"], c["metric"]): c for c in world["eval"]["comparisons"]}
    expect = [(a, b, m) for a, b in (("ft:retromae@8", "ft:mlm@8"), ("ft:retromae@8", "ft:init@8"),
                                     ("ft:retromae", "ft:mlm"), ("ft:retromae", "ft:init"))
              for m in ("ndcg_at_10", "recall_at_20")]
    assert [(t["a"], t["b"], t["metric"]) for t in tests] == expect
    assert [t["size"] for t in tests] == ["8"] * 4 + ["all"] * 4
    for t in tests:
        c = comps[(t["a"], t["b"], t["metric"])]
        assert (t["delta"], t["p_value"], t["n"]) == (c["delta"], c["p_value"], c["n"])
        assert 0 <= t["p_value"] <= 1 and t["n"] > 0
    assert json.loads((root / paths.METRICS / "eval.json").read_text())["label_efficiency_tests"] == json.loads(json.dumps(tests))
    report = (root / paths.METRICS / "eval/results.md").read_text()
    assert "Label efficiency" in report and "| main | 8 | 8 | ft:retromae@8 | ft:mlm@8 |" in report
    assert "| main | all |" in report and "ft:retromae@8" in (root / paths.METRICS / "eval/results.html").read_text()


def test_the_dvc_template_draws_the_curve_csv(world):
    """dvc.yaml's `label_efficiency` plot, filled by DVC's own renderer from the CSV evaluate wrote."""
    import yaml
    from dvc_render.vega import VegaRenderer

    from tests.conftest import ROOT as REPO

    plots = {name: spec for entry in yaml.safe_load((REPO / "dvc.yaml").read_text())["plots"] if isinstance(entry, dict)
             for name, spec in entry.items()}
    points = [{**r, "rev": "workspace"} for r in _curve_csv(world["root"])]
    for name in ("label_efficiency", "label_efficiency_recall"):
        spec = dict(plots[name])
        (csv_file, y), = spec.pop("y").items()
        filled = VegaRenderer(points, name, template=str(REPO / spec.pop("template")), y=y, **spec).get_filled_template()
        assert filled["data"]["values"] and filled["encoding"]["x"]["field"] == "questions"
        assert filled["encoding"]["x"]["scale"]["type"] == "log" and filled["encoding"]["y"]["field"] == y


def test_a_smaller_size_trains_on_a_subset_of_the_larger_one():
    from components.training.finetune import size_subset

    rows = list(range(50))
    small, mid = size_subset(rows, 8, 0), size_subset(rows, 20, 0)
    assert len(small) == 8 and len(mid) == 20 and set(small) <= set(mid)  # nested: one seeded order
    assert size_subset(rows, "all", 0) == rows and size_subset(rows, 80, 0) == rows
    assert size_subset(rows, 8, 1) != small


def test_every_start_sees_the_same_batches(world, monkeypatch):
    """Same recipe: the trainer draws the same questions and negatives in the same order for each start."""
    from components.data.finetune_data import BiEncoderCollator
    from components.stages.finetune_retriever import finetune_retriever

    seen: list[list[tuple]] = []
    real_call = BiEncoderCollator.__call__

    def spy(self, rows, generator=None):
        batch = real_call(self, rows, generator)
        seen.append((tuple(r["qid"] for r in rows), tuple(batch["passage_keys"].tolist())))
        return batch

    monkeypatch.setattr(BiEncoderCollator, "__call__", spy)
    monkeypatch.chdir(world["root"])
    monkeypatch.setattr(paths, "FINETUNE_RETRIEVERS", world["root"] / "ft_order_check")
    p = tiny_params(**{"finetune.train.max_steps": 3, "finetune.train_sizes": [8]})
    for start in ("init", "retromae", "realm"):
        finetune_retriever(p, None, f"{start}-8")
    assert len(seen) == 9, len(seen)
    assert seen[0:3] == seen[3:6] == seen[6:9]


def test_a_start_without_an_encoder_is_skipped_with_a_note(world, monkeypatch, tmp_path):
    from components.stages.finetune_retriever import finetune_retriever
    from components.training import finetune as lib

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(lib.START_FOLDERS, "mlm", tmp_path / "nothing")
    (tmp_path / "data").symlink_to(world["root"] / "data")
    s = finetune_retriever(tiny_params(), None, "mlm-all")
    assert "no encoder" in s["skipped"] and (tmp_path / paths.retriever_out("mlm", "all") / "SKIPPED").exists()


# ----------------------------------------------------------------------------------------------
# REALM's stale-index ablation: two runs, each evaluated with its own model
# ----------------------------------------------------------------------------------------------
def test_the_two_realm_arms_differ_only_in_refresh_cadence():
    p = tiny_params()
    refreshed, stale = p.realm.for_arm("refreshed"), p.realm.for_arm("stale")
    a, b = refreshed.model_dump(), stale.model_dump()
    assert {k for k in a if a[k] != b[k]} == {"refresh_every"}
    assert (a["refresh_every"], b["refresh_every"]) == (p.realm.refresh_every, p.realm.refresh_every * p.realm.stale_factor)
    assert tiny_params(**{"realm.stale_factor": 0}).realm.for_arm("stale").refresh_every == 0  # 0: never refreshed
    with pytest.raises(ValueError, match="REALM arm"):
        p.realm.for_arm("nope")


def test_realm_stale_rows_come_from_the_stale_arm_own_run(world, monkeypatch):
    """The stale arm trained on its own (no refresh in a 4-step run at 30x fewer), wrote its own
    towers, index and summary, and evaluate's `realm-stale` and `qa:realm-stale` read those."""
    import components.eval.rows as rows_mod
    from components.eval.open_qa import OpenQAPredictor

    root, (refreshed, stale) = world["root"], (world["realm"]["refreshed"], world["realm"]["stale"])
    assert refreshed["refreshes"] >= 1 and stale["refreshes"] == 0
    assert json.loads((root / "metrics/pretrain_realm_stale.json").read_text())["refreshes"] == 0
    assert json.loads((root / "metrics/pretrain_realm.json").read_text())["refreshes"] == refreshed["refreshes"]
    assert (root / paths.REALM_STALE_OUT / "index" / "final").is_dir() and (root / "plots/realm_refresh_stale.csv").exists()
    loaded = []
    real_index = rows_mod._realm_index
    monkeypatch.setattr(rows_mod, "_realm_index", lambda arm: loaded.append(arm) or real_index(arm))
    monkeypatch.chdir(root)
    monkeypatch.setattr("components.stages.evaluate.METRICS", root / "metrics_arms")
    monkeypatch.setattr("components.stages.evaluate.PLOTS", root / "plots_arms")
    from components.stages.evaluate import evaluate

    evaluate(tiny_params(**{"finetune.qa_systems": ["closed-book"]}))
    assert loaded == [paths.REALM_OUT, paths.REALM_STALE_OUT]
    with contextlib.chdir(root):
        from components.data.tokenize import load_tokenizer

        qa = OpenQAPredictor.for_system("realm-stale", world["params"].finetune, load_tokenizer(paths.TOKENS / "tokenizer"))
    from components.index.faiss_index import BlockIndex

    own, other = (BlockIndex.load(root / arm / "index" / "final") for arm in (paths.REALM_STALE_OUT, paths.REALM_OUT))
    assert own.version != other.version  # the stale arm's final index is its first; the refreshed arm's is not
    assert (qa.index.version, len(qa.index)) == (own.version, len(own))


# ----------------------------------------------------------------------------------------------
# REALM's question: four open-QA systems, one reader recipe
# ----------------------------------------------------------------------------------------------
def test_each_qa_system_trains_its_reader_and_answers_every_question(world):
    from components.data.beir import read_qa

    root = world["root"]
    for system in ("bm25", "realm", "realm-stale"):  # closed-book has nothing to train
        assert (root / paths.FINETUNE_OPEN_QA / system / "openqa_config.json").exists()
        assert world["readers"][system]["steps"] == world["params"].finetune.qa_train.max_steps
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


def test_each_reader_runs_the_gold_phase_from_its_own_arm(world, monkeypatch):
    """finetune.qa_gold_steps: each reader first reads the questions' own paragraphs, starting from
    its own REALM arm's knowledge-augmented encoder, then trains over its system's top k from there."""
    from components.models.reader import SpanReader
    from components.training import finetune as lib

    for system in ("bm25", "realm", "realm-stale"):
        s = world["readers"][system]
        assert s["qa.gold.steps"] == 2 and 0 < s["qa.gold.questions"] <= s["qa_questions"]
    with contextlib.chdir(world["root"]):
        assert lib.reader_init_folder("realm-stale") == paths.REALM_STALE_OUT / "knowledge_augmented_encoder"
        assert lib.reader_init_folder("bm25") == lib.reader_init_folder("realm") == paths.REALM_OUT / "knowledge_augmented_encoder"
    starts: list[dict] = []
    real_trainer = lib.Trainer

    def spy(model, *args, **kw):
        starts.append({k: v.clone() for k, v in model.reader.state_dict().items()})
        return real_trainer(model, *args, **kw)

    monkeypatch.setattr(lib, "Trainer", spy)
    monkeypatch.setattr("components.stages.common.CHECKPOINTS", world["root"] / "gold_check")  # a fresh run
    with contextlib.chdir(world["root"]):
        from components.stages.finetune_reader import finetune_reader

        monkeypatch.setattr(paths, "FINETUNE_OPEN_QA", world["root"] / "gold_check_out")
        finetune_reader(world["params"], None, "realm-stale")
        init = SpanReader.from_pretrained(paths.REALM_STALE_OUT / "knowledge_augmented_encoder").state_dict()
    gold, system = starts
    assert all(torch.equal(gold[k], init[k]) for k in init if k in gold and "qa_outputs" not in k)  # the arm's encoder
    assert not all(torch.equal(system[k], gold[k]) for k in gold)  # the top-k phase starts after the gold phase trained


def test_the_training_curve_figure_reads_the_stages_loss_files(world):
    """evaluate draws REALM's loss from each arm's plots/loss_*.csv (a DVC out), with no MLflow run."""
    with (world["root"] / "metrics/eval/training_curves.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    for arm in REALM_ARMS:
        with (world["root"] / paths.loss_curve(f"pretrain_realm@{arm}")).open(newline="") as f:
            own = [(float(r["step"]), float(r["loss"])) for r in csv.DictReader(f)]
        drawn = [(float(r["step"]), float(r["value"])) for r in rows if r["name"] == f"pretrain_realm@{arm} loss"]
        assert own and drawn == own, arm
        assert own[-1][1] == pytest.approx(world["realm"][arm]["final_loss"])


def test_readers_from_one_encoder_share_the_gold_phase(world, monkeypatch):
    """bm25's and realm's readers start from the same encoder (the refreshed arm's), so their
    own-paragraph phase is one computation: whichever stage runs second resumes it, and starts its
    top-k phase from the same weights. realm-stale's reader, from its own arm, trains its own."""
    from components.stages.finetune_reader import finetune_reader
    from components.training import finetune as lib

    from components.io import tree_digest

    readers = world["readers"]  # run in the order bm25, realm, realm-stale
    steps = readers["bm25"]["qa.gold.steps"]
    assert readers["bm25"]["qa.gold.resumed_from"] == 0 and readers["realm"]["qa.gold.resumed_from"] == steps
    # keyed by content: the stale arm's encoder shares the phase only where it is byte-identical
    arms = [tree_digest(world["root"] / out / "knowledge_augmented_encoder")[0] for out in (paths.REALM_OUT, paths.REALM_STALE_OUT)]
    assert readers["realm-stale"]["qa.gold.resumed_from"] == (steps if arms[0] == arms[1] else 0)
    assert readers["realm"]["qa.gold.final_loss"] == readers["bm25"]["qa.gold.final_loss"]

    handed: dict[str, dict] = {}  # system -> the reader weights its top-k phase starts from
    real_trainer = lib.Trainer

    def spy(model, *args, **kw):
        if kw.get("param_prefix") == "finetune.qa_train":
            handed[current] = {k: v.clone() for k, v in model.reader.state_dict().items()}
        return real_trainer(model, *args, **kw)

    monkeypatch.setattr(lib, "Trainer", spy)
    monkeypatch.setattr("components.stages.common.CHECKPOINTS", world["root"] / "shared_gold")  # fresh runs
    monkeypatch.setattr(paths, "FINETUNE_OPEN_QA", world["root"] / "shared_gold_out")
    again = {}
    with contextlib.chdir(world["root"]):
        for current in ("realm", "bm25"):  # the other order this time
            again[current] = finetune_reader(world["params"], None, current)
    assert again["realm"]["qa.gold.resumed_from"] == 0 and again["bm25"]["qa.gold.resumed_from"] == steps
    assert all(torch.equal(handed["realm"][k], handed["bm25"][k]) for k in handed["realm"])


def test_a_system_that_reads_what_another_read_gets_its_answers(tmp_path, monkeypatch):
    """evaluate reads each (reader, index) once: two REALM arms that ended alike (the default's 6
    steps) share qa:realm's predictions. The key is content: the reader folder and the index's
    vectors and ids, not its manifest's version; one changed byte of either reads again."""
    import json

    from components.eval import rows as rows_lib

    arms = {s: tmp_path / s for s in ("realm", "realm-stale")}
    for version, arm in enumerate(arms.values(), start=1):
        (arm / "index" / "final").mkdir(parents=True)
        (arm / "index" / "final" / "meta.json").write_text(json.dumps(
            {"version": version, "created_unix": version, "type": "flat", "dim": 4, "n": 2,
             "files": {"index.faiss": {"sha256": "ab", "bytes": 1}}}))
    qa_dir = tmp_path / "open_qa"
    for system in ("bm25", *arms):
        (qa_dir / system / "reader").mkdir(parents=True)
        (qa_dir / system / "reader" / "model.safetensors").write_bytes(b"weights")
    monkeypatch.setattr(rows_lib, "REALM_SYSTEM_OUT", arms)
    digest = {s: rows_lib.reads_digest(s, qa_dir) for s in ("bm25", *arms)}
    assert digest["realm"] == digest["realm-stale"] != digest["bm25"]  # bm25 reads its own top k

    (qa_dir / "realm-stale" / "reader" / "model.safetensors").write_bytes(b"weightz")
    assert rows_lib.reads_digest("realm-stale", qa_dir) != digest["realm"]
    (qa_dir / "realm-stale" / "reader" / "model.safetensors").write_bytes(b"weights")
    meta = json.loads((arms["realm-stale"] / "index" / "final" / "meta.json").read_text())
    meta["files"]["index.faiss"]["sha256"] = "cd"
    (arms["realm-stale"] / "index" / "final" / "meta.json").write_text(json.dumps(meta))
    assert rows_lib.reads_digest("realm-stale", qa_dir) != digest["realm"]


def test_qa_rows_read_each_reader_and_index_once(world, monkeypatch, tmp_path):
    """Two systems with one digest are read once, and the second row gets the first's answers."""
    from components.data.tokenize import load_tokenizer
    from components.eval import open_qa
    from components.eval import rows as rows_lib

    real_for_system, loaded = open_qa.OpenQAPredictor.for_system, []

    def counting(system, *a, **kw):
        loaded.append(system)
        return real_for_system(system, *a, **kw)

    monkeypatch.setattr(open_qa.OpenQAPredictor, "for_system", staticmethod(counting))
    monkeypatch.setattr(rows_lib, "reads_digest", lambda system, _: "arm" if system.startswith("realm") else system)
    with contextlib.chdir(world["root"]):
        p = world["params"]
        tok = load_tokenizer(paths.TOKENS / "tokenizer")
        out = rows_lib.qa_rows(p, rows_lib.eval_sets(p, tok)[0], tok, tmp_path)
    assert loaded == ["bm25", "realm"]  # realm-stale was not read again
    by = {r["system"]: r for r in out}
    assert by["qa:realm-stale"]["em"] == by["qa:realm"]["em"] and by["qa:realm-stale"]["f1"] == by["qa:realm"]["f1"]
    stale, realm = (per_query_path(tmp_path, "main", f"qa:{s}").read_text() for s in ("realm-stale", "realm"))
    assert stale == realm


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
    assert pairs == {("ft:retromae", "ft:mlm"), ("ft:retromae@8", "ft:mlm@8"), ("ft:retromae@8", "ft:init@8"),
                     ("ft:retromae", "ft:init"), ("retromae", "mlm"), ("retromae", "init"),
                     ("realm", "realm-stale"), ("realm", "retromae"), ("ict", "retromae"), ("realm", "ict"), ("qa:realm", "qa:closed-book"),
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


def test_a_corpus_without_questions_gets_every_output_and_a_report_that_says_so(world, tmp_path, monkeypatch):
    """Prose (data.source txt / jsonl) has no question to score: evaluate still writes each of its dvc.yaml
    outs, and the report names why it has no table and how to score the models; never a failed stage."""
    import html
    import shutil

    from components.stages.evaluate import evaluate, title_line

    shutil.copytree(world["root"] / paths.CORPUS, tmp_path / paths.CORPUS)
    (tmp_path / paths.TOKENS).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / paths.TOKENS).symlink_to(world["root"] / paths.TOKENS)
    for split in ("train", "dev", "test"):  # what prepare_corpus writes for a corpus of passages only
        (tmp_path / paths.CORPUS / f"beir/qrels/{split}.tsv").write_text("query-id\tcorpus-id\tscore\n")
        (tmp_path / paths.CORPUS / f"qa/{split}.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    out = evaluate(tiny_params())
    assert out["rows"] == [] and out["comparisons"] == []
    table = json.loads((tmp_path / paths.METRICS / "eval.json").read_text())
    assert table["note"].startswith("nothing to score: the test split has no questions")
    assert "evaluate.extra_sets" in table["note"] and not any(isinstance(v, dict) for v in table.values())
    report = (tmp_path / paths.METRICS / "eval/results.md").read_text()
    assert report.splitlines()[0] == title_line(tiny_params())
    assert table["note"] in report and html.escape(table["note"]) in (tmp_path / paths.METRICS / "eval/results.html").read_text()
    assert (tmp_path / "plots/recall_at_k.csv").read_text() == "system,k,recall\n"
    assert (tmp_path / "plots/label_efficiency.csv").read_text().count("\n") == 1  # the header alone
    assert (tmp_path / paths.METRICS / "headline").is_dir()


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

    from components.data.tokenize import load_tokenizer
    from components.eval.rows import warm_start_system

    root = world["root"]
    tok = load_tokenizer(root / paths.TOKENS / "tokenizer")
    folder = tmp_path / "st"
    model = _save_sentence_transformers(tok, folder)
    blocks = datasets.load_from_disk(str(root / paths.TOKENS / "blocks"))
    name, enc, own_tok, own_blocks = warm_start_system(tiny_params(**{"warm_start.path": str(folder)}), blocks)
    assert name == "warm-start:mean" and len(own_blocks["input_ids"]) == len(blocks)
    ids = torch.tensor([[tok.cls_token_id, 7, 8, tok.sep_token_id, tok.pad_token_id]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state[0, :4]  # (4, H) real tokens
    expect = torch.nn.functional.normalize(hidden.mean(0), dim=0)
    assert torch.allclose(enc(ids, mask)[0], expect, atol=1e-5)
    assert warm_start_system(tiny_params(), blocks) is None  # no warm start, no row


def _ordered(run: dict) -> list:
    """A run with its order: (qid, [(doc, score), ...]) in ranking order."""
    return [(q, list(docs.items())) for q, docs in run.items()]


def test_the_warm_start_and_its_copy_are_scored_from_one_pass(world, tmp_path):
    """`init` is the warm start copied (the real-text default): one forward over the blocks and the
    queries gives both rows, each exactly the run of its own pass (the warm start's with its own
    tokenizer and blocks); a weight that differs, or a block tokenised otherwise, scores them apart."""
    import datasets

    from components.data.beir import load_beir
    from components.data.tokenize import load_tokenizer
    from components.eval.dense import HFEncoder, PoolingViews, dense_run, same_function, shared_dense_runs
    from components.eval.rows import _one_pass, warm_start_system

    root = world["root"]
    tok = load_tokenizer(root / paths.TOKENS / "tokenizer")
    blocks = datasets.load_from_disk(str(root / paths.TOKENS / "blocks"))
    queries = load_beir(root / paths.CORPUS / "beir", "test").queries
    p = tiny_params(**{"warm_start.path": str(root / "warm")})
    warm = warm_start_system(p, blocks)
    name, enc, own_tok, own_blocks = warm
    enc.model.save_pretrained(tmp_path / "init")  # the warm start's weights, in a plain HF folder
    init = HFEncoder.load(tmp_path / "init")
    assert (enc.pooling, init.pooling) == ("mean", "cls")
    assert same_function(enc, init) and _one_pass(warm, init, blocks, queries, tok)

    kw = dict(k=10, query_len=p.evaluate.query_len, passage_len=p.evaluate.passage_len, batch_size=4)
    shared = shared_dense_runs(PoolingViews([enc, init]), blocks, queries, tok, **kw)
    alone = [dense_run(enc, enc, own_blocks, queries, own_tok, **kw)[0], dense_run(init, init, blocks, queries, tok, **kw)[0]]
    assert [_ordered(r) for r in shared] == [_ordered(r) for r in alone]  # scores and ranking, exactly
    assert shared[0] != shared[1]  # two poolings, two runs

    other = {**own_blocks, "input_ids": [list(r)[::-1] for r in own_blocks["input_ids"]]}
    assert not _one_pass((name, enc, own_tok, other), init, blocks, queries, tok)
    longer = {**own_blocks, "input_ids": [[*r, 7] for r in own_blocks["input_ids"]]}  # past the cut, still another batch order
    assert not _one_pass((name, enc, own_tok, longer), init, blocks, queries, tok)
    with torch.no_grad():
        next(init.model.parameters()).view(-1)[0] += 1e-3
    assert not same_function(enc, init)


def test_retrieval_rows_score_the_copy_from_one_pass_as_from_two(world, tmp_path, monkeypatch):
    """The stage's own path: with `models/init/encoder` the warm start copied, `retrieval_rows` takes
    the one-pass branch and writes the rows and per-query files that two passes write."""
    import datasets

    from components.data.tokenize import load_tokenizer
    from components.eval import rows as R
    from components.models.encoder import load_encoder

    root = world["root"]
    p = tiny_params(**{"warm_start.path": str(root / "warm")})
    shared_calls = []
    real_shared = R.shared_dense_runs
    monkeypatch.setattr(R, "shared_dense_runs", lambda *a, **kw: shared_calls.append(1) or real_shared(*a, **kw))

    def run(one_pass: bool, ws: Path) -> tuple[list[dict], dict[str, str]]:
        (ws / "data").mkdir(parents=True)
        for sub in ("tokens", "corpus"):
            (ws / "data" / sub).symlink_to(root / "data" / sub)
        load_encoder(root / "warm").save_pretrained(ws / paths.INIT_ENCODER)  # init: the warm start copied
        if not one_pass:
            monkeypatch.setattr(R, "_one_pass", lambda *a: False)
        with contextlib.chdir(ws):
            tok = load_tokenizer(paths.TOKENS / "tokenizer")
            assert len(datasets.load_from_disk(str(paths.TOKENS / "blocks")))
            rows = R.retrieval_rows(p, R.eval_sets(p, tok)[0], tok, ws / "out")
        files = {f.name: f.read_text() for f in sorted((ws / "out").rglob("*")) if f.is_file()}
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rows], files

    one = run(True, tmp_path / "one")
    assert shared_calls == [1]
    two = run(False, tmp_path / "two")
    assert shared_calls == [1]
    assert [r["system"] for r in one[0]] == ["bm25", "warm-start:mean", "init"]
    assert one == two
