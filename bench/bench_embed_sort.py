"""Length bucketing when embedding retrieval blocks (issue 27): `embed_blocks` as the pipeline runs it
(rows longest first, each batch padded to its own longest row) against the same call in the blocks'
own order (`length=None`: each batch padded to the longest of a random mix), interleaved, medians.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_embed_sort.py       # -> bench/results/embed_sort.json
    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_embed_sort.py --rounds 5 --precisions fp32

The corpus is the shipped one the `small` preset reads (params/small.yaml: data.path, its
retrieval_block_len 254 and evaluate.passage_len / batch_size), prepared and tokenized by the real
stage bodies into a temporary folder; the encoder is the MiniLM warm start, [CLS] pooled as dense
eval's `HFEncoder`. bf16 (autocast) runs only where the CPU has native bf16, unless named in
`--precisions`. Besides seconds, the padded tokens each order feeds the encoder (load-independent),
and how far the two orders' vectors are apart (max |diff|, min cosine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_mfu import cpu_model, git_commit  # noqa: E402
from components.config import load_params  # noqa: E402
from components.eval.dense import HFEncoder, add_specials  # noqa: E402
from components.index.embed import embed_blocks, length_order, row_length  # noqa: E402
from components.io import write_json_atomic  # noqa: E402
from components.training.precision import cpu_has_native_bf16  # noqa: E402

ARMS = ("given_order", "bucketed")  # baseline first


def prepare_and_tokenize(tmp: Path, presets: list[Path]):
    """(params, warm-start folder): the corpus of params.yaml + `presets` through the real prepare_corpus
    and tokenize_corpus into `tmp`/corpus and `tmp`/tokens."""
    from components.data.prepare import prepare_corpus
    from components.data.tokenize import tokenize_corpus
    from components.models.encoder import warm_start_path

    p = load_params(ROOT / "params.yaml", presets=presets)
    cwd = os.getcwd()
    os.chdir(ROOT)  # data.path is relative to the repo root
    try:
        prepare_corpus(p.data, tmp / "corpus")
    finally:
        os.chdir(cwd)
    warm = warm_start_path(p)
    tokenize_corpus(p.tokenize, tmp / "corpus", tmp / "tokens", warm_start=warm)
    return p, warm


def shipped_blocks(tmp: Path, presets: list[Path] | None = None):
    """(params, warm-start folder, block token rows, tokenizer) of params.yaml + `presets` (default:
    the small preset's)."""
    import datasets

    from components.data.tokenize import load_tokenizer

    p, warm = prepare_and_tokenize(tmp, [ROOT / "params/small.yaml"] if presets is None else presets)
    blocks = datasets.load_from_disk(str(tmp / "tokens" / "blocks"))
    return p, warm, [list(r) for r in blocks["input_ids"]], load_tokenizer(tmp / "tokens" / "tokenizer")


def padded_tokens(rows: list[list[int]], order: np.ndarray, batch_size: int, max_len: int) -> int:
    """Tokens the encoder sees (batch x its widest `[CLS] row [SEP]`) when batches are cut from `order`."""
    lens = np.minimum(np.array([len(r) for r in rows]) + 2, max_len)[order]
    return int(sum(len(lens[i : i + batch_size]) * lens[i : i + batch_size].max() for i in range(0, len(lens), batch_size)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precisions", nargs="+", default=None, help="fp32 / bf16 (default: fp32, + bf16 where native)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/embed_sort.json")
    args = ap.parse_args(argv)
    native = cpu_has_native_bf16()
    precisions = args.precisions or (["fp32", "bf16"] if native else ["fp32"])
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        p, warm, rows, tok = shipped_blocks(Path(tmp))
    enc = HFEncoder.load(warm)
    max_len, bs = p.evaluate.passage_len, p.evaluate.batch_size
    specials = (tok.cls_token_id, tok.sep_token_id, tok.pad_token_id, max_len)

    def embed(arm: str, precision: str) -> tuple[float, np.ndarray]:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            emb, _ = embed_blocks(lambda b: enc(*b), rows, bs, lambda rs: add_specials(rs, *specials), progress=False,
                                  length=None if arm == "given_order" else row_length)
        return time.perf_counter() - t0, emb

    given = np.arange(len(rows))
    tokens = {"given_order": padded_tokens(rows, given, bs, max_len),
              "bucketed": padded_tokens(rows, length_order(rows), bs, max_len),
              "real": int(sum(min(len(r) + 2, max_len) for r in rows))}
    print(f"{len(rows)} blocks, mean {np.mean([len(r) for r in rows]):.1f} tokens, batch {bs}, max_len {max_len}; "
          f"threads={torch.get_num_threads()} cpu={cpu_model()!r} native_bf16={native} load={load_start}")
    res: dict = {"precisions": {}}
    for precision in precisions:
        embed("bucketed", precision)  # warm-up: oneDNN picks its kernels on the first calls
        times: dict[str, list[float]] = {a: [] for a in ARMS}
        vecs: dict[str, np.ndarray] = {}
        for r in range(args.rounds):  # interleaved, the order alternating, so load drift hits both arms
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                s, vecs[arm] = embed(arm, precision)
                times[arm].append(s)
            print(f"  {precision} round {r + 1}: " + ", ".join(f"{a} {times[a][-1]:.2f}s" for a in ARMS), flush=True)
        a, b = vecs["given_order"], vecs["bucketed"]
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        med = {k: statistics.median(v) for k, v in times.items()}
        res["precisions"][precision] = {
            "seconds": times, "median_s": med, "speedup": med["given_order"] / med["bucketed"],
            "max_abs_diff": float(np.abs(a - b).max()), "min_cosine": float(cos.min())}
    res.update(
        blocks=len(rows), batch_size=bs, max_len=max_len, padded_tokens=tokens,
        padded_token_ratio=tokens["given_order"] / tokens["bucketed"],
        env={"cpu": cpu_model(), "native_bf16": native, "threads": torch.get_num_threads(),
             "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "loadavg_start": load_start,
             "loadavg_end": os.getloadavg(), "commit": git_commit(), "rounds": args.rounds})
    write_json_atomic(args.out, res)
    print(f"\npadded tokens: given order {tokens['given_order']:,}, bucketed {tokens['bucketed']:,}, "
          f"real {tokens['real']:,} (given / bucketed {res['padded_token_ratio']:.2f}x)")
    print("| precision | given order (s) | bucketed (s) | speed-up | max abs diff | min cosine |")
    print("|---|---:|---:|---:|---:|---:|")
    for precision, r in res["precisions"].items():
        print(f"| {precision} | {r['median_s']['given_order']:.2f} | {r['median_s']['bucketed']:.2f} | "
              f"{r['speedup']:.2f}x | {r['max_abs_diff']:.2e} | {r['min_cosine']:.6f} |")
    print(f"-> {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
