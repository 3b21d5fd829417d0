"""The evaluate stage's rows, as a library: the evaluation sets and every system's retrieval or
open-QA row on one set, each with its per-query file (`comparisons.per_query_path`).

    sets = eval_sets(params, tokenizer)                        # the `evaluate.split` set + evaluate.extra_sets
    rows = retrieval_rows(params, sets[0], tokenizer, out)     # bm25, warm-start:*, init, retromae, mlm, ict, realm, realm-stale, ft:*
    rows += qa_rows(params, sets[0], tokenizer, out)           # qa:closed-book, qa:bm25, qa:realm, qa:realm-stale

`realm` and `realm-stale` are the two `pretrain_realm` arms, each its own towers over its own final
index; `ict` (when realm.ict_steps > 0) the refreshed arm's retriever after ICT, before any REALM
step. `ft:<start>` is the bi-encoder fine-tuned on the largest `finetune.train_sizes`;
`ft:<start>@<size>` the smaller sizes (RetroMAE's label-efficiency curve).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import datasets

from components.config import Params
from components.data.beir import load_beir, read_qa
from components.data.tokenize import split_retrieval_blocks, tokenize_passages
from components.eval.comparisons import ft_row, per_query_path
from components.eval.dense import (HFEncoder, PoolingViews, dense_run, same_function, sentence_transformers_mode, shared_dense_runs,
                                   tokenize_texts)
from components.eval.metrics import exact_match, f1, qa_metrics, retrieval_metrics
from components.io import write_jsonl_atomic
from components.models.encoder import warm_start_path
from components.paths import (CORPUS, FINETUNE_RETRIEVERS, ICT_RETRIEVER, INIT_ENCODER, MLM_ENCODER, REALM_OUT, REALM_SYSTEM_OUT,
                              RETROMAE_ENCODER, TOKENS)
from components.retrieval.bm25 import BM25Retriever

log = logging.getLogger(__name__)

MAIN_SET = "main"
FT_ORDER = ("init", "mlm", "retromae", "realm")  # ft:* rows in this order, then any others by name


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


# ----------------------------------------------------------------------------------------------
# systems
# ----------------------------------------------------------------------------------------------
def finetuned_systems(ft, folder: Path = FINETUNE_RETRIEVERS) -> dict[str, Path]:
    """{row: folder} of the bi-encoders the finetune_retriever stages wrote (retriever/<start>-<size>/),
    in table order: `ft:<start>` for the largest of `finetune.train_sizes`, `ft:<start>@<size>` for the others."""
    top = str(ft.largest_size())
    found = []
    for p in (folder.iterdir() if folder.is_dir() else []):
        start, _, size = p.name.rpartition("-")
        if start and (p / "config.json").exists():
            found.append((start, size, p))
    order = lambda t: (FT_ORDER.index(t[0]) if t[0] in FT_ORDER else len(FT_ORDER), t[0], t[1] != top,  # noqa: E731
                       int(t[1]) if t[1].isdigit() else 0)
    return {ft_row(s, n, top): p for s, n, p in sorted(found, key=order)}


def _encoder_systems() -> dict[str, Path]:
    """name -> encoder folder ([CLS] pooling, the pipeline's tokenizer); only systems whose model exists."""
    systems = {name: folder for name, folder in (("init", INIT_ENCODER), ("retromae", RETROMAE_ENCODER), ("mlm", MLM_ENCODER))
               if (folder / "config.json").exists()}
    return systems


def _realm_retriever(arm: Path, sub: str = "retriever"):
    from components.models.retriever import Retriever

    folder = arm / sub
    if not folder.exists():
        return None
    r = Retriever.from_pretrained(folder).eval()
    # the passage tower takes token types for `realm.doc_input: title_body` (None: all type 0)
    return (lambda ids, mask: r.encode_query(ids, mask)), (lambda ids, mask, types=None: r.encode_passage(ids, mask, types))


def _realm_index(arm: Path):
    from components.index.faiss_index import BlockIndex

    folder = arm / "index" / "final"
    return BlockIndex.load(folder) if folder.exists() else None


def warm_start_system(params: Params, blocks):
    """(row name, encoder, its own tokenizer, the blocks re-tokenised with it), or None without a
    warm start. The reference row reads text the way the off-the-shelf model was trained to."""
    spec = warm_start_path(params)
    if spec is None or blocks is None or "text" not in blocks.column_names:
        return None
    from transformers import AutoTokenizer

    pooling, normalize = sentence_transformers_mode(spec) if Path(spec).is_dir() else ("mean", False)
    tok = AutoTokenizer.from_pretrained(spec)
    own = {"input_ids": tokenize_texts(tok, list(blocks["text"])), "block_id": list(blocks["block_id"]),
           "doc_id": list(blocks["doc_id"])}
    return f"warm-start:{pooling}", HFEncoder.load(spec, pooling=pooling, normalize=normalize), tok, own


def _one_pass(warm, init: HFEncoder, blocks, queries: dict[str, str], tokenizer) -> bool:
    """Whether the warm-start row and `init` read the same token ids with the same weights, so that
    one forward serves both: true when the pipeline's tokenizer is the warm start's and `init` its
    copy. Whole rows are compared, not their truncation: the embedding batches rows by their full
    length, and a batch of another width rounds otherwise."""
    _, enc, tok, own = warm
    specials = lambda t: (t.cls_token_id, t.sep_token_id, t.pad_token_id)  # noqa: E731
    if specials(tok) != specials(tokenizer) or not same_function(enc, init):
        return False
    if [list(r) for r in own["input_ids"]] != [list(r) for r in blocks["input_ids"]]:
        return False
    texts = list(queries.values())
    return tokenize_texts(tok, texts) == tokenize_texts(tokenizer, texts)


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

    warm = warm_start_system(params, es.blocks)
    encoders = _encoder_systems()
    init = HFEncoder.load(encoders.pop("init")) if "init" in encoders else None
    if warm is not None and init is not None and _one_pass(warm, init, es.blocks, queries, tokenizer):
        # `init` is the warm start copied: one forward gives both rows (each its own pooling), and
        # each row's `seconds` is half the shared pass
        t0 = time.perf_counter()
        runs = shared_dense_runs(PoolingViews([warm[1], init]), es.blocks, queries, tokenizer, **dense_kw)
        seconds = (time.perf_counter() - t0) / 2
        log.info("%s and init: the same encoder and inputs, scored from one forward pass", warm[0])
        add(warm[0], runs[0], seconds)
        add("init", runs[1], seconds)
        warm = init = None
    if warm is not None:
        name, enc, tok, own_blocks = warm
        add_dense(name, enc, enc, tok, own_blocks)
    if init is not None:
        add_dense("init", init, init)
    for name, folder in encoders.items():
        enc = HFEncoder.load(folder)
        add_dense(name, enc, enc)

    ict = _realm_retriever(REALM_OUT, ICT_RETRIEVER)  # the ICT-only control: REALM's start (no index: blocks embedded now)
    if ict is not None:
        add_dense("ict", *ict, titles=params.realm.doc_input == "title_body")
    for system, arm in REALM_SYSTEM_OUT.items():  # each arm: its own towers over its own final index
        realm = _realm_retriever(arm)
        if realm is not None:
            eq, ep = realm
            index = _realm_index(arm) if es.is_main else None  # another corpus: its blocks embedded now
            add_dense(system, eq, ep, index=index, titles=params.realm.doc_input == "title_body")

    for system, folder in finetuned_systems(params.finetune).items():
        enc = HFEncoder.load(folder)
        add_dense(system, enc, enc)
    return rows


def reads_digest(system: str, open_qa_dir: Path) -> str:
    """What an open-QA system's predictions are a function of, by content: its trained reader folder
    (reader and query tower) and, for a dense system, its arm's final index (the vectors and ids, not
    the manifest, whose version and time differ between arms); BM25 reads the blocks themselves."""
    import hashlib
    import json

    from components.io import tree_digest

    arm = REALM_SYSTEM_OUT.get(system)
    index = "bm25"
    if arm is not None:
        meta = json.loads((arm / "index" / "final" / "meta.json").read_text())
        index = json.dumps({k: meta.get(k) for k in ("files", "type", "search_params", "dim", "n")}, sort_keys=True)
    return hashlib.sha256(f"{tree_digest(open_qa_dir / system, 'sha256')[0]}\n{index}".encode()).hexdigest()


def qa_rows(params: Params, es: EvalSet, tokenizer, out_dir: Path) -> list[dict]:
    """Open-QA EM/F1 of every `finetune.qa_systems` entry whose reader finetune_reader trained, each over
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
    read: dict[str, tuple[str, dict[str, str]]] = {}  # what a system reads (its digest) -> (system, predictions)
    for system in trained:
        t0 = time.perf_counter()
        key = reads_digest(system, OPEN_QA_OUT)
        if key in read:  # the same reader over the same blocks (two REALM arms that ended alike): the same answers
            first, preds = read[key]
            log.info("qa:%s reads exactly what qa:%s read (the same reader and index): its predictions are those", system, first)
            add(system, dict(preds), time.perf_counter() - t0)
            continue
        if system == "bm25":
            from components.retrieval.search import bm25_over_blocks

            bm25 = bm25_over_blocks(list(es.blocks["text"]))
        qa = OpenQAPredictor.for_system(system, params.finetune, tokenizer, blocks=es.blocks, bm25=bm25,
                                        batch_size=params.evaluate.qa_batch_size)
        preds = qa.predict_all(questions)
        read[key] = (system, preds)
        add(system, preds, time.perf_counter() - t0)
        if "closed-book" in systems and "closed-book" not in results:
            t0 = time.perf_counter()  # any trained reader: with no block there is no span to answer
            add("closed-book", qa.predict_all(questions, closed_book=True), time.perf_counter() - t0)
        del qa
    return [results[s] for s in systems if s in results]


