"""Does REALM's reader read? Its masked-token log-likelihoods with fixed documents z: x's own block
(the span verbatim), an answer block (another block holding the span), a random block without it, a
block of x's own article without it, and the null document (`SLOTS`). Used by the diagnostic
(`realm_diagnostics.run_diagnostic`) and by the reader warm-up study (`experiments/reader_warmup_study.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from components.data.realm_batch import collate
from components.data.realm_query import RealmQuery
from components.data.special_tokens import IGNORE_INDEX, MISSING_ROW, NULL_ROW, SpecialTokens
from components.models.realm import KnowledgeAugmentedEncoder, knowledge_augmented_inputs

SLOTS = ("null", "own_block", "answer_block", "other_block", "article_block")  # the reader's fixed documents, in slot order


def reader_log_probs(reader: KnowledgeAugmentedEncoder, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log p(y_j | x, z_k) (M, K) at each masked token for each document, whether argmax p(.|x,z_k)
    is y_j (M, K), and each token's query (M,): REALM.forward's reader path, kept per document."""
    labels = batch["x_labels"]
    mask_batch, mask_pos = (labels != IGNORE_INDEX).nonzero(as_tuple=True)  # (M,), (M,)
    targets = labels[mask_batch, mask_pos]  # (M,)
    ids, mask, types = knowledge_augmented_inputs(batch["x_input_ids"], batch["x_attention_mask"], batch["z_input_ids"],
                                                  batch["z_attention_mask"], reader.pad_token_id)  # (B, K, L)
    log_py_all = reader.masked_log_probs(ids, mask, types, mask_batch, mask_pos)  # (M, K, V)
    M, K = log_py_all.shape[:2]
    log_py = log_py_all.gather(-1, targets.view(M, 1, 1).expand(M, K, 1)).squeeze(-1)  # (M, K)
    return log_py, log_py_all.argmax(-1) == targets[:, None], mask_batch


def per_query(values: torch.Tensor, mask_batch: torch.Tensor, B: int) -> torch.Tensor:
    """Sum over each query's masked tokens: (M, K) -> (B, K)."""
    return values.new_zeros(B, values.shape[1]).index_add(0, mask_batch, values)


def fixed_documents(queries: list[RealmQuery], answers: list[set[int]], about: list[set[int]], n_blocks: int,
                    rng: np.random.Generator, article_rows: list[list[int]] | None = None) -> np.ndarray:
    """Candidate rows (B, 5) in `SLOTS` order: the null document, x's own block, an answer block (one
    about x's subject when `about` has one; MISSING_ROW when none holds the span), a random block
    without the span (MISSING_ROW if the draws find none), and a block of `article_rows[b]` (the rows
    of x's article) other than x's own without the span (MISSING_ROW when there is none)."""
    out = np.full((len(queries), len(SLOTS)), MISSING_ROW, dtype=np.int64)
    out[:, 0] = NULL_ROW
    for b, q in enumerate(queries):
        out[b, 1] = q.source_row
        pool = sorted(about[b] or answers[b])
        if pool:
            out[b, 2] = pool[rng.integers(len(pool))]
        for r in rng.integers(n_blocks, size=32).tolist():
            if r != q.source_row and r not in answers[b]:
                out[b, 3] = r
                break
        same = [r for r in (article_rows[b] if article_rows else []) if r != q.source_row and r not in answers[b]]
        if same:
            out[b, 4] = same[rng.integers(len(same))]
    return out


def article_rows(blocks) -> tuple[list[str] | None, dict[str, list[int]]]:
    """Each block's article title, or None when the corpus has no titles (then `fixed_documents` has no
    same-article slot), and the rows of each article."""
    titles = [str(t or "") for t in blocks["title"]] if "title" in blocks.column_names else []
    article = titles if any(titles) else None
    by_article: dict[str, list[int]] = {}
    for r, t in enumerate(article or []):
        by_article.setdefault(t, []).append(r)
    return article, by_article


@dataclass
class FixedReads:
    """Per-token hits of the reader by `SLOTS` slot, and per-query span log-likelihood gaps."""

    acc: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SLOTS})
    gap: list[float] = field(default_factory=list)          # log p(y|x,z_answer) - log p(y|x,z_other), span summed
    gap_tok: list[float] = field(default_factory=list)      # the same per masked token
    gap_article: list[float] = field(default_factory=list)  # z_other = a block of x's article without the span

    def report(self) -> dict[str, Any]:
        return {**{f"acc_{s}": mean_sd(self.acc[s])["mean"] for s in SLOTS[:3]},
                **{f"tokens_{s}": len(self.acc[s]) for s in SLOTS[:3]},
                "gap_nats": mean_sd(self.gap), "gap_nats_per_token": mean_sd(self.gap_tok),
                "gap_nats_same_article": mean_sd(self.gap_article)}


def read_fixed_documents(reader: KnowledgeAugmentedEncoder, qs: list[RealmQuery], rows: np.ndarray, lookup, p, special: SpecialTokens,
                         dev: torch.device, out: FixedReads) -> None:
    """The reader on `qs` with the fixed documents `rows` (B, 5) of `fixed_documents`, added to `out`."""
    B = len(qs)
    fixed = collate(qs, rows, lookup, p, special)
    log_py, correct, mb = reader_log_probs(reader, {k: v.to(dev) for k, v in fixed.items()})
    have = fixed["candidate_mask"].to(dev)[mb]  # (M, 5): the slot has a document
    for k, s in enumerate(SLOTS):
        out.acc[s] += correct[have[:, k], k].float().tolist()
    seq = per_query(log_py, mb, B).cpu()  # (B, 5) log p(y|x,z) of the span
    n_tok = torch.bincount(mb, minlength=B).cpu()
    cand = fixed["candidate_mask"]
    for b in range(B):
        if cand[b, 2] and cand[b, 3] and n_tok[b]:
            out.gap.append(float(seq[b, 2] - seq[b, 3]))
            out.gap_tok.append(out.gap[-1] / int(n_tok[b]))
        if cand[b, 2] and cand[b, 4] and n_tok[b]:
            out.gap_article.append(float(seq[b, 2] - seq[b, 4]))


def mean_sd(xs) -> dict[str, float | int | None]:
    xs = np.asarray(list(xs), dtype=np.float64)
    return {"mean": float(xs.mean()) if xs.size else None, "sd": float(xs.std()) if xs.size else None, "n": int(xs.size)}
