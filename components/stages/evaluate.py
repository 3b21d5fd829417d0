"""Stage body of `evaluate`: every system on the same questions (`evaluate.split`), one table, and
the papers' comparisons with paired p-values.

    python -m flows.evaluate

Rows per evaluation set (the pipeline's own `evaluate.split` split, plus `evaluate.extra_sets`):
  bm25              BM25 (bm25s) over the passages
  warm-start:mean   the off-the-shelf warm-start encoder (`warm_start.path`) in its own mode (mean
                    pooling, normalised as its sentence-transformers folder says): a reference
  init              the encoder before any pre-training (models/init/encoder)
  retromae          RetroMAE-pretrained encoder, zero-shot
  mlm               plain-MLM-pretrained encoder, same compute (skipped when mlm.enabled is false)
  ict               realm.ict_steps > 0: the retriever after ICT, before any REALM step (models/realm/ict_retriever)
  realm             pretrain_realm@refreshed: its retriever over its final index
  realm-stale       pretrain_realm@stale (refreshed realm.stale_factor x less often): its own retriever and final index
  ft:<start>        the bi-encoder fine-tuned from each start on the largest `finetune.train_sizes`
                    (models/finetune/retriever/<start>-<size>); ft:<start>@<size> the smaller sizes
  qa:<system>       open-QA EM/F1, one reader per system trained with one recipe (models/finetune/open_qa/<system>):
                    qa:closed-book (null document only), qa:bm25, qa:realm, qa:realm-stale (each arm's own index)
The rows themselves: components/eval/rows.py.
Outputs: metrics/eval.json (dvc metrics: {set: {system: metrics}}, `split`, `comparisons`,
`label_efficiency` and `label_efficiency_tests`: the curve's points and its per-size paired tests,
components/eval/curve.py), metrics/eval/<set>/<system>.jsonl (per query; `:` -> `_` in file names),
metrics/eval/results.{md,html}, comparisons.csv + PNGs (label_efficiency.png: the curve),
plots/recall_at_k.csv and plots/label_efficiency.csv (dvc plots). With no question in any set (a corpus of
prose), every output is still written: no rows, and a report that says so (`nothing_to_score`).
"""

from __future__ import annotations

import csv
import logging

import torch

from components.config import Params
from components.config_stages import REALM_ARMS
from components.data.finetune_data import load_pairs
from components.data.tokenize import load_tokenizer
from components.eval.comparisons import paper_comparisons, run_comparisons
from components.eval.curve import curve_points, size_tests
from components.eval.headline import write_headline
from components.eval.report import curve_csv, recall_by_system, recall_csv, report_markdown, write_report
from components.eval.rows import eval_sets, qa_rows, retrieval_rows
from components.io import write_json_atomic, write_text_atomic
from components.paths import CORPUS, METRICS, PLOTS, TOKENS, loss_curve
from components.training.precision import autocast_for

log = logging.getLogger(__name__)

# realm.retriever_init -> the zero-shot row REALM's retriever starts from (ict / random: random towers, no row)
REALM_START_ROW = {"retromae": "retromae"}


def title_line(params: Params) -> str:
    """The report's first line: which split it reports and, with `evaluate.banner: auto` and no
    warm start (encoders trained from scratch), that the run is a smoke test."""
    ev = params.evaluate
    banner = ev.banner
    if banner == "auto":
        world = " on a synthetic world" if params.data.source == "synthetic" else ""
        banner = ("" if params.warm_start.path is not None else
                  f"tiny preset: a smoke test{world}, encoders trained from scratch (warm_start.path: null); "
                  "the default `make run` trains on real text")
    return f"{banner} | evaluate.split: {ev.split}" if banner else f"evaluate.split: {ev.split}"


def nothing_to_score(params: Params) -> str:
    """What the report says when no set has a question (a corpus of prose: `data.source` txt / jsonl /
    an HF text dataset): the run is pre-training only, and how to score its models."""
    split = params.evaluate.split
    return (f"nothing to score: the {split} split has no questions (data/corpus/beir/qrels/{split}.tsv is empty) and "
            "evaluate.extra_sets is empty. The pre-trained models are in models/ and logged to MLflow; to score them, "
            "add a BEIR folder with queries and qrels to evaluate.extra_sets (docs/usage.md), or train on a source "
            "with questions (a BEIR folder, or an HF dataset in SQuAD's schema)")


def training_curves() -> dict[str, list[tuple[float, float]]]:
    """The pre-training stages' loss curves, from their DVC outs (`paths.loss_curve`): the figure
    follows the models this evaluate reads, never whatever ran last in the MLflow store."""
    curves = {}
    for stage in ("pretrain_retromae", "pretrain_mlm", *(f"pretrain_realm@{arm}" for arm in REALM_ARMS)):
        path = loss_curve(stage)
        if path.exists():
            with path.open(newline="") as f:
                curves[f"{stage} loss"] = [(float(r["step"]), float(r["loss"])) for r in csv.DictReader(f)]
    return {k: v for k, v in curves.items() if v}


def evaluate(params: Params, run=None) -> dict:
    tokenizer = load_tokenizer(TOKENS / "tokenizer")
    out_dir = METRICS / "eval"
    rows: list[dict] = []
    comparisons: list[dict] = []
    ft = params.finetune
    paper = paper_comparisons(REALM_START_ROW.get(params.realm.retriever_init),
                              [n for n in ft.train_sizes if n != ft.largest_size()])
    # the encoders and readers evaluate on the CPU (HFEncoder, OpenQA.from_pretrained), in
    # compute.precision: bf16 is ~2.5x faster than fp32 on most CPUs with AVX512-BF16 or AMX, slower elsewhere (bf16_if_faster)
    with torch.inference_mode(), autocast_for(params.compute.precision, "cpu"):
        for es in eval_sets(params, tokenizer):
            if es.beir is not None and es.beir.queries:
                rows += retrieval_rows(params, es, tokenizer, out_dir)
            rows += qa_rows(params, es, tokenizer, out_dir)
            comparisons += run_comparisons(out_dir, es.name, paper)
    title = title_line(params)
    note = None if rows else nothing_to_score(params)
    if note:
        log.warning("%s", note)
    train = CORPUS / "beir/qrels/train.tsv"
    n_train = len(load_pairs(CORPUS, "train", with_answers=False)) if train.exists() else 0  # what `all` trains on
    points, tests = curve_points(rows, ft, n_train), size_tests(comparisons, ft, n_train)
    write_report(out_dir, rows, training_curves(), title=title, comparisons=comparisons, label_efficiency=points,
                 size_tests=tests, note=note)
    write_text_atomic(PLOTS / "recall_at_k.csv", recall_csv(recall_by_system(rows)))  # a dvc.yaml out: the header alone with no retrieval row
    write_text_atomic(PLOTS / "label_efficiency.csv", curve_csv(points))  # a dvc.yaml out: written with no fine-tune too
    table: dict = {}
    for r in rows:
        table.setdefault(r["dataset"], {})[r["system"]] = {k: v for k, v in r.items() if k not in ("dataset", "system")}
    write_json_atomic(METRICS / "eval.json", {**table, "split": params.evaluate.split, "comparisons": comparisons,
                                              "label_efficiency": points, "label_efficiency_tests": tests,
                                              **({"note": note} if note else {})})
    write_headline(METRICS / "headline", table, params.evaluate.recall_at, METRICS)  # what `dvc metrics show` prints
    report = report_markdown(rows, title, comparisons, size_tests=tests, note=note)
    print(report)
    return {"rows": rows, "table": table, "comparisons": comparisons, "label_efficiency": points,
            "label_efficiency_tests": tests, "report": report}
