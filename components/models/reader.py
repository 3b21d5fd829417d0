"""Open-domain QA fine-tuning: a retriever + extractive reader (the ORQA / REALM recipe).

    p(z | x)        = softmax_z( E_q(x) . e_z )          over the top-k blocks z of a FROZEN index
    p(s | x, z)     = softmax_s( start(s_i) + end(s_j) )  over spans s = (i, j) of whole words of z,
                                                          j - i < max_answer_tokens
    p(y | x)        = sum_z p(z | x) sum_{s in z, text(s) ~ y} p(s | x, z)     (REALM eq. for open-QA)

Pieces (paper names):

* `retriever`: the query tower (a `BiEncoder`, or anything with `encode_query`). Retrieval of the
  top k happens outside with the frozen block index; the batch carries the k block embeddings
  e_z, and the model recomputes the scores E_q(x) . e_z, so the query tower gets gradients and the
  block embeddings never do (ORQA: the evidence-block encoder is frozen, the question encoder trains).
  `None` for a system without a dense query tower (BM25 top-k): its batches carry no block
  embeddings, so p(z | x) is uniform over the top k and the reader's span scores alone rank the
  answers (the BM25 + reader pipeline; BM25's raw scores are unbounded, and as logits they would
  need a temperature that nothing here could learn).
* `reader`: a BERT over `[CLS] x [SEP] z [SEP]` (token types 0 | 1) with start/end logits
  (`SpanReader`, an HF *ForQuestionAnswering). Spans lie inside z only, are at most
  `max_answer_tokens` tokens long and never cut a word (a WordPiece continuation piece neither
  starts a span nor follows its end), the same candidates that `find_answer_spans` can mark correct.
* `null_document`: an empty z, `[CLS] x [SEP] [SEP]`; it has no spans.

Loss (per question; the batch loss is the mean over questions):
    retrieval_loss = -log sum_{z in top-k, z contains a correct span} p(z | x)    (ORQA's early update)
    reader_loss    = -log sum_z p(z | x) sum_{correct s in z} p(s | x, z)       (the marginal above)
A correct span is any (i, j) whose text equals a gold answer after SQuAD normalisation
(`find_answer_spans`), so blocks without one get zero weight in both sums. A question with no
correct block (or span) anywhere gets 0 for that term, with finite values and zero gradients
(no -inf enters a softmax: masked entries use a large finite negative).

Inference: `predict(question, blocks, block_embeddings)` returns the span maximising
log p(z | x) + log p(s | x, z) (best span score + retrieval score, both normalised as in training).

Closed-book mode: `predict(question, [])` reads the question with the null document only. An
extractive reader has nothing to extract there, so it always answers "" (EM 0): it is the floor
that shows what retrieval adds (every correct answer of the open-book model comes from a
retrieved block), not a closed-book QA model (that would need a generator, which this project
does not train).

Usage (the batches: components/data/qa_batch.py):
    model = OpenQA(BiEncoder.from_pretrained("models/biencoder"), SpanReader.from_pretrained("models/retromae/encoder"))
    collate = QACollator(tok, blocks, block_vecs, query_len=32, passage_len=80, top_k=5, max_answer_tokens=10)
    out = model(collate(rows))             # rows: {question, answers, block_rows: [top-k block rows]}
    model.predict("who founded Sesger?", [blocks[r] for r in rows], block_vecs[rows], collate)

Shapes: B questions, K blocks per question, L reader length, A = max_answer_tokens, D embedding dim.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
from torch import nn

from components.io import atomic_dir, write_json_atomic

if TYPE_CHECKING:
    from components.data.qa_batch import QACollator

_NEG = -1e30  # finite "minus infinity": all-masked rows stay finite, their gradients 0 (not NaN)
OPENQA_CONFIG = "openqa_config.json"


# ----------------------------------------------------------------------------------------------
# span scores
# ----------------------------------------------------------------------------------------------
def span_logits(start: torch.Tensor, end: torch.Tensor, start_mask: torch.Tensor, max_answer_tokens: int,
                end_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Span scores (N, L, A): [n, i, w] = start[n, i] + end[n, i + w] for the span i..i+w, and
    which of them are valid: i may start a span, i + w may end one (both masks are inside z, which
    is contiguous, so the whole span is). start/end (N, L) float; start_mask/end_mask (N, L) bool
    (`context_mask` for both = any z token; the collator's word-boundary masks = whole words)."""
    A = max_answer_tokens
    end_mask = start_mask if end_mask is None else end_mask
    end_w = torch.nn.functional.pad(end.float(), (0, A - 1), value=_NEG).unfold(1, A, 1)  # (N, L, A) end[i + w]
    end_ok = torch.nn.functional.pad(end_mask, (0, A - 1), value=False).unfold(1, A, 1)  # (N, L, A)
    valid = start_mask[:, :, None] & end_ok  # (N, L, A)
    return start.float()[:, :, None] + end_w, valid


def masked_log_softmax(scores: torch.Tensor, valid: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """log_softmax over the valid entries of `dims`; invalid entries (and every entry of a group
    with none valid, e.g. the null document) come out as _NEG, never NaN, with zero gradient."""
    scores = scores.masked_fill(~valid, _NEG)
    return (scores - torch.logsumexp(scores, dim=dims, keepdim=True)).masked_fill(~valid, _NEG)


def marginal_nll(log_p: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """-log sum_{correct} p per row: log_p, correct (B, ...) -> (B,); 0 where a row has no correct entry."""
    B = log_p.size(0)
    lp, ok = log_p.reshape(B, -1), correct.reshape(B, -1)
    nll = -torch.logsumexp(lp.masked_fill(~ok, _NEG), dim=1)  # (B,) finite even with no correct entry
    return torch.where(ok.any(1), nll, torch.zeros_like(nll))


# ----------------------------------------------------------------------------------------------
# the reader
# ----------------------------------------------------------------------------------------------
class SpanReader(nn.Module):
    """BERT over `[CLS] x [SEP] z [SEP]` -> start/end logits (N, L); an HF *ForQuestionAnswering,
    so the saved folder is a standard HF QA model."""

    def __init__(self, qa_model: nn.Module):
        super().__init__()
        self.qa_model = qa_model

    @classmethod
    def from_config(cls, config: Any) -> "SpanReader":
        from transformers import BertForQuestionAnswering

        return cls(BertForQuestionAnswering(config))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dropout: float | None = None) -> "SpanReader":
        """From an HF folder: an encoder (RetroMAE / MLM / REALM's knowledge-augmented encoder; the
        span head `qa_outputs` starts fresh) or a saved SpanReader. Missing encoder weights raise."""
        from transformers import AutoModelForQuestionAnswering

        overrides = {} if dropout is None else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
        model, info = AutoModelForQuestionAnswering.from_pretrained(str(path), output_loading_info=True, **overrides)
        missing = [k for k in info["missing_keys"] if not k.startswith("qa_outputs")]
        if missing:
            raise ValueError(f"{path}: reader encoder weights missing (would be random): {sorted(missing)[:8]}")
        return cls(model)

    @property
    def config(self) -> Any:
        return self.qa_model.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.qa_model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return out.start_logits, out.end_logits  # (N, L) each


# ----------------------------------------------------------------------------------------------
# retriever + reader
# ----------------------------------------------------------------------------------------------
class OpenQA(nn.Module):
    """`forward(batch)` -> {"loss", "retrieval_loss", "reader_loss", "answerable", "span_acc", "num_tokens"}.

    batch (from `QACollator`): query_input_ids / query_attention_mask (B, Lq); block_embeddings
    (B, K, D) (frozen; optional: absent = uniform p(z|x)); candidate_mask (B, K); input_ids /
    attention_mask / token_type_ids / context_mask (B, K, L); optional span_start_mask /
    span_end_mask (B, K, L) (word boundaries; default: any z token); correct_spans (B, K, L, A);
    answer_in_block (B, K).
    """

    def __init__(self, retriever: nn.Module | None, reader: SpanReader, max_answer_tokens: int = 10):
        super().__init__()
        if max_answer_tokens < 1:
            raise ValueError(f"max_answer_tokens must be >= 1, got {max_answer_tokens}")
        self.retriever, self.reader, self.max_answer_tokens = retriever, reader, max_answer_tokens
        if getattr(retriever, "share_towers", True) is False:
            # A REALM retriever with untied towers: its passage tower made the frozen index and gets
            # no gradient here. Frozen (requires_grad False), DDP leaves it out of the gradient
            # reduction whatever find_unused_parameters says, and AdamW holds no state for it.
            for p in [*retriever.passage_encoder.parameters(), *retriever.passage_projection.parameters()]:
                p.requires_grad_(False)

    # -- p(z | x) ----------------------------------------------------------------------------------
    def retrieval_log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """log p(z | x) (B, K): the query tower re-scores the retrieved blocks' frozen embeddings."""
        cand = batch["candidate_mask"]  # (B, K)
        emb = batch.get("block_embeddings")
        if emb is None or self.retriever is None:  # no index scores: every retrieved block equally likely
            scores = torch.zeros(cand.shape, device=cand.device)
        else:
            q = self.retriever.encode_query(batch["query_input_ids"], batch["query_attention_mask"]).float()  # (B, D)
            scores = torch.einsum("bd,bkd->bk", q, emb.detach().float())  # (B, K); detach: the index is frozen
        return masked_log_softmax(scores, cand, (1,))  # (B, K)

    # -- p(s | x, z) -------------------------------------------------------------------------------
    def span_log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """log p(s | x, z) (B, K, L, A): the reader over all B*K (x, z) pairs at once."""
        B, K, L = batch["input_ids"].shape
        flat = lambda t: t.reshape(B * K, L)  # noqa: E731
        start, end = self.reader(flat(batch["input_ids"]), flat(batch["attention_mask"]), flat(batch["token_type_ids"]))
        ctx = batch["context_mask"]
        # Spans start/end on word boundaries when the collator says where they are (every correct
        # span does), so no probability mass goes to "##ing"-like fragments the metric can't match.
        may_start, may_end = batch.get("span_start_mask", ctx) & ctx, batch.get("span_end_mask", ctx) & ctx
        scores, valid = span_logits(start, end, flat(may_start), self.max_answer_tokens, flat(may_end))  # (B*K, L, A)
        return masked_log_softmax(scores, valid, (1, 2)).view(B, K, L, -1)  # (B, K, L, A)

    # -- training ----------------------------------------------------------------------------------
    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        correct = batch["correct_spans"]  # (B, K, L, A) bool
        if correct.size(-1) != self.max_answer_tokens:
            raise ValueError(f"batch built for max_answer_tokens={correct.size(-1)}, model has {self.max_answer_tokens}")
        cand = batch["candidate_mask"]  # (B, K)
        log_pz = self.retrieval_log_probs(batch)  # (B, K)
        log_ps = self.span_log_probs(batch)  # (B, K, L, A)
        correct = correct & cand[:, :, None, None]
        joint = log_pz[:, :, None, None] + log_ps  # (B, K, L, A) log p(z, s | x)

        retrieval_nll = marginal_nll(log_pz, batch["answer_in_block"] & cand)  # (B,)
        reader_nll = marginal_nll(joint, correct)  # (B,)
        with torch.no_grad():
            B = joint.size(0)
            best = joint.reshape(B, -1).argmax(1)  # (B,)
            span_acc = correct.reshape(B, -1).gather(1, best[:, None]).float().mean()
        return {
            "loss": (retrieval_nll + reader_nll).mean(),
            "retrieval_loss": retrieval_nll.detach().mean(),
            "reader_loss": reader_nll.detach().mean(),
            "answerable": correct.flatten(1).any(1).float().mean(),  # questions with a correct span in the top k
            "span_acc": span_acc,  # the argmax (z, s) is a correct span
            "num_tokens": batch["attention_mask"].sum() + batch["query_attention_mask"].sum(),
        }

    # -- inference ---------------------------------------------------------------------------------
    @torch.no_grad()
    def predict_batch(self, batch: dict[str, torch.Tensor], block_texts: Sequence[Sequence[str | None]]) -> list[dict]:
        """Best span per question: [{"answer", "block", "start", "end", "score"}], score =
        log p(z | x) + log p(s | x, z). No valid span (closed-book / null document only) -> answer ""."""
        joint = self.retrieval_log_probs(batch)[:, :, None, None] + self.span_log_probs(batch)  # (B, K, L, A)
        B, K, L, A = joint.shape
        score, best = joint.reshape(B, -1).max(1)
        offsets = batch["z_char_offsets"]  # (B, K, L, 2)
        out = []
        for b in range(B):
            k, rem = divmod(int(best[b]), L * A)
            i, w = divmod(rem, A)
            if score[b] < _NEG / 2 or k >= len(block_texts[b]) or block_texts[b][k] is None:
                out.append({"answer": "", "block": -1, "start": -1, "end": -1, "score": float("-inf")})
                continue
            s, e = int(offsets[b, k, i, 0]), int(offsets[b, k, i + w, 1])
            out.append({"answer": block_texts[b][k][s:e], "block": k, "start": i, "end": i + w, "score": float(score[b])})
        return out

    def predict(self, question: str, blocks: Sequence[dict], block_embeddings: np.ndarray | None = None,
                collator: "QACollator | None" = None) -> str:
        """The answer string for one question from its retrieved `blocks` ({"text", optional
        "input_ids"/"offsets"}) and their index embeddings (K, D); `blocks=[]` = closed-book (the
        null document only; answers ""). `collator`: the QACollator of training (its lengths)."""
        if collator is None:
            raise ValueError("predict needs the QACollator (tokenizer + lengths) used for training")
        was_training = self.training
        self.eval()
        try:
            blocks = list(blocks) or [None]  # closed-book: the null document only
            embs = None if block_embeddings is None or not len(block_embeddings) else [np.asarray(block_embeddings)]
            batch = collator.encode([question], [blocks], embs)
            device = next(self.parameters()).device
            batch = {k: v.to(device) for k, v in batch.items()}
            texts = [[None if z is None else z["text"] for z in blocks]]
            return self.predict_batch(batch, texts)[0]["answer"]
        finally:
            self.train(was_training)

    # -- save / load -------------------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | os.PathLike, tokenizer: Any = None) -> Path:
        """`out_dir/`: retriever/ (the query tower's own save_pretrained), reader/ (HF QA folder),
        openqa_config.json. Atomic."""
        model = getattr(self, "module", self)
        with atomic_dir(out_dir) as tmp:
            from components.models.biencoder import BiEncoder

            if model.retriever is None:
                pass  # a sparse (BM25) system: nothing to save
            elif isinstance(model.retriever, BiEncoder):
                model.retriever.save_pretrained(tmp / "retriever", tokenizer)
            else:  # e.g. a REALM Retriever: its own layout, no tokenizer argument
                model.retriever.save_pretrained(tmp / "retriever")
            model.reader.qa_model.save_pretrained(tmp / "reader")
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / "reader")
            write_json_atomic(tmp / OPENQA_CONFIG, {"max_answer_tokens": model.max_answer_tokens,
                                                    "retriever_type": type(model.retriever).__name__ if model.retriever is not None else None})
        return Path(out_dir)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "OpenQA":
        path = Path(path)
        cfg = json.loads((path / OPENQA_CONFIG).read_text())
        if "retriever_type" in cfg and cfg["retriever_type"] is None:
            retriever = None  # a sparse (BM25) system
        elif cfg.get("retriever_type") == "Retriever":  # a REALM retriever (projection + maybe untied towers)
            from components.models.retriever import Retriever

            retriever = Retriever.from_pretrained(path / "retriever")
        else:
            from components.models.biencoder import BiEncoder

            retriever = BiEncoder.from_pretrained(path / "retriever")
        return cls(retriever, SpanReader.from_pretrained(path / "reader"), cfg["max_answer_tokens"])
