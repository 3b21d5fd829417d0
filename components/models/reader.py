"""Open-domain QA fine-tuning: a retriever + extractive reader (the ORQA / REALM recipe).

    S(z)            = E_q(x) . e_z                        the retrieval score of block z of a FROZEN index
    f(s)            = start(s_i) + end(s_j)               `span_scorer: linear` (BERT's SQuAD head), or
                    = w . LN(ReLU(W [h_i; h_j] + b))      `span_scorer: mlp` (ORQA's, `span_hidden` units)
                      over spans s = (i, j) of whole words of z, j - i < max_answer_tokens
  `span_softmax: per_block` (REALM's open-QA marginal):
    p(z | x) = softmax_z S(z) over the top k,  p(s | x, z) = softmax_s f(s) within z,
    p(y | x) = sum_z p(z | x) sum_{s in z, text(s) ~ y} p(s | x, z)
  `span_softmax: joint` (ORQA, language/orqa/models/orqa_model.py `read`):
    p(z, s | x) = softmax_{(z, s)} ( f(s) + S(z) )   one softmax over every (block, span) pair of the top k

Pieces (paper names):

* `retriever`: the query tower (a `BiEncoder`, or anything with `encode_query`). The collator
  searches the frozen block index with this tower as it is at each step (`QACollator(retrieve=)`);
  the batch carries the beam's block embeddings e_z, and the model recomputes the scores
  E_q(x) . e_z, so the query tower gets gradients and the block embeddings never do (ORQA: the
  evidence-block encoder is frozen, the question encoder trains).
  `None` for a system without a dense query tower (BM25 top-k): its batches carry no block
  embeddings, so p(z | x) is uniform over the top k and the reader's span scores alone rank the
  answers (the BM25 + reader pipeline; BM25's raw scores are unbounded, and as logits they would
  need a temperature that nothing here could learn).
* `reader`: a BERT over `[CLS] x [SEP] z [SEP]` (token types 0 | 1) with a span scorer
  (`SpanReader`: an HF *ForQuestionAnswering, plus ORQA's MLP when `span_scorer: mlp`). Spans lie inside z only, are at most
  `max_answer_tokens` tokens long and never cut a word (a WordPiece continuation piece neither
  starts a span nor follows its end), the same candidates that `find_answer_spans` can mark correct.
* `null_document`: an empty z, `[CLS] x [SEP] [SEP]`; it has no spans.

Loss (per question; the batch loss is the mean over questions):
    retrieval_loss = -log sum_{z in beam, has_answer(z)} softmax_beam S(z)       (ORQA's early update)
    reader_loss    = -log sum_{correct (z, s)} p(z, s | x)                       (the marginal above)
The beam is the top B (`finetune.qa_retrieval_beam`) that the current query tower retrieved this
step (batch `beam_embeddings` / `beam_has_answer`, a block holding an answer string); the reader's
top k is its first k. A batch without a beam (BM25, a fixed selection) scores the top k instead.
A correct span is any (i, j) whose text equals a gold answer after SQuAD normalisation
(`find_answer_spans`), so blocks without one get zero weight in both sums. A question with no
correct block (or span) anywhere gets 0 for that term, with finite values and zero gradients
(no -inf enters a softmax: masked entries use a large finite negative).

Inference: `predict(question, blocks, block_embeddings)` returns the span maximising log p(z, s | x),
normalised as in training.

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

Speed: the collator pads every (x, z) row of a batch to its longest (~290 tokens over blocks of
~128); `finetune.reader_chunk_rows` runs the B*K rows through the BERT in length-sorted chunks, each
at its own width (`SpanReader.span_scores`). Under the Trainer, `compute.length_chunk_tokens` (a token
budget per chunk, as in every other training step) takes its place.

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
from components.models.encoder import run_length_chunks
from components.models.span_scores import NEG, SpanMLP, marginal_nll, masked_log_softmax, span_pairs, span_valid
from components.quiet_logs import expect_missing

if TYPE_CHECKING:
    from components.data.qa_batch import QACollator

OPENQA_CONFIG = "openqa_config.json"
SPAN_MLP_FILE = "span_mlp.safetensors"
_SPAN_HEAD_PREFIX = "qa_outputs"  # BertForQuestionAnswering's span head; every other weight is the encoder's
SPAN_SOFTMAX = ("per_block", "joint")
NO_SPAN = {"answer": "", "block": -1, "start": -1, "end": -1, "score": float("-inf")}  # a question without a valid span


# ----------------------------------------------------------------------------------------------
# the reader
# ----------------------------------------------------------------------------------------------
class SpanReader(nn.Module):
    """BERT over `[CLS] x [SEP] z [SEP]` -> span scores. An HF *ForQuestionAnswering, so the saved
    folder is a standard HF QA model; its start/end head `qa_outputs` is the `linear` scorer, and
    `span_mlp` (ORQA's MLP, saved beside it as span_mlp.safetensors) the `mlp` one."""

    def __init__(self, qa_model: nn.Module, span_scorer: str = "linear", span_hidden: int = 256):
        super().__init__()
        if span_scorer not in ("linear", "mlp"):
            raise ValueError(f"span_scorer must be linear or mlp, got {span_scorer!r}")
        self.qa_model, self.span_scorer, self.span_hidden = qa_model, span_scorer, span_hidden
        self.span_mlp = SpanMLP(qa_model.config.hidden_size, span_hidden) if span_scorer == "mlp" else None
        if self.span_mlp is not None:
            # the linear head is unused: frozen, DDP skips it and AdamW holds no state for it
            self.qa_model.qa_outputs.requires_grad_(False)

    @classmethod
    def from_config(cls, config: Any, span_scorer: str = "linear", span_hidden: int = 256) -> "SpanReader":
        from transformers import BertForQuestionAnswering

        return cls(BertForQuestionAnswering(config), span_scorer, span_hidden)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dropout: float | None = None, span_scorer: str | None = None,
                        span_hidden: int = 256) -> "SpanReader":
        """From an HF folder: an encoder (RetroMAE / MLM / REALM's knowledge-augmented encoder; the
        span head starts fresh) or a saved SpanReader (its span_mlp.safetensors, if any, is loaded
        and decides the scorer unless `span_scorer` is given). Missing encoder weights raise."""
        from transformers import AutoModelForQuestionAnswering

        overrides = {} if dropout is None else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
        with expect_missing(_SPAN_HEAD_PREFIX):  # the span head starts fresh from an encoder folder
            model, info = AutoModelForQuestionAnswering.from_pretrained(str(path), output_loading_info=True, **overrides)
        missing = [k for k in info["missing_keys"] if not k.startswith(_SPAN_HEAD_PREFIX)]
        if missing:
            raise ValueError(f"{path}: reader encoder weights missing (would be random): {sorted(missing)[:8]}")
        mlp_file = Path(path) / SPAN_MLP_FILE
        saved = None
        if mlp_file.exists():
            from safetensors.torch import load_file

            saved = load_file(str(mlp_file))
        scorer = span_scorer or ("mlp" if saved is not None else "linear")
        if saved is not None and scorer == "mlp":
            span_hidden = saved["norm.weight"].numel()
        reader = cls(model, scorer, span_hidden)
        if saved is not None and reader.span_mlp is not None:
            reader.span_mlp.load_state_dict(saved)
        return reader

    def save_pretrained(self, out_dir: str | os.PathLike, tokenizer: Any = None) -> None:
        self.qa_model.save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
        if self.span_mlp is not None:
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous().cpu() for k, v in self.span_mlp.state_dict().items()},
                      str(Path(out_dir) / SPAN_MLP_FILE))

    @property
    def config(self) -> Any:
        return self.qa_model.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The linear head's start/end logits (N, L) each (HF's QA forward)."""
        out = self.qa_model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return out.start_logits, out.end_logits  # (N, L) each

    def span_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor,
                    max_answer_tokens: int, chunk_rows: int = 0, chunk_tokens: int = 0) -> torch.Tensor:
        """f(s) (N, L, A): [n, i, w] scores the span i..i+w (unmasked; `span_valid` says which are spans).
        `chunk_rows` > 0 (or else `chunk_tokens` > 0): the rows run longest first in chunks of that many
        rows (of about that many tokens), each cut to its widest row (`encoder.run_length_chunks`), and
        come back in their own order at width L, NEG past a chunk's width (past the row's end: no valid
        span there). Both 0: one forward at width L, the reference; they agree on every valid span up
        to float noise."""
        scores = lambda ids, mask, types: self._span_scores(ids, mask, types, max_answer_tokens)  # noqa: E731
        return run_length_chunks(scores, input_ids, attention_mask, token_type_ids, chunk_rows=chunk_rows,
                                 chunk_tokens=chunk_tokens, pad_value=NEG)  # (N, L, A)

    def _span_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor,
                     max_answer_tokens: int) -> torch.Tensor:
        """f(s) (N, L, A) in one forward over the rows as given."""
        if self.span_mlp is None:
            start, end = self(input_ids, attention_mask, token_type_ids)  # (N, L) each
            return start.float()[:, :, None] + span_pairs(end.float(), max_answer_tokens, NEG)  # (N, L, A)
        hidden = self.qa_model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                          token_type_ids=token_type_ids).last_hidden_state  # (N, L, H)
        return self.span_mlp(hidden, max_answer_tokens)


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
    `reader_chunk_rows`: the reader's length bucketing (`SpanReader.span_scores`; 0 = off). It changes
    speed, not results (float noise aside), so it is a run setting, not saved in openqa_config.json.
    `length_chunk_tokens` (0 = off; the Trainer sets it from `compute.length_chunk_tokens`, as on every
    tower it trains): chunks of about that many tokens instead, in its place.
    """

    def __init__(self, retriever: nn.Module | None, reader: SpanReader, max_answer_tokens: int = 10,
                 span_softmax: str = "per_block", reader_chunk_rows: int = 0):
        super().__init__()
        if max_answer_tokens < 1:
            raise ValueError(f"max_answer_tokens must be >= 1, got {max_answer_tokens}")
        if reader_chunk_rows < 0:
            raise ValueError(f"reader_chunk_rows must be >= 0 (0 = one forward over all rows), got {reader_chunk_rows}")
        self.reader_chunk_rows = reader_chunk_rows  # how the reader runs, not what it is: not saved
        self.length_chunk_tokens = 0
        if span_softmax not in SPAN_SOFTMAX:
            raise ValueError(f"span_softmax must be one of {SPAN_SOFTMAX}, got {span_softmax!r}")
        self.retriever, self.reader, self.max_answer_tokens = retriever, reader, max_answer_tokens
        self.span_softmax = span_softmax
        if getattr(retriever, "share_towers", True) is False:
            # A REALM retriever with untied towers: its passage tower made the frozen index and gets
            # no gradient here. Frozen (requires_grad False), DDP leaves it out of the gradient
            # reduction whatever find_unused_parameters says, and AdamW holds no state for it.
            for p in [*retriever.passage_encoder.parameters(), *retriever.passage_projection.parameters()]:
                p.requires_grad_(False)

    # -- S(z) and p(z | x) ---------------------------------------------------------------------------
    def _query(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        if self.retriever is None or batch.get("block_embeddings") is None:
            return None
        return self.retriever.encode_query(batch["query_input_ids"], batch["query_attention_mask"]).float()  # (B, D)

    @staticmethod
    def _scores(q: torch.Tensor | None, emb: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """S(z) = q . e_z (B, K) over frozen embeddings (detached: the index never trains); 0 (every
        block equally likely) without a query tower or embeddings."""
        if q is None or emb is None:
            return torch.zeros(mask.shape, device=mask.device)
        return torch.einsum("bd,bkd->bk", q, emb.detach().float())  # (B, K)

    def retrieval_scores(self, batch: dict[str, torch.Tensor], q: torch.Tensor | None = None) -> torch.Tensor:
        """S(z) (B, K) of the top k: the query tower re-scores the retrieved blocks' frozen embeddings."""
        q = self._query(batch) if q is None else q
        return self._scores(q, batch.get("block_embeddings"), batch["candidate_mask"])

    def retrieval_log_probs(self, batch: dict[str, torch.Tensor], q: torch.Tensor | None = None) -> torch.Tensor:
        """log p(z | x) (B, K) over the top k."""
        return masked_log_softmax(self.retrieval_scores(batch, q), batch["candidate_mask"], (1,))  # (B, K)

    # -- f(s) and p(s | x, z) -----------------------------------------------------------------------
    def span_scores(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(f(s), valid), each (B, K, L, A): the reader over all B*K (x, z) pairs, in length-sorted
        chunks of about `length_chunk_tokens` tokens, else of `reader_chunk_rows` rows (both 0: all at
        once); either way at the batch's width L."""
        B, K, L = batch["input_ids"].shape
        flat = lambda t: t.reshape(B * K, L)  # noqa: E731
        rows = 0 if self.length_chunk_tokens else self.reader_chunk_rows
        scores = self.reader.span_scores(flat(batch["input_ids"]), flat(batch["attention_mask"]),
                                         flat(batch["token_type_ids"]), self.max_answer_tokens,
                                         rows, self.length_chunk_tokens)  # (B*K, L, A)
        ctx = batch["context_mask"]
        # Spans start/end on word boundaries when the collator says where they are (every correct
        # span does), so no probability mass goes to "##ing"-like fragments the metric can't match.
        may_start, may_end = batch.get("span_start_mask", ctx) & ctx, batch.get("span_end_mask", ctx) & ctx
        valid = span_valid(flat(may_start), flat(may_end), self.max_answer_tokens)  # (B*K, L, A)
        return scores.view(B, K, L, -1), valid.view(B, K, L, -1)

    def span_log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """log p(s | x, z) (B, K, L, A), normalised within each block."""
        scores, valid = self.span_scores(batch)
        return masked_log_softmax(scores, valid, (2, 3))  # (B, K, L, A)

    def joint_log_probs(self, batch: dict[str, torch.Tensor], q: torch.Tensor | None = None) -> torch.Tensor:
        """log p(z, s | x) (B, K, L, A), normalised as `span_softmax` says (module docstring)."""
        if self.span_softmax == "per_block":
            return self.retrieval_log_probs(batch, q)[:, :, None, None] + self.span_log_probs(batch)
        scores, valid = self.span_scores(batch)
        valid = valid & batch["candidate_mask"][:, :, None, None]
        logits = scores + self.retrieval_scores(batch, q)[:, :, None, None]  # ORQA: f(s) + S(z)
        return masked_log_softmax(logits, valid, (1, 2, 3))  # (B, K, L, A)

    def beam_retrieval_nll(self, batch: dict[str, torch.Tensor], q: torch.Tensor | None = None) -> torch.Tensor:
        """ORQA's early update (B,): -log sum_{z in beam, has answer} softmax_beam S(z); 0 where the
        beam holds no answer. Without a beam, over the top k with `answer_in_block`."""
        q = self._query(batch) if q is None else q
        if "beam_embeddings" in batch:
            mask, correct = batch["beam_mask"], batch["beam_has_answer"]
            scores = self._scores(q, batch["beam_embeddings"], mask)  # (B, Bm)
        else:
            mask, correct = batch["candidate_mask"], batch["answer_in_block"]
            scores = self._scores(q, batch.get("block_embeddings"), mask)  # (B, K)
        return marginal_nll(masked_log_softmax(scores, mask, (1,)), correct & mask)

    # -- training ----------------------------------------------------------------------------------
    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        correct = batch["correct_spans"]  # (B, K, L, A) bool
        if correct.size(-1) != self.max_answer_tokens:
            raise ValueError(f"batch built for max_answer_tokens={correct.size(-1)}, model has {self.max_answer_tokens}")
        cand = batch["candidate_mask"]  # (B, K)
        q = self._query(batch)  # (B, D) or None: one query encoding for both terms
        joint = self.joint_log_probs(batch, q)  # (B, K, L, A) log p(z, s | x)
        correct = correct & cand[:, :, None, None]

        retrieval_nll = self.beam_retrieval_nll(batch, q)  # (B,)
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
            "beam_answerable": (batch["beam_has_answer"] & batch["beam_mask"]).any(1).float().mean()
            if "beam_has_answer" in batch else batch["answer_in_block"].any(1).float().mean(),
            "span_acc": span_acc,  # the argmax (z, s) is a correct span
            "num_tokens": batch["attention_mask"].sum() + batch["query_attention_mask"].sum(),
        }

    # -- inference ---------------------------------------------------------------------------------
    @torch.no_grad()
    def predict_batch(self, batch: dict[str, torch.Tensor], block_texts: Sequence[Sequence[str | None]]) -> list[dict]:
        """Best span per question: [{"answer", "block", "start", "end", "score"}], score =
        log p(z, s | x). No valid span (closed-book / null document only) -> answer "".
        A batch with no passage at all (closed-book) skips the forward: every span lies in a passage,
        so its answers are those the decode gives every null-document row (`_decode`)."""
        if all(t is None for texts in block_texts for t in texts):
            return [dict(NO_SPAN) for _ in block_texts]
        return self._decode(self.joint_log_probs(batch), batch, block_texts)

    @staticmethod
    def _decode(joint: torch.Tensor, batch: dict[str, torch.Tensor], block_texts: Sequence[Sequence[str | None]]) -> list[dict]:
        """The best span per question from the joint scores (B, K, L, A)."""
        B, K, L, A = joint.shape
        score, best = joint.reshape(B, -1).max(1)
        offsets = batch["z_char_offsets"]  # (B, K, L, 2)
        out = []
        for b in range(B):
            k, rem = divmod(int(best[b]), L * A)
            i, w = divmod(rem, A)
            if score[b] < NEG / 2 or k >= len(block_texts[b]) or block_texts[b][k] is None:
                out.append(dict(NO_SPAN))
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
            model.reader.save_pretrained(tmp / "reader", tokenizer)
            write_json_atomic(tmp / OPENQA_CONFIG, {"max_answer_tokens": model.max_answer_tokens,
                                                    "span_softmax": model.span_softmax,
                                                    "span_scorer": model.reader.span_scorer,
                                                    "retriever_type": type(model.retriever).__name__ if model.retriever is not None else None})
        return Path(out_dir)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, reader_chunk_rows: int = 0) -> "OpenQA":
        """A folder of `save_pretrained`; `reader_chunk_rows` as in the constructor (not saved)."""
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
        reader = SpanReader.from_pretrained(path / "reader", span_scorer=cfg.get("span_scorer", "linear"))
        return cls(retriever, reader, cfg["max_answer_tokens"], cfg.get("span_softmax", "per_block"), reader_chunk_rows)
