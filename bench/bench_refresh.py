"""Cost of REALM's index refresh and how much of it the asynchronous refresh hides.

    .venv/bin/python bench/bench_refresh.py                    # data/tokens if present, else a fresh tiny world
    .venv/bin/python bench/bench_refresh.py --reps 5 --steps 40 --refresh-every 10
    .venv/bin/python bench/bench_refresh.py --scale 20         # the knowledge corpus repeated 20x (a bigger index)

Three measurements, contenders interleaved round-robin (the order rotates every repetition, so
drift and other load on the machine hit all alike), median + IQR over `--reps`:

(a) embed: blocks/s of the stage's refresh body (`IndexRefresh.refresh`: HF dataset read,
    `passage_inputs` collation, `encode_passage`, index build, publish) vs a bare
    `retriever.encode_passage(**batch)` loop over the same blocks, pre-collated outside the clock.
    Reported: embed-only blocks/s (the refresh's own stats), end-to-end blocks/s, and their ratios
    to the bare loop (goal: embed ratio >= 0.9).
(b) train: optimiser steps/s of the shared Trainer on REALM with `refresh_every=0` (none), `async`
    and `sync` refreshes every `--refresh-every` steps, and `async_shadow` (async builds that are
    never swapped in, so its batches are exactly none's). The goal's ratio `async_over_none`
    (>= 0.9) is async_shadow/none: the refresh's overhead alone. A swapped-in index retrieves other
    blocks, whose padded length changes the cost of a step (seen: +8% reader tokens), so the
    swapped ratios are also given per padded reader token (`*_over_none_tokens`).
    The clock runs from the end of the initial index build to the end of the last step; the step
    count avoids a build starting at the last step, so no arm is charged a trailing build.
(c) hidden: fraction of async refresh time hidden behind training (AsyncRefresher.timing()).

Results merge into bench/results/refresh.json under "<device>/threads=<n>/scale=<k>".
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.config import load_params  # noqa: E402
from components.data.realm_batch import RealmCollator, SpecialTokens, collate_queries, passage_inputs  # noqa: E402
from components.data.realm_query import eligible_rows, fixed_queries  # noqa: E402
from components.eval.realm_probes import heldout_probes, run_probes  # noqa: E402
from components.index.faiss_index import IndexStore  # noqa: E402
from components.index.realm_refresh import IndexRefresh, RefreshContext  # noqa: E402
from components.index.refresh import snapshot_module  # noqa: E402
from components.io import write_json_atomic  # noqa: E402
from components.models.realm import REALM, KnowledgeAugmentedEncoder  # noqa: E402
from components.models.retriever import Retriever  # noqa: E402
from components.training.trainer import Trainer  # noqa: E402

GOAL = 0.9


def stats(xs: list[float]) -> dict:
    q = np.percentile(xs, [25, 50, 75])
    return {"median": float(q[1]), "q1": float(q[0]), "q3": float(q[2]), "iqr": float(q[2] - q[0]), "values": [float(x) for x in xs]}


def world(tokens: Path | None, tmp: Path) -> Path:
    """data/tokens to read: the given one, or a tiny synthetic world built with params/tiny.yaml."""
    if tokens is not None and (tokens / "blocks").is_dir():
        return tokens
    from components.data.prepare import prepare_corpus
    from components.data.tokenize import tokenize_corpus

    p = load_params(ROOT / "params.yaml", presets=[ROOT / "params/tiny.yaml"])
    prepare_corpus(p.data, tmp / "corpus")
    tokenize_corpus(p.tokenize, tmp / "corpus", tmp / "tokens")
    return tmp / "tokens"


def load_blocks(tokens: Path, scale: int):
    import datasets

    blocks = datasets.load_from_disk(str(tokens / "blocks"))
    if scale > 1:  # a bigger knowledge corpus: the same blocks under new ids
        parts = [blocks.map(lambda r, i=i: {"block_id": f"{r['block_id']}#{i}"}) for i in range(scale)]
        blocks = datasets.concatenate_datasets(parts)
    return blocks


def make_model(params, tokenizer, device) -> REALM:
    from components.models.encoder import build_encoder

    torch.manual_seed(0)
    enc = build_encoder(params.retromae.encoder, len(tokenizer), tokenizer.pad_token_id, cls_token_id=tokenizer.cls_token_id,
                        sep_token_id=tokenizer.sep_token_id, mask_token_id=tokenizer.mask_token_id)
    p = params.realm
    return REALM(Retriever.from_config(enc.config, p.retriever_dim, p.share_towers), KnowledgeAugmentedEncoder(enc), p.marginalization).to(device)


def refresh_context(blocks, params, special, seed: int = 0) -> RefreshContext:
    p = params.realm
    rows = eligible_rows(blocks.select(range(min(len(blocks), 4000))), p, special.mask, seed)
    qs = fixed_queries(blocks, rows[: p.staleness_probes], p, special, seed)
    x = collate_queries(qs, p, special)
    block_ids = np.asarray(blocks["block_id"])
    probes = {"heldout_": heldout_probes(qs, blocks, block_ids, p, special)}
    probe = functools.partial(run_probes, probes=probes, block_ids=block_ids, block_doc=np.asarray(blocks["doc_id"]), k=p.staleness_k)
    return RefreshContext(blocks.select_columns(["input_ids"]), block_ids, p, special,
                          {k: x[k] for k in ("x_input_ids", "x_attention_mask")}, probe)


# ----------------------------------------------------------------------------------------------
# (a) embedding throughput
# ----------------------------------------------------------------------------------------------
def bench_embed(model: REALM, blocks, params, special, reps: int, tmp: Path) -> dict:
    p = params.realm
    snap = snapshot_module(model.retriever)
    dev = next(snap.parameters()).device
    ids = blocks["input_ids"]
    batches = [passage_inputs(ids[i:i + p.embed_batch_size], p, special) for i in range(0, len(ids), p.embed_batch_size)]
    batches = [{k: v.to(dev) for k, v in b.items()} for b in batches]

    def bare() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b in batches:
                snap.encode_passage(**b)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return len(ids) / (time.perf_counter() - t0)

    ctx = refresh_context(blocks, params, special)
    runs = {"bare": [], "refresh_embed": [], "refresh_total": []}
    bare()  # warm-up (allocator, kernels)
    for rep in range(reps):
        order = ["bare", "refresh"] if rep % 2 == 0 else ["refresh", "bare"]
        for arm in order:
            if arm == "bare":
                runs["bare"].append(bare())
            else:
                r = IndexRefresh(ctx, IndexStore(tmp / f"embed-{rep}"))
                _, st = r.refresh(snap, 0, "bench")
                runs["refresh_embed"].append(st["blocks_per_s"])
                runs["refresh_total"].append(len(ids) / st["refresh_seconds"])
    out = {k: stats(v) for k, v in runs.items()}
    bare_med = out["bare"]["median"]
    out["embed_ratio"] = out["refresh_embed"]["median"] / bare_med  # the goal's ratio (bench/run_all.py reads it)
    out["refresh_total_ratio"] = out["refresh_total"]["median"] / bare_med
    out["goal"] = GOAL
    out["n_blocks"] = len(ids)
    return out


# ----------------------------------------------------------------------------------------------
# (b) + (c) training throughput with and without refreshes
# ----------------------------------------------------------------------------------------------
class Clock:
    """Hooks that time the training loop from the end of the initial build to the last step."""

    def __init__(self, refresh: IndexRefresh):
        self.refresh, self.t0, self.t1 = refresh, None, None

    def on_train_start(self, step, trainer):
        self.refresh.on_train_start(step, trainer)
        self.t0 = time.perf_counter()

    def on_step_end(self, step, trainer):
        self.refresh.on_step_end(step, trainer)
        self.t1 = time.perf_counter()


class ShadowRefresh(IndexRefresh):
    """Builds every refresh like the real one but never swaps it in: training keeps retrieving from
    the initial index, so its batches are exactly those of the no-refresh arm. The difference in
    step rate is then the refresh's overhead alone (a swapped-in index changes which blocks are
    retrieved, hence the padded reader length and the cost of a step)."""

    def _on_done(self, res) -> None:
        self._record({"step": res.step, "ok": True, "reason": "cadence", "version": res.stats.get("version")})


class CountingCollator(RealmCollator):
    """Counts the padded reader tokens B * K * (Lx + Lz) of each batch: the reader's cost driver."""

    reader_tokens = 0

    def __call__(self, rows, generator=None):
        b = super().__call__(rows, generator)
        B, K, Lz = b["z_input_ids"].shape
        self.reader_tokens += B * K * (b["x_input_ids"].shape[1] + Lz)
        return b


def train_arm(base: REALM, blocks, rows, params, special, mode: str, every: int, steps: int, tmp: Path) -> dict:
    p = params.realm.model_copy(update={"refresh_every": every if mode != "none" else 0,
                                        "refresh_mode": "sync" if mode.startswith("sync") else "async"})
    train = params.realm.train.model_copy(update={"max_steps": steps, "checkpoint_every": 10 ** 6, "warmup_ratio": 0.0})
    model = copy.deepcopy(base)
    store = IndexStore(tmp / "index")
    ctx = refresh_context(blocks, params, special)
    ctx.p = p
    refresh = (ShadowRefresh if mode.endswith("_shadow") else IndexRefresh)(ctx, store)
    clock = Clock(refresh)
    collator = CountingCollator(blocks, p, special, model.retriever, store.search)
    trainer = Trainer(model, rows, collator, train, params.compute, tmp, hooks={"on_train_start": clock.on_train_start,
                      "on_step_end": clock.on_step_end}, param_prefix="realm.train", progress=False)
    trainer.fit()
    timing = refresh.finish(trainer) if mode != "none" else {}
    seconds = clock.t1 - clock.t0
    return {"steps_per_s": steps / seconds, "reader_tokens_per_s": collator.reader_tokens / seconds, "timing": timing,
            "refreshes": sum(1 for r in refresh.history if r.get("reason") == "cadence" and r.get("ok"))}


def bench_train(base: REALM, blocks, params, special, reps: int, steps: int, every: int, tmp: Path) -> dict:
    rows = eligible_rows(blocks, params.realm, special.mask, 0)
    arms = ["none", "async", "sync", "async_shadow"]
    runs: dict[str, list] = {a: [] for a in arms}
    for rep in range(reps):
        order = arms[rep % len(arms):] + arms[: rep % len(arms)]
        for arm in order:
            runs[arm].append(train_arm(base, blocks, rows, params, special, arm, every, steps, tmp / f"{arm}-{rep}"))
    out = {a: {**stats([r["steps_per_s"] for r in runs[a]]), "refreshes": [r["refreshes"] for r in runs[a]],
               "reader_tokens_per_s": stats([r["reader_tokens_per_s"] for r in runs[a]])} for a in arms}
    # The goal's ratio: async refresh vs none on the SAME batches (shadow: built, never swapped in),
    # i.e. the refresh's overhead. The *_swapped ratios include that a fresh index retrieves other
    # (longer or shorter) blocks, which changes the cost of a step; *_tokens normalise that away.
    out["async_over_none"] = out["async_shadow"]["median"] / out["none"]["median"]
    out["async_over_none_swapped"] = out["async"]["median"] / out["none"]["median"]
    out["sync_over_none"] = out["sync"]["median"] / out["none"]["median"]
    for arm in ("async", "sync"):
        out[f"{arm}_over_none_tokens"] = out[arm]["reader_tokens_per_s"]["median"] / out["none"]["reader_tokens_per_s"]["median"]
    # Paired: the ratio within each repetition (arms run back to back), then the median over
    # repetitions: robust to load that changes between repetitions on a shared machine.
    for arm in ("async_shadow", "async", "sync"):
        out[f"{arm}_over_none_paired"] = stats([a["steps_per_s"] / n["steps_per_s"] for a, n in zip(runs[arm], runs["none"])])
    fr = [r["timing"]["fraction_hidden"] for r in runs["async"] + runs["async_shadow"] if r["timing"].get("build_s")]
    out["fraction_hidden_stats"] = stats(fr) if fr else None
    out["fraction_hidden"] = out["fraction_hidden_stats"]["median"] if fr else None
    out["async_build_s"] = stats([r["timing"]["build_s"] for r in runs["async"]])
    out["async_blocked_s"] = stats([r["timing"]["blocked_s"] for r in runs["async"]])
    out["sync_build_s"] = stats([r["timing"]["build_s"] for r in runs["sync"]])
    out["goal"] = GOAL
    out["steps"], out["refresh_every"] = steps, every
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=Path, default=ROOT / "data/tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=45, help="training steps per arm (not a multiple of --refresh-every)")
    ap.add_argument("--refresh-every", type=int, default=10)
    ap.add_argument("--scale", type=int, default=1, help="repeat the knowledge corpus this many times")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["embed", "train"])
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/refresh.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from components.data.tokenize import load_tokenizer

    params = load_params(ROOT / "params.yaml", presets=[ROOT / "params/tiny.yaml"], overrides={"compute.device": args.device})
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tokens = world(args.tokens, tmp)
        tokenizer = load_tokenizer(tokens / "tokenizer")
        special = SpecialTokens.from_tokenizer(tokenizer)
        blocks = load_blocks(tokens, args.scale)
        device = torch.device(args.device)
        base = make_model(params, tokenizer, device)
        result = {"n_blocks": len(blocks), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
                  "cpu_count": os.cpu_count(), "load_avg_start": os.getloadavg(), "reps": args.reps,
                  "encoder": params.retromae.encoder.model_dump(), "realm": {k: getattr(params.realm, k) for k in
                  ("retriever_dim", "top_k", "query_len", "block_len", "embed_batch_size")}, "batch_size": params.realm.train.batch_size}
        if "embed" not in args.skip:
            result["embed"] = bench_embed(base, blocks, params, special, args.reps, tmp)
            e = result["embed"]
            print(f"(a) embed: bare {e['bare']['median']:.0f} blocks/s, refresh embed {e['refresh_embed']['median']:.0f} "
                  f"(ratio {e['embed_ratio']:.3f}), refresh end-to-end {e['refresh_total']['median']:.0f} "
                  f"(ratio {e['refresh_total_ratio']:.3f})", flush=True)
        if "train" not in args.skip:
            result["train"] = bench_train(base, blocks, params, special, args.reps, args.steps, args.refresh_every, tmp)
            t = result["train"]
            fh = t["fraction_hidden"] if t["fraction_hidden"] is not None else float("nan")
            print(f"(b) train steps/s: none {t['none']['median']:.3f}, async (same batches) {t['async_shadow']['median']:.3f} "
                  f"(ratio {t['async_over_none']:.3f}), async swapped {t['async']['median']:.3f} (ratio "
                  f"{t['async_over_none_swapped']:.3f}; reader tokens/s ratio {t['async_over_none_tokens']:.3f}), "
                  f"sync {t['sync']['median']:.3f} (ratio {t['sync_over_none']:.3f}; tokens {t['sync_over_none_tokens']:.3f})\n"
                  f"(c) async fraction hidden {fh:.3f}", flush=True)
        result["load_avg_end"] = os.getloadavg()
    key = f"{args.device}/threads={torch.get_num_threads()}/scale={args.scale}"
    all_results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    all_results[key] = result
    write_json_atomic(args.out, all_results)
    print(f"wrote {args.out} [{key}]")


if __name__ == "__main__":
    main()
