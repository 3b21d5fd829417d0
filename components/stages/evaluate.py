"""Stage body of `evaluate`: every system on the same test data, one table.

    python -m flows.evaluate

Rows per evaluation set (the pipeline's own test split, plus `evaluate.extra_sets`):
  bm25              BM25 (bm25s) over the passages
  init              the encoder before any pre-training (models/retromae/init_encoder)
  retromae          RetroMAE-pretrained encoder, zero-shot
  mlm               plain-MLM-pretrained encoder, same compute (skipped when mlm.enabled is false)
  finetuned         the DPR-fine-tuned bi-encoder (models/finetune/retriever)
  realm             REALM retriever with its final index
  realm-stale       REALM retriever against the first index version (never refreshed)
  realm-reader      open-QA: REALM retriever + fine-tuned reader (EM/F1)
  closed-book       the reader with the null document only (EM/F1): what retrieval adds
Outputs: metrics/eval.json (dvc metrics), metrics/eval/<set>/<system>.jsonl (per query),
metrics/eval/results.{md,html} + PNGs, plots/recall_at_k.csv (dvc plots).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import datasets
import torch

from components.config import Params
from components.data.beir import load_beir, read_qa
from components.data.tokenize import load_tokenizer, split_retrieval_blocks, tokenize_passages
from components.eval.dense import HFEncoder, dense_run
from components.eval.metrics import qa_metrics, retrieval_metrics
from components.eval.report import results_table, write_report
from components.io import write_json_atomic, write_jsonl_atomic, write_text_atomic
from components.paths import (CORPUS, FINETUNE_OUT, INIT_ENCODER, METRICS, MLM_ENCODER, PLOTS, REALM_OUT, RETROMAE_ENCODER,
                              TOKENS)
from components.retrieval.bm25 import BM25Retriever

log = logging.getLogger(__name__)

MAIN_SET = "main"


@dataclass
class EvalSet:
    name: str
    beir: object  # BeirData (corpus, queries, qrels) for the test split, or None
    blocks: datasets.Dataset | None
    qa: list[dict] = field(default_factory=list)
    is_main: bool = False


def _blocks_for_corpus(corpus: dict, tokenizer, block_len: int) -> datasets.Dataset:
    """Tokenise an external BEIR corpus into retrieval blocks with the pipeline's tokenizer."""
    rows = {"doc_id": list(corpus), "title": [c["title"] for c in corpus.values()],
            "text": [c["text"] for c in corpus.values()], "spans": [[] for _ in corpus]}
    return datasets.Dataset.from_dict(split_retrieval_blocks(tokenize_passages(datasets.Dataset.from_dict(rows), tokenizer), block_len))


def eval_sets(params: Params, tokenizer) -> list[EvalSet]:
    sets = []
    main_qa = CORPUS / "qa/test.jsonl"
    main_beir = load_beir(CORPUS / "beir", "test") if (CORPUS / "beir/qrels/test.tsv").stat().st_size > len("query-id\tcorpus-id\tscore\n") else None
    sets.append(EvalSet(MAIN_SET, main_beir, datasets.load_from_disk(str(TOKENS / "blocks")),
                        read_qa(main_qa) if main_qa.exists() and main_qa.stat().st_size else [], is_main=True))
    for extra in params.evaluate.extra_sets:
        beir = load_beir(extra.beir_path, "test") if extra.beir_path else None
        blocks = _blocks_for_corpus(beir.corpus, tokenizer, params.tokenize.retrieval_block_len) if beir else None
        sets.append(EvalSet(extra.name, beir, blocks, read_qa(extra.qa_path) if extra.qa_path else []))
    return sets


# ----------------------------------------------------------------------------------------------
# systems
# ----------------------------------------------------------------------------------------------
def _encoder_systems(params: Params) -> dict[str, Callable]:
    """name -> factory of (encode_query, encode_passage); only systems whose model exists."""
    systems: dict[str, Callable] = {}

    def hf(folder: Path):
        def make():
            enc = HFEncoder.load(folder)
            return enc, enc
        return make

    for name, folder in (("init", INIT_ENCODER), ("retromae", RETROMAE_ENCODER), ("mlm", MLM_ENCODER),
                         ("finetuned", FINETUNE_OUT / "retriever")):
        if (folder / "config.json").exists():
            systems[name] = hf(folder)
    return systems


def _realm_retriever():
    from components.models.retriever import Retriever

    folder = REALM_OUT / "retriever"
    if not folder.exists():
        return None
    r = Retriever.from_pretrained(folder).eval()
    return (lambda ids, mask: r.encode_query(ids, mask)), (lambda ids, mask: r.encode_passage(ids, mask))


def _realm_index(which: str):
    from components.index.faiss_index import BlockIndex

    folder = REALM_OUT / "index" / which
    return BlockIndex.load(folder) if folder.exists() else None


def _per_query(path: Path, metrics: dict) -> None:
    write_jsonl_atomic(path, [{"qid": q, **v} for q, v in sorted(metrics.get("per_query", {}).items())])


def retrieval_rows(params: Params, es: EvalSet, tokenizer, out_dir: Path) -> list[dict]:
    ev = params.evaluate
    k = max(ev.recall_at)
    rows: list[dict] = []
    qrels, queries = es.beir.qrels, es.beir.queries

    def add(system: str, run: dict, seconds: float) -> None:
        m = retrieval_metrics(qrels, run, ev.recall_at)
        _per_query(out_dir / es.name / f"{system}.jsonl", m)
        rows.append({"system": system, "dataset": es.name, "seconds": round(seconds, 2),
                     **{key: v for key, v in m.items() if key != "per_query"}})
        log.info("%-12s %-10s nDCG@10=%.3f R@%d=%.3f (%.1fs)", es.name, system, m["ndcg_at_10"], k, m[f"recall_at_{k}"], seconds)

    t0 = time.perf_counter()
    bm25 = BM25Retriever().fit(list(es.beir.corpus), [f"{c['title']} {c['text']}" for c in es.beir.corpus.values()])
    add("bm25", bm25.run(queries, k), time.perf_counter() - t0)

    dense_kw = dict(k=k, query_len=ev.query_len, passage_len=ev.passage_len, batch_size=ev.batch_size)
    for name, make in _encoder_systems(params).items():
        t0 = time.perf_counter()
        eq, ep = make()
        run, _ = dense_run(eq, ep, es.blocks, queries, tokenizer, **dense_kw)
        add(name, run, time.perf_counter() - t0)

    realm = _realm_retriever()
    if realm is not None:
        eq, ep = realm
        for system, which in (("realm", "final"), ("realm-stale", "first")):
            index = _realm_index(which) if es.is_main else None
            if index is None and not es.is_main and system == "realm-stale":
                continue  # the stale index only exists for the pre-training corpus
            t0 = time.perf_counter()
            run, _ = dense_run(eq, ep, es.blocks, queries, tokenizer, index=index, **dense_kw)
            add(system, run, time.perf_counter() - t0)
    return rows


def qa_rows(params: Params, es: EvalSet, tokenizer, out_dir: Path) -> list[dict]:
    """Open-QA with the fine-tuned reader over the final REALM index (when finetune trained one)."""
    if not es.qa or not es.is_main or not (FINETUNE_OUT / "open_qa").exists():
        return []  # the reader reads the pre-training corpus's index; extra sets would need their own
    from components.eval.open_qa import OpenQAPredictor

    qa = OpenQAPredictor.load(params.finetune, tokenizer)
    golds = {r["id"]: r["answers"] for r in es.qa}
    rows = []
    for system, closed_book in (("realm-reader", False), ("closed-book", True)):
        t0 = time.perf_counter()
        preds = qa.predict_all([(r["id"], r["question"]) for r in es.qa], closed_book=closed_book)
        m = qa_metrics(preds, golds)
        write_jsonl_atomic(out_dir / es.name / f"{system}.jsonl",
                           [{"id": i, "prediction": preds.get(i, ""), "answers": golds[i]} for i in golds])
        rows.append({"system": system, "dataset": es.name, "seconds": round(time.perf_counter() - t0, 2),
                     "em": m["em"], "f1": m["f1"], "n_questions": m["n"]})
    return rows


def training_curves(run) -> dict[str, list[tuple[float, float]]]:
    """Loss curves of the latest finished pre-training runs, fetched from MLflow (the record)."""
    if run is None:
        return {}
    curves = {}
    exp = run.client.get_experiment_by_name(run.params.tracking.experiment)
    for stage in ("pretrain_retromae", "pretrain_mlm", "pretrain_realm"):
        found = run.client.search_runs([exp.experiment_id], f"tags.`dvc.stage` = '{stage}' and attributes.status = 'FINISHED'",
                                       order_by=["attributes.start_time DESC"], max_results=50)
        found = [r for r in found if "rr.kind" not in r.data.tags]  # the stage run, not its refresh_index children
        if found:
            hist = run.client.get_metric_history(found[0].info.run_id, "loss")
            curves[f"{stage} loss"] = [(m.step, m.value) for m in sorted(hist, key=lambda m: m.step)]
    return {k: v for k, v in curves.items() if v}


def evaluate(params: Params, run=None) -> dict:
    tokenizer = load_tokenizer(TOKENS / "tokenizer")
    out_dir = METRICS / "eval"
    rows: list[dict] = []
    with torch.inference_mode():
        for es in eval_sets(params, tokenizer):
            if es.beir is not None and es.beir.queries:
                rows += retrieval_rows(params, es, tokenizer, out_dir)
            rows += qa_rows(params, es, tokenizer, out_dir)
    if not rows:
        raise RuntimeError("nothing to evaluate: the test split has no questions (data/corpus/beir/qrels/test.tsv is empty) "
                           "and evaluate.extra_sets is empty; use a source with questions or add an extra set")
    curves = training_curves(run)
    write_report(out_dir, rows, curves)
    recall_csv = out_dir / "recall_at_k.csv"
    if recall_csv.exists():
        write_text_atomic(PLOTS / "recall_at_k.csv", recall_csv.read_text())
    table = {}
    for r in rows:
        table.setdefault(r["dataset"], {})[r["system"]] = {k: v for k, v in r.items() if k not in ("dataset", "system")}
    write_json_atomic(METRICS / "eval.json", table)
    print(results_table(rows))
    return {"rows": rows, "table": table}
