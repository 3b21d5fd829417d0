"""Stage body of `evaluate`: every system on the same questions (`evaluate.split`), one table, and
the papers' comparisons with paired p-values.

    python -m flows.evaluate

Rows per evaluation set (the pipeline's own `evaluate.split` split, plus `evaluate.extra_sets`):
  bm25              BM25 (bm25s) over the passages
  warm-start:mean   the off-the-shelf warm-start encoder (`warm_start.path`) in its own mode (mean
                    pooling, normalised as its sentence-transformers folder says): a reference
  init              the encoder before any pre-training (models/retromae/init_encoder)
  retromae          RetroMAE-pretrained encoder, zero-shot
  mlm               plain-MLM-pretrained encoder, same compute (skipped when mlm.enabled is false)
  realm             REALM retriever with its final index
  realm-stale       REALM retriever against the first index version (never refreshed)
  ft:<start>        the bi-encoder fine-tuned with one recipe from each start (models/finetune/retriever/<start>)
  qa:<system>       open-QA EM/F1, one reader per system trained with one recipe (models/finetune/open_qa/<system>):
                    qa:closed-book (null document only), qa:bm25, qa:realm (final index), qa:realm-stale
Outputs: metrics/eval.json (dvc metrics: {set: {system: metrics}}, `split`, `comparisons`),
metrics/eval/<set>/<system>.jsonl (per query; `:` -> `_` in file names), metrics/eval/results.{md,html},
comparisons.csv + PNGs, plots/recall_at_k.csv (dvc plots).
"""

from __future__ import annotations

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
from components.eval.comparisons import paper_comparisons, per_query_path, run_comparisons
from components.eval.dense import HFEncoder, dense_run, sentence_transformers_mode
from components.eval.headline import write_headline
from components.eval.metrics import exact_match, f1, qa_metrics, retrieval_metrics
from components.eval.report import report_markdown, write_report
from components.io import write_json_atomic, write_jsonl_atomic, write_text_atomic
from components.models.encoder import warm_start_path
from components.paths import (CORPUS, FINETUNE_RETRIEVERS, INIT_ENCODER, METRICS, MLM_ENCODER, PLOTS, REALM_OUT, RETROMAE_ENCODER,
                              TOKENS)
from components.retrieval.bm25 import BM25Retriever
from components.tracking import latest_stage_run
from components.training.trainer import autocast_for

log = logging.getLogger(__name__)

MAIN_SET = "main"
FT_ORDER = ("init", "mlm", "retromae", "realm", "pretrained")  # ft:* rows in this order, then any others by name
# realm.retriever_init -> the zero-shot row REALM's retriever starts from (ict / random: random towers, no row)
REALM_START_ROW = {"retromae": "retromae"}


@dataclass
class EvalSet:
    name: str
    beir: object  # BeirData (corpus, queries, qrels) for the evaluated split, or None
    blocks: datasets.Dataset | None
    qa: list[dict] = field(default_factory=list)
    is_main: bool = False


def _blocks_for_corpus(corpus: dict, tokenizer, block_len: int) -> datasets.Dataset:
    """Tokenise an external BEIR corpus into retrieval blocks with the pipeline's tokenizer."""
    rows = {"doc_id": list(corpus), "title": [c["title"] for c in corpus.values()],
            "text": [c["text"] for c in corpus.values()], "spans": [[] for _ in corpus]}
    return datasets.Dataset.from_dict(split_retrieval_blocks(tokenize_passages(datasets.Dataset.from_dict(rows), tokenizer), block_len))


def eval_sets(params: Params, tokenizer) -> list[EvalSet]:
    split = params.evaluate.split
    sets = []
    main_qa = CORPUS / f"qa/{split}.jsonl"
    qrels = CORPUS / f"beir/qrels/{split}.tsv"
    main_beir = load_beir(CORPUS / "beir", split) if qrels.stat().st_size > len("query-id\tcorpus-id\tscore\n") else None
    sets.append(EvalSet(MAIN_SET, main_beir, datasets.load_from_disk(str(TOKENS / "blocks")),
                        read_qa(main_qa) if main_qa.exists() and main_qa.stat().st_size else [], is_main=True))
    for extra in params.evaluate.extra_sets:
        beir = load_beir(extra.beir_path, split) if extra.beir_path else None
        blocks = _blocks_for_corpus(beir.corpus, tokenizer, params.tokenize.retrieval_block_len) if beir else None
        sets.append(EvalSet(extra.name, beir, blocks, read_qa(extra.qa_path) if extra.qa_path else []))
    return sets


def title_line(params: Params) -> str:
    """The report's first line: which split it reports and, with `evaluate.banner: auto` and no
    warm start (encoders trained from scratch), that the run is a smoke test."""
    ev = params.evaluate
    banner = ev.banner
    if banner == "auto":
        world = " on a synthetic world" if params.data.source == "synthetic" else ""
        banner = ("" if params.warm_start.path is not None else
                  f"tiny preset: a smoke test{world}, encoders trained from scratch (warm_start.path: null); "
                  "see README for the `small` run")
    return f"{banner} | evaluate.split: {ev.split}" if banner else f"evaluate.split: {ev.split}"


# ----------------------------------------------------------------------------------------------
# systems
# ----------------------------------------------------------------------------------------------
def finetuned_starts(folder: Path = FINETUNE_RETRIEVERS) -> list[str]:
    """The starts `finetune` wrote a bi-encoder for (models/finetune/retriever/<start>/), in table order."""
    found = [p.name for p in folder.iterdir() if (p / "config.json").exists()] if folder.is_dir() else []
    return sorted(found, key=lambda n: (FT_ORDER.index(n) if n in FT_ORDER else len(FT_ORDER), n))


def _encoder_systems() -> dict[str, Path]:
    """name -> encoder folder ([CLS] pooling, the pipeline's tokenizer); only systems whose model exists."""
    systems = {name: folder for name, folder in (("init", INIT_ENCODER), ("retromae", RETROMAE_ENCODER), ("mlm", MLM_ENCODER))
               if (folder / "config.json").exists()}
    return systems


def _realm_retriever():
    from components.models.retriever import Retriever

    folder = REALM_OUT / "retriever"
    if not folder.exists():
        return None
    r = Retriever.from_pretrained(folder).eval()
    # the passage tower takes token types for `realm.doc_input: title_body` (None: all type 0)
    return (lambda ids, mask: r.encode_query(ids, mask)), (lambda ids, mask, types=None: r.encode_passage(ids, mask, types))


def _realm_index(which: str):
    from components.index.faiss_index import BlockIndex

    folder = REALM_OUT / "index" / which
    return BlockIndex.load(folder) if folder.exists() else None


def _warm_start_system(params: Params, blocks):
    """(row name, encoder, its own tokenizer, the blocks re-tokenised with it), or None without a
    warm start. The reference row reads text the way the off-the-shelf model was trained to."""
    spec = warm_start_path(params)
    if spec is None or blocks is None or "text" not in blocks.column_names:
        return None
    from transformers import AutoTokenizer

    from components.eval.dense import tokenize_texts

    pooling, normalize = sentence_transformers_mode(spec) if Path(spec).is_dir() else ("mean", False)
    tok = AutoTokenizer.from_pretrained(spec)
    own = {"input_ids": tokenize_texts(tok, list(blocks["text"])), "block_id": list(blocks["block_id"]),
           "doc_id": list(blocks["doc_id"])}
    return f"warm-start:{pooling}", HFEncoder.load(spec, pooling=pooling, normalize=normalize), tok, own


def retrieval_rows(params: Params, es: EvalSet, tokenizer, out_dir: Path) -> list[dict]:
    ev = params.evaluate
    k = max(ev.recall_at)
    rows: list[dict] = []
    qrels, queries = es.beir.qrels, es.beir.queries
    dense_kw = dict(k=k, query_len=ev.query_len, passage_len=ev.passage_len, batch_size=ev.batch_size)

    def add(system: str, run: dict, seconds: float) -> None:
        m = retrieval_metrics(qrels, run, ev.recall_at)
        write_jsonl_atomic(per_query_path(out_dir, es.name, system), [{"qid": q, **v} for q, v in sorted(m["per_query"].items())])
        rows.append({"system": system, "dataset": es.name, "seconds": round(seconds, 2),
                     **{key: v for key, v in m.items() if key != "per_query"}})
        log.info("%-12s %-14s nDCG@10=%.3f R@%d=%.3f (%.1fs)", es.name, system, m["ndcg_at_10"], k, m[f"recall_at_{k}"], seconds)

    def add_dense(system: str, eq: Callable, ep: Callable, tok=tokenizer, blocks=None, index=None, titles=False) -> None:
        t0 = time.perf_counter()
        run, _ = dense_run(eq, ep, es.blocks if blocks is None else blocks, queries, tok, index=index,
                           passage_titles=titles, **dense_kw)
        add(system, run, time.perf_counter() - t0)

    t0 = time.perf_counter()
    bm25 = BM25Retriever().fit(list(es.beir.corpus), [f"{c['title']} {c['text']}" for c in es.beir.corpus.values()])
    add("bm25", bm25.run(queries, k), time.perf_counter() - t0)

    warm = _warm_start_system(params, es.blocks)
    if warm is not None:
        name, enc, tok, own_blocks = warm
        add_dense(name, enc, enc, tok, own_blocks)
    for name, folder in _encoder_systems().items():
        enc = HFEncoder.load(folder)
        add_dense(name, enc, enc)

    realm = _realm_retriever()
    if realm is not None:
        eq, ep = realm
        for system, which in (("realm", "final"), ("realm-stale", "first")):
            index = _realm_index(which) if es.is_main else None
            if index is None and not es.is_main and system == "realm-stale":
                continue  # the stale index only exists for the pre-training corpus
            add_dense(system, eq, ep, index=index, titles=params.realm.doc_input == "title_body")

    for start in finetuned_starts():
        enc = HFEncoder.load(FINETUNE_RETRIEVERS / start)
        add_dense(f"ft:{start}", enc, enc)
    return rows


def qa_rows(params: Params, es: EvalSet, tokenizer, out_dir: Path) -> list[dict]:
    """Open-QA EM/F1 of every `finetune.qa_systems` entry whose reader finetune trained, each over
    its own top k; closed-book reads the null document only (an extractive reader answers "")."""
    from components.eval.open_qa import OPEN_QA_OUT, OpenQAPredictor

    if not es.qa or not es.is_main:
        return []  # the readers read the pre-training corpus's blocks; extra sets would need their own
    systems = params.finetune.qa_systems
    trained = [s for s in systems if s != "closed-book" and (OPEN_QA_OUT / s / "openqa_config.json").exists()]
    golds = {r["id"]: r["answers"] for r in es.qa}
    questions = [(r["id"], r["question"]) for r in es.qa]
    results: dict[str, dict] = {}

    def add(system: str, preds: dict[str, str], seconds: float) -> None:
        m = qa_metrics(preds, golds)
        write_jsonl_atomic(per_query_path(out_dir, es.name, f"qa:{system}"),
                           [{"qid": i, "prediction": preds.get(i, ""), "answers": golds[i],
                             "em": exact_match(preds[i], golds[i]) if i in preds else 0.0,
                             "f1": f1(preds[i], golds[i]) if i in preds else 0.0} for i in golds])
        results[system] = {"system": f"qa:{system}", "dataset": es.name, "seconds": round(seconds, 2),
                           "em": m["em"], "f1": m["f1"], "n_questions": m["n"]}
        log.info("%-12s %-14s EM=%.3f F1=%.3f (%.1fs)", es.name, f"qa:{system}", m["em"], m["f1"], seconds)

    bm25 = None
    for system in trained:
        t0 = time.perf_counter()
        if system == "bm25":
            from components.retrieval.search import bm25_over_blocks

            bm25 = bm25_over_blocks(list(es.blocks["text"]))
        qa = OpenQAPredictor.for_system(system, params.finetune, tokenizer, blocks=es.blocks, bm25=bm25)
        add(system, qa.predict_all(questions), time.perf_counter() - t0)
        if "closed-book" in systems and "closed-book" not in results:
            t0 = time.perf_counter()  # any trained reader: with no block there is no span to answer
            add("closed-book", qa.predict_all(questions, closed_book=True), time.perf_counter() - t0)
        del qa
    return [results[s] for s in systems if s in results]


def training_curves(run) -> dict[str, list[tuple[float, float]]]:
    """Loss curves of the latest finished pre-training runs, fetched from MLflow (the record)."""
    if run is None:
        return {}
    curves = {}
    exp = run.client.get_experiment_by_name(run.params.tracking.experiment)
    for stage in ("pretrain_retromae", "pretrain_mlm", "pretrain_realm"):
        found = latest_stage_run(run.client, [exp.experiment_id], stage)
        if found is not None:
            hist = run.client.get_metric_history(found.info.run_id, "loss")
            curves[f"{stage} loss"] = [(m.step, m.value) for m in sorted(hist, key=lambda m: m.step)]
    return {k: v for k, v in curves.items() if v}


def evaluate(params: Params, run=None) -> dict:
    tokenizer = load_tokenizer(TOKENS / "tokenizer")
    out_dir = METRICS / "eval"
    rows: list[dict] = []
    comparisons: list[dict] = []
    paper = paper_comparisons(REALM_START_ROW.get(params.realm.retriever_init))
    # the encoders and readers evaluate on the CPU (HFEncoder, OpenQA.from_pretrained), in
    # compute.precision: bf16 is ~2.5x faster than fp32 on a CPU with AVX512-BF16 (and slower without it: bf16_if_native)
    with torch.inference_mode(), autocast_for(params.compute.precision, "cpu"):
        for es in eval_sets(params, tokenizer):
            if es.beir is not None and es.beir.queries:
                rows += retrieval_rows(params, es, tokenizer, out_dir)
            rows += qa_rows(params, es, tokenizer, out_dir)
            comparisons += run_comparisons(out_dir, es.name, paper)
    if not rows:
        split = params.evaluate.split
        raise RuntimeError(f"nothing to evaluate: the {split} split has no questions (data/corpus/beir/qrels/{split}.tsv is "
                           "empty) and evaluate.extra_sets is empty; use a source with questions or add an extra set")
    title = title_line(params)
    write_report(out_dir, rows, training_curves(run), title=title, comparisons=comparisons)
    recall_csv = out_dir / "recall_at_k.csv"
    if recall_csv.exists():
        write_text_atomic(PLOTS / "recall_at_k.csv", recall_csv.read_text())
    table: dict = {}
    for r in rows:
        table.setdefault(r["dataset"], {})[r["system"]] = {k: v for k, v in r.items() if k not in ("dataset", "system")}
    write_json_atomic(METRICS / "eval.json", {**table, "split": params.evaluate.split, "comparisons": comparisons})
    write_headline(METRICS / "headline", table, params.evaluate.recall_at, METRICS)  # what `dvc metrics show` prints
    report = report_markdown(rows, title, comparisons)
    print(report)
    return {"rows": rows, "table": table, "comparisons": comparisons, "report": report}
