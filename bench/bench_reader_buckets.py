r"""Length bucketing in the open-QA reader (issue 27): `OpenQA` reading a batch's B*K `[CLS] x [SEP] z [SEP]`
rows in one forward at the batch's width (`finetune.reader_chunk_rows: 0`, the reference) against
length-sorted chunks of a few rows, each at its own width. Interleaved rounds, medians.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_reader_buckets.py     # -> bench/results/reader_buckets.json
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_reader_buckets.py --questions 60 --chunks 0 16 --precisions fp32
    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_reader_buckets.py --questions 694 --chunks --eval-batches 8 128 \
        --train-steps 0 --precisions bf16 --out bench/results/reader_eval_batches.json    # questions per batch

The corpus is the shipped one the default reads (params.yaml `data.path`), prepared and tokenized by the
real stage bodies into a temporary folder; the questions are the first `--questions` of the evaluated split
(`evaluate.split`) with their BM25 top `finetune.qa_top_k` blocks (the bm25 system of open QA), read as
`OpenQAPredictor.predict_all` does (`predict_batch` over batches of `--eval-batch` questions; evaluate reads
`evaluate.qa_batch_size`, which `--eval-batches` compares). The reader is the MiniLM warm
start with a fresh span head (speed does not depend on trained weights). bf16 (autocast) runs only where
the CPU has native bf16, unless named in `--precisions`. Besides seconds: the tokens each setting feeds the
BERT (load-independent), and how far the chunked answers are from the reference's (same answer, max |diff|
of its score). Last, the training steps of the reader's two phases (forward + backward: the own-paragraph
phase, `finetune.qa_gold_batch_size` questions with one block each, and the top-k phase,
`finetune.qa_train.batch_size` questions), with the Trainer's dropout masks, for each of `--train-arms`:
one forward (rows:0), chunks of N rows (`finetune.reader_chunk_rows`), or of about N tokens
(`compute.length_chunk_tokens`, which the Trainer sets on the reader and which takes its place):

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_reader_buckets.py --questions 8 --chunks 0 --train-steps 4 \
        --train-arms rows:2 rows:4 rows:8 tokens:512 tokens:1024 --out bench/results/reader_train_chunks.json
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_embed_sort import prepare_and_tokenize  # noqa: E402
from bench.bench_mfu import cpu_model, git_commit  # noqa: E402
from components.io import write_json_atomic  # noqa: E402
from components.training.precision import cpu_has_native_bf16  # noqa: E402


def shipped_qa(tmp: Path, n_questions: int):
    """The default's blocks, tokenizer and the first `n_questions` of the evaluated split with their BM25
    top k (and 64 training questions drawn at random with theirs, and with their own paragraph: the reader's
    two phases)."""
    import datasets

    from components.data.finetune_data import load_qa
    from components.data.tokenize import load_tokenizer
    from components.retrieval.search import bm25_qa_blocks, gold_qa_blocks

    p, warm = prepare_and_tokenize(tmp, [])
    blocks = [dict(r) for r in datasets.load_from_disk(str(tmp / "tokens" / "blocks"))]  # in memory: time the reader, not Arrow
    texts = [b["text"] for b in blocks]
    rows = bm25_qa_blocks(load_qa(tmp / "corpus", p.evaluate.split)[:n_questions], p.finetune.qa_top_k, block_texts=texts)
    train_qa = random.Random(0).sample(load_qa(tmp / "corpus", "train"), 64)  # as the Trainer draws them: across articles
    train_rows = bm25_qa_blocks(train_qa, p.finetune.qa_top_k, block_texts=texts)
    gold_rows = gold_qa_blocks(train_qa, [b["doc_id"] for b in blocks], texts)
    return p, warm, blocks, rows, (train_rows, gold_rows), load_tokenizer(tmp / "tokens" / "tokenizer")


def fed_tokens(masks: list[torch.Tensor], chunk_rows: int) -> int:
    """Tokens the BERT sees over these batches' (N, L) masks: N x L at 0, else each chunk x its width."""
    from components.models.encoder import length_chunks

    if chunk_rows <= 0:
        return sum(m.numel() for m in masks)
    return sum(len(rows) * width for m in masks for rows, width in length_chunks(m, chunk_rows)[1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunks", type=int, nargs="*", default=[0, 4, 8, 16, 40], help="reader_chunk_rows; 0 (the reference) "
                    "first; none: no chunk arms (with --eval-batches)")
    ap.add_argument("--eval-batch", type=int, default=8, help="questions per batch of the --chunks arms (8: the "
                    "batches results/reader_buckets.json was measured with; evaluate reads evaluate.qa_batch_size)")
    ap.add_argument("--eval-batches", type=int, nargs="*", default=[], help="also time these questions per batch "
                    "against each other, all at finetune.reader_chunk_rows (the first is the reference)")
    ap.add_argument("--precisions", nargs="+", default=None, help="fp32 / bf16 (default: bf16 where native, + fp32)")
    ap.add_argument("--fp32-chunks", type=int, nargs="+", default=None, help="chunks timed in fp32 besides 0 (default: --chunks)")
    ap.add_argument("--fp32-rounds", type=int, default=None, help="rounds in fp32 (default: --rounds)")
    ap.add_argument("--train-steps", type=int, default=3, help="timed training steps per setting (0: none)")
    ap.add_argument("--train-arms", nargs="+", default=None, help="how the timed training step chunks its rows, "
                    "against one forward (rows:0): rows:N (reader_chunk_rows) or tokens:N (compute.length_chunk_tokens, "
                    "which the Trainer sets; default: params.yaml's two)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/reader_buckets.json")
    args = ap.parse_args(argv)
    if args.chunks and args.chunks[0] != 0:
        args.chunks = [0, *[c for c in args.chunks if c != 0]]
    native = cpu_has_native_bf16()
    precisions = args.precisions or (["bf16", "fp32"] if native else ["fp32"])
    load_start = os.getloadavg()

    from components.data.qa_batch import QACollator
    from components.models.reader import OpenQA, SpanReader

    with tempfile.TemporaryDirectory() as tmp:
        p, warm, blocks, rows, train_rows, tok = shipped_qa(Path(tmp), args.questions)
    ft = p.finetune
    torch.manual_seed(0)
    reader = SpanReader.from_pretrained(warm, span_scorer=ft.span_scorer, span_hidden=ft.span_hidden)
    model = OpenQA(None, reader, ft.max_answer_tokens, ft.span_softmax).eval()
    collate = QACollator.from_params(tok, blocks, None, ft)

    def batched(qs: int) -> tuple[list[dict], list]:
        bs = [collate(rows[i : i + qs]) for i in range(0, len(rows), qs)]
        return bs, [[[None if r < 0 else blocks[int(r)]["text"] for r in b] for b in batch["candidate_rows"].tolist()] for batch in bs]

    batches, texts = batched(args.eval_batch)
    masks = [b["attention_mask"].flatten(0, 1) for b in batches]  # (B*K, L) each
    tokens = {str(c): fed_tokens(masks, c) for c in args.chunks}
    by_batch = {}  # would more questions per evaluate batch sort better? (tokens only, load-independent)
    for qs in sorted({8, 16, 32, 128, args.eval_batch, *args.eval_batches}):
        m = [collate(rows[i : i + qs])["attention_mask"].flatten(0, 1) for i in range(0, len(rows), qs)]
        by_batch[qs] = {str(c): fed_tokens(m, c) for c in sorted({*args.chunks, ft.reader_chunk_rows})}
    real = int(sum(int(m.sum()) for m in masks))
    widths = [m.shape[1] for m in masks]
    print(f"{len(rows)} questions x top {ft.qa_top_k}, batches of {args.eval_batch} ({len(batches)}), widths "
          f"{min(widths)}-{max(widths)} (mean {np.mean(widths):.0f}), mean row {real / sum(m.shape[0] for m in masks):.0f} "
          f"tokens; threads={torch.get_num_threads()} cpu={cpu_model()!r} native_bf16={native} load={load_start}")

    def read(chunk_rows: int, precision: str, these: tuple[list, list] | None = None) -> tuple[float, list[dict]]:
        model.reader_chunk_rows = chunk_rows
        out = []
        t0 = time.perf_counter()
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            for batch, tx in zip(*(these or (batches, texts))):
                out += model.predict_batch(batch, tx)
        return time.perf_counter() - t0, out

    res: dict = {"precisions": {}}
    for precision in precisions if args.chunks else []:
        chunks = args.chunks if precision != "fp32" or args.fp32_chunks is None else [0, *[c for c in args.fp32_chunks if c]]
        read(chunks[-1], precision)  # warm-up: oneDNN picks its kernels on the first calls
        times: dict[str, list[float]] = {str(c): [] for c in chunks}
        preds: dict[str, list[dict]] = {}
        rounds = args.fp32_rounds if precision == "fp32" and args.fp32_rounds else args.rounds
        for r in range(rounds):  # interleaved, the order alternating, so load drift hits every arm
            for c in (chunks if r % 2 == 0 else chunks[::-1]):
                s, preds[str(c)] = read(c, precision)
                times[str(c)].append(s)
            print(f"  {precision} round {r + 1}: " + ", ".join(f"{c}: {times[c][-1]:.1f}s" for c in times), flush=True)
        med = {c: statistics.median(v) for c, v in times.items()}
        ref = preds["0"]
        res["precisions"][precision] = {"seconds": times, "median_s": med, "arms": {c: {
            "speedup": med["0"] / med[c],
            "same_answer": sum(a["answer"] == b["answer"] for a, b in zip(preds[c], ref)) / len(ref),
            "max_abs_score_diff": max(abs(a["score"] - b["score"]) for a, b in zip(preds[c], ref)
                                      if np.isfinite(a["score"]) and np.isfinite(b["score"]))} for c in times}}

    if args.eval_batches:  # questions per batch, at the default's chunk rows: the same answers, fewer padded tokens
        precision, chunk = precisions[0], ft.reader_chunk_rows
        sets = {qs: batched(qs) for qs in args.eval_batches}
        read(chunk, precision, sets[args.eval_batches[-1]])  # warm-up
        et: dict[int, list[float]] = {qs: [] for qs in sets}
        epreds: dict[int, list[dict]] = {}
        for r in range(args.rounds):
            for qs in (args.eval_batches if r % 2 == 0 else args.eval_batches[::-1]):
                s_, epreds[qs] = read(chunk, precision, sets[qs])
                et[qs].append(s_)
            print(f"  {precision} questions per batch, round {r + 1}: " + ", ".join(f"{q}: {et[q][-1]:.1f}s" for q in et), flush=True)
        emed = {qs: statistics.median(v) for qs, v in et.items()}
        ref_qs = args.eval_batches[0]
        res["eval_batches"] = {"precision": precision, "reader_chunk_rows": chunk, "seconds": {str(q): v for q, v in et.items()},
                               "median_s": {str(q): m for q, m in emed.items()},
                               "speedup": {str(q): emed[ref_qs] / m for q, m in emed.items()},
                               "fed_tokens": {str(q): by_batch[q][str(chunk)] for q in sets},
                               "same_answer": {str(q): sum(a["answer"] == b["answer"] for a, b in zip(epreds[q], epreds[ref_qs]))
                                               / len(rows) for q in sets}}

    train = {}
    if args.train_steps:
        from components.models.ops.dropout import fast_dropout_masks, use_fast_dropout

        if fast_dropout_masks(p.compute.dropout_masks, torch.device("cpu")):  # the Trainer's swap: the stages' step
            use_fast_dropout(model)
        model.train()
        precision = precisions[0]
        arms = ["rows:0", *[a for a in (args.train_arms or [f"rows:{ft.reader_chunk_rows}",
                                                             f"tokens:{p.compute.length_chunk_tokens}"]) if a != "rows:0"]]
        train_qa, gold_qa = train_rows
        gold_collate = QACollator.from_params(tok, blocks, None, ft, top_k=1)

        def steps_of(collate_fn, qa: list[dict], bs: int) -> tuple[int, list[dict]]:
            return bs, [collate_fn(qa[i : i + bs]) for i in range(0, bs * args.train_steps, bs)]

        # the own-paragraph phase (one block per question), then the top-k phase
        phases = {"gold": steps_of(gold_collate, gold_qa, ft.qa_gold_batch_size),
                  "top_k": steps_of(collate, train_qa, ft.qa_train.batch_size)}

        def step(arm: str, tb: list[dict]) -> float:
            kind, _, n = arm.partition(":")
            if kind not in ("rows", "tokens") or not n.isdigit():
                raise SystemExit(f"--train-arms: {arm!r} is not rows:N or tokens:N")
            model.reader_chunk_rows, model.length_chunk_tokens = (int(n), 0) if kind == "rows" else (0, int(n))
            t0 = time.perf_counter()
            for batch in tb:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss = model(batch)["loss"]
                loss.backward()
                model.zero_grad(set_to_none=True)
            return (time.perf_counter() - t0) / len(tb)

        for phase, (bs, tb) in phases.items():
            step(arms[-1], tb)  # warm-up
            tt: dict[str, list[float]] = {c: [] for c in arms}
            for r in range(args.rounds):
                for c in (arms if r % 2 == 0 else arms[::-1]):
                    tt[c].append(step(c, tb))
                print(f"  train {phase} {precision} round {r + 1}: " + ", ".join(f"{c}: {tt[c][-1]:.2f}s/step" for c in tt), flush=True)
            tmed = {c: statistics.median(v) for c, v in tt.items()}
            train[phase] = {"precision": precision, "batch_size": bs, "steps": len(tb), "seconds_per_step": tt,
                            "median_s": tmed, "speedup": {c: tmed["rows:0"] / m for c, m in tmed.items()}}

    res.update(
        questions=len(rows), top_k=ft.qa_top_k, eval_batch=args.eval_batch, fed_tokens=tokens, real_tokens=real,
        fed_tokens_by_eval_batch=by_batch,
        fed_token_ratio={c: tokens["0"] / t for c, t in tokens.items()} if tokens else {}, train=train,
        env={"cpu": cpu_model(), "native_bf16": native, "threads": torch.get_num_threads(),
             "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "loadavg_start": load_start,
             "loadavg_end": os.getloadavg(), "commit": git_commit(), "rounds": args.rounds,
             "fp32_rounds": args.fp32_rounds or args.rounds})
    write_json_atomic(args.out, res)
    if tokens:
        print("\ntokens fed to the BERT: " + ", ".join(f"{c}: {t:,} ({tokens['0'] / t:.2f}x fewer)" for c, t in tokens.items())
              + f"; real {real:,}")
    print("tokens fed by questions per evaluate batch: " + "; ".join(
        f"{qs}: " + ", ".join(f"{c}: {t:,}" for c, t in v.items()) for qs, v in by_batch.items()))
    print("| precision | reader_chunk_rows | median (s) | speed-up vs 0 | per round | same answer | max abs score diff |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for precision, r in res["precisions"].items():
        for c, arm in r["arms"].items():
            per = ", ".join(f"{r['seconds']['0'][i] / s:.2f}" for i, s in enumerate(r["seconds"][c]))
            print(f"| {precision} | {c} | {r['median_s'][c]:.1f} | {arm['speedup']:.2f}x | {per} | "
                  f"{arm['same_answer']:.3f} | {arm['max_abs_score_diff']:.2e} |")
    if "eval_batches" in res:
        e = res["eval_batches"]
        print(f"questions per batch ({e['precision']}, chunks of {e['reader_chunk_rows']} rows): " + ", ".join(
            f"{q}: {m:.1f}s ({e['speedup'][q]:.2f}x, {e['fed_tokens'][q]:,} tokens, same answer {e['same_answer'][q]:.3f})"
            for q, m in e["median_s"].items()))
    for phase, t in train.items():
        print(f"training step, {phase} phase ({t['precision']}, {t['batch_size']} questions): " + ", ".join(
            f"{c}: {m:.2f}s ({t['speedup'][c]:.2f}x)" for c, m in t["median_s"].items()))
    print(f"-> {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
