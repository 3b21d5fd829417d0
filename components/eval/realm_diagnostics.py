"""REALM's diagnostic: does the reader read, and does the retriever's gradient carry signal?

REALM's only signal for the retriever is how p(y|x,z) varies across z (Guu et al. 2020, section
3.4: d log p(y|x) / d f(x,z) = r(z) = p(z|x) (p(y|x,z) / p(y|x) - 1)). If the reader does not read,
that gradient is noise. On fixed masked queries x of a workspace that ran `pretrain_realm@<arm>`,
with the model, index and collator the stage uses (eval mode: no dropout):

* reader: masked-token accuracy of argmax p(y_j|x,z) with z = x's own block (the span verbatim), an
  answer block (another block holding the span, one about x's subject when there is one) and the
  null document; the gap log p(y|x,z_answer) - log p(y|x,z_other) per query (z_other: a random
  block without the span; the span's tokens summed), and the same with z_other a block of x's own
  article (title) without the span: same topic, so only reading the answer separates the two.
* retrieval, over the top k of the arm's final index (slot 0 the null document, as in training):
  the entropy of p(z|x) (in [0, log k]), p(null), the share of queries with an answer-bearing
  candidate, and r(z) by whether z holds the answer (and same article or not, when blocks have titles).
* gradient: g = d loss / d theta of REALM's marginal likelihood w.r.t. the query tower (with shared
  towers, the towers), one vector per batch of B queries; cos(g_i, g_i+1) over consecutive batches.
  The reference: the same for a supervised in-batch-negatives loss on the corpus's train questions
  and their gold paragraph's block (`ICTModel`'s loss), and cos(mean g_realm, mean g_supervised);
  the same for ICT's loss (the retriever's warm-up), a second reference.
* corpus (`span_holders`, apart: one NER pass over the whole corpus, no model): how many other blocks
  hold each block's salient spans, what `realm.span_min/max_other_blocks` choose from.

    ws = load_workspace(Path("."), arm="refreshed")
    result = run_diagnostic(ws, n_queries=96, batch_size=8, seed=0)     # a JSON-able dict
(`experiments/realm_diagnostic.py` is the script that prints it; docs/experiments/realm.md how to read it.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import logging
import time

import numpy as np
import torch

from components import paths
from components.config import Params, load_params
from components.data.finetune_data import load_pairs
from components.data.ict_batch import ICTCollator, ict_eligible_rows
from components.data.realm_batch import RealmCollator, collate_queries, passage_batch, passage_columns
from components.data.realm_query import (RealmQuery, fixed_queries, in_range, iter_block_spans, other_blocks_range,
                                         untagged_texts)
from components.data.salient_spans import span_tagger_for
from components.data.special_tokens import IGNORE_INDEX, SpecialTokens
from components.eval.realm_probes import answer_blocks, same_entity_gold
from components.eval.realm_reading import FixedReads, article_rows, fixed_documents, mean_sd, per_query, read_fixed_documents, reader_log_probs
from components.index.faiss_index import BlockIndex
from components.models.ict import ICTModel
from components.models.realm import REALM
from components.models.retriever import Retriever
from components.progress import ProgressClock, format_duration, progress_line

log = logging.getLogger(__name__)


@dataclass
class RealmWorkspace:
    """What the diagnostic reads from a workspace, loaded as the stage and the evaluation load it."""

    root: Path
    params: Params
    special: SpecialTokens
    tokenizer: Any
    blocks: Any  # datasets.Dataset: data/tokens/blocks
    model: REALM
    index: BlockIndex
    collator: RealmCollator
    device: torch.device


AT = ("final", "start")  # which retriever a workspace is measured with: REALM's last, or the one it started from


def load_workspace(root: Path, arm: str = "refreshed", device: str = "cpu", params_file: Path | None = None,
                   at: str = "final") -> RealmWorkspace:
    """`root`/params.yaml, data/tokens, and models/realm (or the `arm`'s folder): REALM.from_pretrained
    and its index/final. `at="start"`: the retriever REALM started from instead, ICT's
    (models/realm/ict_retriever, saved when `realm.ict_steps` > 0) with index/first, which was built from
    it; the reader is the saved one, which is the start's too when `realm.freeze_reader` (else a warning).
    A missing piece raises naming the folder and the stage that writes it."""
    import datasets

    from components.data.tokenize import load_tokenizer

    root = Path(root)
    if arm not in paths.REALM_ARM_OUT:
        raise ValueError(f"arm must be one of {sorted(paths.REALM_ARM_OUT)}, got {arm!r}")
    if at not in AT:
        raise ValueError(f"at must be one of {AT}, got {at!r}")
    out = root / paths.REALM_ARM_OUT[arm]
    index_dir = out / "index" / ("first" if at == "start" else "final")
    stage = f"`dvc repro pretrain_realm@{arm}`"
    need = {root / paths.TOKENS / "tokenizer": "`dvc repro tokenize`", root / paths.TOKENS / "blocks": "`dvc repro tokenize`",
            out / "retriever": stage, out / "knowledge_augmented_encoder": stage, index_dir: stage}
    if at == "start":  # only ICT saves the start: without it the towers are retromae's, not a folder of this stage
        need[out / paths.ICT_RETRIEVER] = f"{stage} with realm.ict_steps > 0 (REALM's start is saved only after ICT)"
    for folder, how in need.items():
        if not folder.exists():
            raise FileNotFoundError(f"{folder} is missing: run {how} in {root} first")
    params = load_params(params_file or root / "params.yaml")
    params = params.model_copy(update={"realm": params.realm.for_arm(arm)})
    tokenizer = load_tokenizer(root / paths.TOKENS / "tokenizer")
    special = SpecialTokens.from_tokenizer(tokenizer)
    blocks = datasets.load_from_disk(str(root / paths.TOKENS / "blocks"))
    dev = torch.device(device)
    model = REALM.from_pretrained(out)
    if at == "start":
        model = REALM(Retriever.from_pretrained(out / paths.ICT_RETRIEVER), model.knowledge_augmented_encoder,
                      model.marginalization)
        if not params.realm.freeze_reader:
            log.warning("%s: realm.freeze_reader is false, so REALM trained the reader too: `at start` pairs the start's "
                        "retriever with the final reader", root)
    model = model.to(dev).eval()
    index = BlockIndex.load(index_dir, use_gpu=False)
    collator = RealmCollator(blocks, params.realm, special, model.retriever, index.search)
    return RealmWorkspace(root, params, special, tokenizer, blocks, model, index, collator, dev)


def sample_queries(blocks, p, special: SpecialTokens, n: int, seed: int) -> list[RealmQuery]:
    """n masked queries (`fixed_queries`, as the probes draw them) from blocks in a seeded random order:
    no pass over the whole corpus for a few queries."""
    order = np.random.default_rng(seed).permutation(len(blocks)).tolist()
    out: list[RealmQuery] = []
    for i in range(0, len(order), max(4 * n, 64)):
        out += fixed_queries(blocks, order[i:i + max(4 * n, 64)], p, special, seed)
        if len(out) >= n:
            break
    return out[:n]


# ----------------------------------------------------------------------------------------------
# the corpus: what another block can supply
# ----------------------------------------------------------------------------------------------
HOLDER_BINS = ((0, 0), (1, 1), (2, 2), (3, 5), (6, 10), (11, 20), (21, None))  # other blocks holding a span


def _bin_name(lo: int, hi: int | None) -> str:
    return str(lo) if lo == hi else f"{lo}+" if hi is None else f"{lo}-{hi}"


def span_holders(blocks, p, bins=HOLDER_BINS) -> dict[str, Any]:
    """How many OTHER blocks hold each salient span of each block, over every (block, span) pair of the
    corpus (`p.span_tagger`, before any span filter): what `realm.span_min_other_blocks` /
    `span_max_other_blocks` choose from. A span no other block holds gives the retriever nothing to find;
    one that many blocks hold (an article's topic entity) rewards retrieving the article, not the block.
    Per bin of that count: the share of pairs, and, when blocks have titles, the share of the holders in
    the block's own article. `admitted`: the pairs and blocks the params' filter keeps."""
    tagger = span_tagger_for(p)
    tagger.prefetch(untagged_texts(blocks))  # one batched NER pass
    spans = dict(iter_block_spans(blocks, tagger))
    holders: dict[tuple[int, ...], list[int]] = {}
    for r, sps in spans.items():
        for sp in sps:
            holders.setdefault(sp, []).append(r)
    article, _ = article_rows(blocks)
    pairs = [(r, len(holders[sp]) - 1, sp) for r, sps in spans.items() for sp in sps]  # (row, other blocks, span)
    lo_p, hi_p = other_blocks_range(p)
    out: dict[str, Any] = {"blocks": len(spans), "blocks_with_a_span": sum(bool(s) for s in spans.values()),
                           "pairs": len(pairs), "distinct_spans": len(holders), "other_blocks": {}}
    same: dict[str, Any] = {}
    for lo, hi in bins:
        sel = [(r, k, sp) for r, k, sp in pairs if in_range(k, lo, hi)]
        out["other_blocks"][_bin_name(lo, hi)] = len(sel) / max(len(pairs), 1)
        if article is not None and lo > 0:
            shares = [sum(article[o] == article[r] for o in holders[sp] if o != r) / k for r, k, sp in sel]
            same[_bin_name(lo, hi)] = float(np.mean(shares)) if shares else None
    if article is not None:
        out["same_article_share_of_holders"] = same
    admitted = [r for r, k, _ in pairs if in_range(k, lo_p, hi_p)]  # the row of each pair the filter keeps
    out["admitted"] = {"filter": f"{_bin_name(lo_p, hi_p)} other blocks", "pairs": len(admitted) / max(len(pairs), 1),
                       "blocks_with_an_admitted_span": len(set(admitted))}
    return out


# ----------------------------------------------------------------------------------------------
# retrieval: p(z|x) and the utility r(z)
# ----------------------------------------------------------------------------------------------
def utility(log_py: torch.Tensor, log_pz: torch.Tensor, mask_batch: torch.Tensor, marginalization: str) -> torch.Tensor:
    """r(z) = p(z|x) (p(y|x,z) / p(y|x) - 1) per query and candidate (B, K), the gradient of log p(y|x)
    w.r.t. the score f(x,z). `per_token`: averaged over the query's tokens, each marginalised on its own
    (the loss REALM trains); `per_sequence`: y = the whole span. Sums to 0 over z."""
    B = log_pz.shape[0]
    if marginalization == "per_sequence":
        seq = per_query(log_py, mask_batch, B)  # (B, K)
        log_pyx = torch.logsumexp(seq + log_pz, dim=1, keepdim=True)  # (B, 1)
        return log_pz.exp() * (torch.exp(seq - log_pyx) - 1)
    log_pz_tok = log_pz[mask_batch]  # (M, K)
    log_pyx = torch.logsumexp(log_py + log_pz_tok, dim=1, keepdim=True)  # (M, 1)
    r_tok = log_pz_tok.exp() * (torch.exp(log_py - log_pyx) - 1)  # (M, K)
    counts = torch.bincount(mask_batch, minlength=B).clamp(min=1).to(r_tok.dtype)
    return per_query(r_tok, mask_batch, B) / counts[:, None]


def entropy(log_pz: torch.Tensor) -> torch.Tensor:
    """H(p(z|x)) per query (B,); 0 log 0 := 0 (slots the index could not fill)."""
    pz = log_pz.exp()
    return -(pz * log_pz.masked_fill(pz == 0, 0.0)).sum(-1)


# ----------------------------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------------------------
def query_tower_params(retriever: Retriever) -> list[torch.nn.Parameter]:
    """The query tower: encoder + projection (with shared towers also the document tower)."""
    return [*retriever.query_encoder.parameters(), *retriever.query_projection.parameters()]


def flat_grad(loss: torch.Tensor, params: list[torch.nn.Parameter]) -> torch.Tensor:
    """d loss / d params as one float32 vector on the CPU (a parameter the loss does not reach: zeros)."""
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).float().cpu() for p, g in zip(params, grads)])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def realm_gradient(model: REALM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The retriever gradient of REALM's marginal-likelihood loss on one batch (`REALM.forward`); the
    reader is frozen for the call, so no backward pass runs through it."""
    reader = model.knowledge_augmented_encoder
    saved = [p.requires_grad for p in reader.parameters()]
    reader.requires_grad_(False)
    try:
        return flat_grad(model(batch)["loss"], query_tower_params(model.retriever))
    finally:
        for p, s in zip(reader.parameters(), saved):
            p.requires_grad_(s)


def contrastive_gradient(retriever: Retriever, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The gradient of the in-batch-negatives contrastive loss (`ICTModel`'s) of `{q_*, d_*}` batches:
    questions vs their gold blocks (`supervised_batches`), or ICT's sentences vs their blocks."""
    return flat_grad(ICTModel(retriever)(batch)["loss"], query_tower_params(retriever))


def gradient_series(grad_fn, batches, name: str = "") -> tuple[list[float], list[float], torch.Tensor | None]:
    """(cosines of consecutive batches' gradients, their norms, their sum), holding two vectors at a
    time (a MiniLM tower's gradient is 90 MB)."""
    cos, norms, total, prev, t0 = [], [], None, None, time.perf_counter()
    for b in batches:
        g = grad_fn(b)
        norms.append(float(g.norm()))
        total = g.clone() if total is None else total.add_(g)
        if prev is not None:
            cos.append(cosine(prev, g))
        prev = g
    log.info("realm.diagnostic: %s gradients of %d batches in %s", name, len(norms), format_duration(time.perf_counter() - t0))
    return cos, norms, total


def ict_batches(ws: RealmWorkspace, n: int, batch_size: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Up to n ICT batches (`ICTCollator` at `realm.ict_mask_rate`: a sentence vs the rest of its
    block) of blocks drawn in a seeded order: the warm-up's gradient, a second reference."""
    p, blocks = ws.params.realm, ws.blocks
    order, rows, chunk = np.random.default_rng(seed).permutation(len(blocks)).tolist(), [], max(4 * n * batch_size, 64)
    for i in range(0, len(order), chunk):
        part = order[i:i + chunk]
        rows += [part[j] for j in ict_eligible_rows(blocks.select(part))]
        if len(rows) >= n * batch_size:
            break
    collator = ICTCollator(blocks, p, ws.special, p.ict_mask_rate)
    return [collator(rows[i:i + batch_size], generator=torch.Generator().manual_seed(seed + i))
            for i in range(0, min(len(rows), n * batch_size) - batch_size + 1, batch_size)]


def supervised_batches(ws: RealmWorkspace, n: int, batch_size: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Up to n batches of `batch_size` train questions (`[CLS] q [SEP]`) and their gold paragraph's
    block (the block of the judged document whose text holds an answer, else its first block),
    distinct blocks within a batch (a repeated block would be a false negative)."""
    p, blocks = ws.params.realm, ws.blocks
    pairs = load_pairs(ws.root / paths.CORPUS, "train") if (ws.root / paths.CORPUS / "beir" / "qrels" / "train.tsv").is_file() else []
    doc_rows: dict[str, list[int]] = {}
    for r, d in enumerate(blocks["doc_id"]):
        doc_rows.setdefault(str(d), []).append(r)
    texts = blocks["text"] if "text" in blocks.column_names else None
    chosen = []
    for pair in pairs:
        rows = doc_rows.get(str(pair["pos_doc_id"]))
        if rows:
            hit = [r for r in rows if texts and any(a and a.lower() in (texts[r] or "").lower() for a in pair.get("answers", []))]
            chosen.append((pair["query"], (hit or rows)[0]))
    order = np.random.default_rng(seed).permutation(len(chosen)).tolist()
    batches, current, used = [], [], set()
    for i in order:
        q, row = chosen[i]
        if row in used:
            continue
        current.append((q, row))
        used.add(row)
        if len(current) == batch_size:
            batches.append(current)
            current, used = [], set()
            if len(batches) == n:
                break
    lookup = blocks.select_columns(passage_columns(p))
    out = []
    for batch in batches:
        ids = [list(t)[: p.query_len - 2] for t in ws.tokenizer([q for q, _ in batch], add_special_tokens=False)["input_ids"]]
        x = collate_queries([RealmQuery(t, [IGNORE_INDEX] * len(t), source_row=-1) for t in ids], p, ws.special)
        d = passage_batch([lookup[int(r)] for _, r in batch], p, ws.special)
        out.append({"q_input_ids": x["x_input_ids"], "q_attention_mask": x["x_attention_mask"],
                    **{f"d_{k}": v for k, v in d.items()}})
    return out


# ----------------------------------------------------------------------------------------------
# the diagnostic
# ----------------------------------------------------------------------------------------------
def run_diagnostic(ws: RealmWorkspace, n_queries: int = 96, batch_size: int = 8, seed: int = 0) -> dict[str, Any]:
    """Every number of the module docstring on `n_queries` fixed queries, in batches of `batch_size`."""
    p, model, dev = ws.params.realm, ws.model, ws.device
    model.eval()
    rng = np.random.default_rng(seed)
    queries = sample_queries(ws.blocks, p, ws.special, n_queries, seed)
    if len(queries) < 2 * batch_size:
        raise ValueError(f"only {len(queries)} masked queries in {ws.root / paths.TOKENS / 'blocks'}: "
                         f"need 2 batches of {batch_size} (lower --batch-size)")
    answers = answer_blocks(queries, ws.blocks)  # (Q,) rows other than x's own holding the masked span
    about = same_entity_gold(queries, answers, ws.blocks, span_tagger_for(p))
    article, by_article = article_rows(ws.blocks)
    to = lambda b: {k: v.to(dev) for k, v in b.items()}  # noqa: E731

    reads = FixedReads()
    cand_gap, ent, p_null, any_answer, log_k = ([] for _ in range(5))
    r_groups: dict[str, list[float]] = {}
    realm_batches = []  # (the token ids are small; the gradients are taken one batch at a time below)
    batches = [queries[i:i + batch_size] for i in range(0, len(queries) - batch_size + 1, batch_size)]  # full batches only
    clock, nll = ProgressClock(0), []  # a line at least once a minute (a MiniLM batch takes about that on one CPU core)
    for bi, qs in enumerate(batches):
        ans, ab = answers[bi * batch_size:(bi + 1) * batch_size], about[bi * batch_size:(bi + 1) * batch_size]
        B = len(qs)
        with torch.no_grad():
            mates = [by_article[article[q.source_row]] for q in qs] if article is not None else None
            fixed = fixed_documents(qs, ans, ab, len(ws.blocks), rng, mates)
            read_fixed_documents(model.knowledge_augmented_encoder, qs, fixed, ws.collator.lookup, p, ws.special, dev, reads)
            # the top k of the index, as training sees them
            batch = to(ws.collator.batch(qs, ws.index.search, model.retriever))
            log_pz = model.retrieval_log_probs(batch)  # (B, K)
            log_py, _, mb = reader_log_probs(model.knowledge_augmented_encoder, batch)
            r = utility(log_py, log_pz, mb, model.marginalization).cpu()
            nll.append(float(-torch.logsumexp(log_py + log_pz[mb], 1).mean()))  # mean -log p(y_j|x) (the per_token loss)
            seq = per_query(log_py, mb, B).cpu()
            ent += entropy(log_pz).tolist()
            p_null += log_pz[:, 0].exp().tolist()
            cand, rows = batch["candidate_mask"].cpu(), batch["candidate_rows"].cpu()
            log_k += torch.log(cand.sum(-1).float()).tolist()
            r_groups.setdefault("null", []).extend(r[:, 0].tolist())
            for b, q in enumerate(qs):
                hold = [k for k in range(1, rows.shape[1]) if cand[b, k] and int(rows[b, k]) in ans[b]]
                lack = [k for k in range(1, rows.shape[1]) if cand[b, k] and int(rows[b, k]) not in ans[b]]
                any_answer.append(float(bool(hold)))
                if hold and lack:
                    cand_gap.append(float(seq[b, hold].mean() - seq[b, lack].mean()))
                for k in hold + lack:
                    group = "answer" if k in hold else "no_answer"
                    if article is not None:
                        group += "_same_article" if article[int(rows[b, k])] == article[q.source_row] else "_other_article"
                    r_groups.setdefault(group, []).append(float(r[b, k]))
        realm_batches.append(batch)
        if clock.due(bi + 1, final=bi + 1 == len(batches)):
            log.info("%s", progress_line("realm.diagnostic", bi + 1, len(batches), {"loss": float(np.mean(nll))},
                                         clock.eta(bi + 1, len(batches))))

    n = len(batches)
    contrastive = lambda b: contrastive_gradient(model.retriever, to(b))  # noqa: E731
    series = {"realm": gradient_series(lambda b: realm_gradient(model, b), realm_batches, "realm"),
              "supervised": gradient_series(contrastive, supervised_batches(ws, n, batch_size, seed), "supervised"),
              "ict": gradient_series(contrastive, ict_batches(ws, n, batch_size, seed), "ict")}
    gradient: dict[str, Any] = {"params": sum(t.numel() for t in query_tower_params(model.retriever))}
    for name, (cos, norms, total) in series.items():
        gradient.update({f"{name}_batches": len(norms), f"{name}_batch_cosine": mean_sd(cos), f"{name}_grad_norm": mean_sd(norms)})
    sup = series["supervised"][2]
    for name in ("realm", "ict"):
        total = series[name][2]
        gradient[f"{name}_vs_supervised_mean_cosine"] = cosine(total, sup) if total is not None and sup is not None else None
    return {
        "workspace": str(ws.root), "n_queries": len(batches) * batch_size, "batch_size": batch_size, "seed": seed,
        "top_k": p.top_k, "marginalization": model.marginalization, "index_version": ws.index.version,
        "reader": {**reads.report(), "queries_with_answer_block": sum(bool(a) for a in answers[:len(batches) * batch_size])},
        "retrieval": {
            "entropy": mean_sd(ent), "log_k": mean_sd(log_k)["mean"], "p_null": mean_sd(p_null),
            "share_with_answer_candidate": mean_sd(any_answer)["mean"],
            "candidate_gap_nats": mean_sd(cand_gap),
            "utility": {k: mean_sd(v) for k, v in sorted(r_groups.items())},
        },
        "gradient": gradient,
    }
