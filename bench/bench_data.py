"""Data-stage throughput: prepare_corpus (docs/s) and tokenize (tokens/s) on real prose, num_proc 1 vs 2.

    .venv/bin/python bench/bench_data.py                      # ../shared/data/prose/*.jsonl when present
    .venv/bin/python bench/bench_data.py --path my.jsonl --rounds 3

Arms run interleaved (num_proc 1, 2, 1, 2, ...); medians. Writes bench/results/data.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.config_stages import DataParams, TokenizeParams  # noqa: E402
from components.data.prepare import prepare_corpus  # noqa: E402
from components.data.tokenize import tokenize_corpus  # noqa: E402
from components.io import write_text_atomic  # noqa: E402

DEFAULT = ROOT.parent / "shared/data/prose/python311_docs_paragraphs.jsonl"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", type=Path, default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench/results/data.json"))
    args = ap.parse_args(argv)
    if not args.path.exists():
        raise SystemExit(f"{args.path}: not found (pass --path to a .jsonl corpus)")
    res: dict = {"path": str(args.path), "prepare": [], "tokenize": {1: [], 2: []}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            card = prepare_corpus(DataParams(source="jsonl", path=str(args.path), jsonl_fields={"text": "text", "title": None, "id": "id"}), tmp / "corpus")
            res["prepare"].append(time.perf_counter() - t0)
            for n in (1, 2):
                # the block lengths of the earlier results (params/tiny.yaml's), not the default's 62 / 254
                tp = TokenizeParams(num_proc=n, vocab_size=8000, pretrain_block_len=126, retrieval_block_len=64)
                tc = tokenize_corpus(tp, tmp / "corpus", tmp / f"tokens{n}")
                res["tokenize"][n].append(tc)
    docs = card["passages"]
    prep = statistics.median(res["prepare"])
    tok = {n: statistics.median(c["seconds"]["tokenize"] for c in cards) for n, cards in res["tokenize"].items()}
    tokens = res["tokenize"][1][0]["tokens"]
    summary = {"passages": docs, "duplicates_dropped": card["dedupe"]["duplicates_dropped"], "tokens": tokens,
               "prepare_s": round(prep, 2), "prepare_docs_per_s": round(docs / prep, 1),
               "tokenize_s": {str(n): round(t, 2) for n, t in tok.items()},
               "tokenize_tokens_per_s": {str(n): round(tokens / t, 0) for n, t in tok.items()},
               "num_proc_speedup_2_over_1": round(tok[1] / tok[2], 3),
               "tokenizer_train_s": res["tokenize"][1][0]["seconds"]["tokenizer"],
               "pack_s": res["tokenize"][1][0]["seconds"]["pack"]}
    write_text_atomic(args.out, json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
