"""Open-QA fine-tuning batches: gold answers located as whole-word token spans of the retrieved
blocks, and the (B, K, L) `[CLS] x [SEP] z [SEP]` tensors the retriever + reader
(components/models/reader.py) reads.

    collate = QACollator(tok, blocks, block_vecs, query_len=32, passage_len=80, top_k=5, max_answer_tokens=10)
    batch = collate(rows)        # rows: {question, answers, block_rows: [top-k block rows]}
    # ORQA: every call searches the frozen index with the query tower as it is now (a top-B beam)
    collate = QACollator(tok, blocks, block_vecs, top_k=5, retrieve=search_fn, beam=5000)
    batch = collate(rows)        # rows: {question, answers}; + beam_embeddings / beam_mask / beam_has_answer

A correct span is any (i, j) whose text equals a gold answer after SQuAD normalisation
(`find_answer_spans`); spans never cut a word (`word_boundaries`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from components.data.special_tokens import MISSING_ROW, NULL_ROW
from components.data.text import normalize_answer


# ----------------------------------------------------------------------------------------------
# gold answers -> token spans
# ----------------------------------------------------------------------------------------------
def _word_char(c: str) -> bool:
    return c.isalnum()


def word_boundaries(block_token_offsets: Sequence[Sequence[int]], block_text: str) -> tuple[list[bool], list[bool]]:
    """(may_start, may_end) per token: a span may not cut a word, i.e. start or end inside a run of
    letters/digits (a WordPiece continuation piece never starts a span, nor precedes its end)."""
    starts, ends = [], []
    for s, e in ((int(a), int(b)) for a, b in block_token_offsets):
        starts.append(e > s and not (0 < s < len(block_text) and _word_char(block_text[s - 1]) and _word_char(block_text[s])))
        ends.append(e > s and not (0 < e < len(block_text) and _word_char(block_text[e - 1]) and _word_char(block_text[e])))
    return starts, ends


def find_answer_spans(
    block_token_offsets: Sequence[Sequence[int]], block_text: str, answers: Sequence[str], max_answer_tokens: int,
) -> list[tuple[int, int]]:
    """Every token span (start, end), inclusive, of at most `max_answer_tokens` tokens whose text
    equals a gold answer after SQuAD normalisation (lowercase, no punctuation, no a/an/the,
    collapsed whitespace), so "The Ardel River," matches "ardel river".

    `block_token_offsets[t] = [char_start, char_end)` of token t in `block_text`. A span may not
    cut a word (`word_boundaries`), so WordPiece pieces of a longer word never match ("kessa" is
    not found in "Kessaville").
    """
    golds = {g for g in (normalize_answer(a) for a in answers) if g}
    if not golds or not block_token_offsets:
        return []
    norm_text = normalize_answer(block_text)
    if not any(g in norm_text for g in golds):  # necessary condition: skip the O(n*A) scan
        return []
    may_start, may_end = word_boundaries(block_token_offsets, block_text)
    n, out = len(block_token_offsets), []
    for i in range(n):
        if not may_start[i]:
            continue
        s = int(block_token_offsets[i][0])
        for j in range(i, min(n, i + max_answer_tokens)):
            if may_end[j] and normalize_answer(block_text[s : int(block_token_offsets[j][1])]) in golds:
                out.append((i, j))
    return out


def has_answer(norm_block_text: str, golds: Sequence[str]) -> bool:
    """Whether a block holds a gold answer string as whole words, both normalised
    (`normalize_answer`): ORQA's has-answer mark of the retrieval beam (orqa ops `has_answer`)."""
    text = f" {norm_block_text} "
    return any(f" {g} " in text for g in golds)


# ----------------------------------------------------------------------------------------------
# collation
# ----------------------------------------------------------------------------------------------
def _pad(seqs: list[list], value: Any) -> list[list]:
    L = max((len(s) for s in seqs), default=0)
    return [list(s) + [value] * (L - len(s)) for s in seqs]


class QACollator:
    """Rows {question, answers, block_rows} -> the (B, K, L) batch `OpenQA.forward` takes.

    `blocks`: the retrieval blocks (the tokenize stage's `data/tokens/blocks` dataset, or a list of
    dicts with `text` and, ideally, `input_ids` + `offsets`; without them the text is tokenized
    here). `block_embeddings` (N, D): the frozen index's vectors, row-aligned with `blocks`.
    `block_rows`: the top-k rows the index returned (NULL_ROW = null document, MISSING_ROW = empty
    slot); fewer than `top_k` are padded with empty slots, more are cut.

    Output: query_input_ids / query_attention_mask (B, Lq) `[CLS] x [SEP]` (the query tower's input);
    input_ids / attention_mask / token_type_ids (B, K, L) `[CLS] x [SEP] z [SEP]` with
    x <= query_len - 2 and z <= passage_len - 2 tokens (what `[CLS] z [SEP]` of the index held);
    context_mask (B, K, L) (z tokens); span_start_mask / span_end_mask (B, K, L) (z tokens that
    may start / end an answer: not inside a word, see `word_boundaries`); z_char_offsets
    (B, K, L, 2) (char span in the block text, -1 outside z); correct_spans (B, K, L, A);
    answer_in_block, candidate_mask, candidate_rows (B, K); block_embeddings (B, K, D) float32
    (zeros for the null document / empty slots).

    `retrieve` (questions, n) -> (B, n) table rows (-1 padded): a search of the frozen index with
    the current query tower (`retrieval.search.tower_search_fn`). Given, every call retrieves each
    question's top `beam` and ignores `block_rows`: the reader reads the first `top_k`, and the
    batch adds beam_rows / beam_mask / beam_has_answer (B, Bm) and beam_embeddings (B, Bm, D) for
    ORQA's retrieval loss over the beam. It runs in the training loop's process at each step, so
    the trainer must collate in-process (num_workers 0): a worker would hold a stale copy.
    """

    def __init__(self, tokenizer: Any, blocks: Any = None, block_embeddings: np.ndarray | None = None, *,
                 query_len: int = 32, passage_len: int = 80, top_k: int = 5, max_answer_tokens: int = 10,
                 retrieve: Callable[[Sequence[str], int], np.ndarray] | None = None, beam: int | None = None):
        self.tokenizer, self.blocks = tokenizer, blocks
        self.block_embeddings = None if block_embeddings is None else np.asarray(block_embeddings, dtype=np.float32)
        if self.blocks is not None and self.block_embeddings is not None and len(self.blocks) != len(self.block_embeddings):
            raise ValueError(f"{len(self.blocks)} blocks but {len(self.block_embeddings)} block embeddings")
        self.query_len, self.passage_len, self.top_k, self.max_answer_tokens = query_len, passage_len, top_k, max_answer_tokens
        self.cls, self.sep, self.pad = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id
        self._span_cache: dict[tuple[int, tuple[str, ...]], tuple[tuple[int, int], ...]] = {}
        if retrieve is not None and (self.block_embeddings is None or self.blocks is None):
            raise ValueError("retrieve needs the blocks and their index embeddings")
        self.retrieve = retrieve
        self.beam = max(top_k, beam if beam is not None else top_k)
        self._norm_text: dict[int, str] = {}

    @classmethod
    def from_params(cls, tokenizer: Any, blocks: Any, block_embeddings: np.ndarray | None, p: Any,
                    top_k: int | None = None, retrieve: Callable | None = None) -> "QACollator":
        """`p`: a FinetuneParams (query_len, passage_len, qa_top_k, max_answer_tokens,
        qa_retrieval_beam); `top_k` overrides qa_top_k (1 for the reader's own-paragraph phase: no
        padded empty slots); `retrieve`: search each call with the current tower (class docstring)."""
        return cls(tokenizer, blocks, block_embeddings, query_len=p.query_len, passage_len=p.passage_len,
                   top_k=p.qa_top_k if top_k is None else top_k, max_answer_tokens=p.max_answer_tokens,
                   retrieve=retrieve, beam=p.qa_retrieval_beam if retrieve is not None else None)

    # -- pieces ------------------------------------------------------------------------------------
    def _block_tokens(self, block: dict) -> tuple[list[int], list[list[int]]]:
        """(z token ids, char offsets), cut to passage_len - 2 tokens."""
        n = self.passage_len - 2
        if block.get("input_ids") is not None and block.get("offsets") is not None:
            ids, offs = list(block["input_ids"]), [list(o) for o in block["offsets"]]
        else:
            enc = self.tokenizer(block["text"], add_special_tokens=False, return_offsets_mapping=True)
            ids, offs = enc["input_ids"], [list(o) for o in enc["offset_mapping"]]
        return [int(t) for t in ids[:n]], [[int(a), int(b)] for a, b in offs[:n]]

    def _spans(self, row: int, answers: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
        """find_answer_spans for table block `row`, cached: the same (block, answers) pairs recur
        every epoch. A plain dict (bounded by clearing), so the collator stays picklable for workers."""
        key = (row, answers)
        hit = self._span_cache.get(key)
        if hit is None:
            block = self.blocks[row]
            _, offs = self._block_tokens(block)
            hit = tuple(find_answer_spans(offs, block["text"], answers, self.max_answer_tokens))
            if len(self._span_cache) >= 200_000:
                self._span_cache.clear()
            self._span_cache[key] = hit
        return hit

    def _has_answer(self, row: int, golds: tuple[str, ...]) -> bool:
        text = self._norm_text.get(row)
        if text is None:
            if len(self._norm_text) >= 2_000_000:
                self._norm_text.clear()
            text = self._norm_text[row] = normalize_answer(self.blocks[row]["text"])
        return has_answer(text, golds)

    def beam_batch(self, questions: Sequence[str], answers: Sequence[Sequence[str]]) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
        """(top_k rows (B, K), the beam's tensors) from `retrieve`: beam_rows / beam_mask /
        beam_has_answer (B, Bm), beam_embeddings (B, Bm, D) (0 in empty slots)."""
        rows = np.asarray(self.retrieve(list(questions), self.beam), dtype=np.int64)  # (B, Bm), -1 = none
        rows = np.where(rows >= 0, rows, MISSING_ROW)
        ok = rows >= 0
        golds = [tuple(g for g in (normalize_answer(a) for a in ans) if g) for ans in answers]
        marks = np.array([[bool(ok[b, j]) and bool(golds[b]) and self._has_answer(int(rows[b, j]), golds[b])
                           for j in range(rows.shape[1])] for b in range(rows.shape[0])], dtype=bool).reshape(rows.shape)
        emb = self.block_embeddings[np.clip(rows, 0, None)] * ok[..., None]  # (B, Bm, D)
        return rows[:, : self.top_k], {"beam_rows": torch.from_numpy(rows), "beam_mask": torch.from_numpy(ok),
                                       "beam_has_answer": torch.from_numpy(marks),
                                       "beam_embeddings": torch.from_numpy(emb.astype(np.float32))}

    def _question_tokens(self, question: str) -> list[int]:
        return self.tokenizer(question, add_special_tokens=False)["input_ids"][: self.query_len - 2]

    # -- building the batch ------------------------------------------------------------------------
    def encode(self, questions: Sequence[str], blocks: Sequence[Sequence[dict | None]],
               embeddings: Sequence[np.ndarray] | None = None, answers: Sequence[Sequence[str]] | None = None,
               rows: Sequence[Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
        """The batch for explicit blocks: blocks[b][k] a block dict or None (the null document);
        embeddings[b] (len(blocks[b]), D); answers[b] gold strings (none at inference); rows[b][k]
        the blocks' table rows (span cache, `candidate_rows`; MISSING_ROW marks an empty slot).
        K = the longest blocks[b] (at least 1); shorter lists are padded with empty slots."""
        B = len(questions)
        K = max(1, max((len(z) for z in blocks), default=0))
        A = self.max_answer_tokens
        seqs, types, ctx, offs, spans, cand_rows, real = [], [], [], [], [], [], []
        may_start, may_end = [], []
        x_seqs = []
        for b, question in enumerate(questions):
            x = self._question_tokens(question)
            x_seqs.append([self.cls, *x, self.sep])
            z0 = len(x) + 2  # first z position: after [CLS] x [SEP]
            gold = tuple(answers[b]) if answers is not None else ()
            for k in range(K):
                if rows is not None and k < len(rows[b]):
                    row = int(rows[b][k])
                elif k >= len(blocks[b]):
                    row = MISSING_ROW
                else:  # explicit blocks: their position in the list (the null document: NULL_ROW)
                    row = NULL_ROW if blocks[b][k] is None else k
                block = blocks[b][k] if k < len(blocks[b]) and row != MISSING_ROW else None
                real.append(block is not None)
                z, z_offs = self._block_tokens(block) if block is not None else ([], [])
                seqs.append([self.cls, *x, self.sep, *z, self.sep])
                types.append([0] * z0 + [1] * (len(z) + 1))
                ctx.append([False] * z0 + [True] * len(z) + [False])
                ws, we = word_boundaries(z_offs, block["text"]) if block is not None else ([], [])
                may_start.append([False] * z0 + ws + [False])
                may_end.append([False] * z0 + we + [False])
                offs.append([[-1, -1]] * z0 + z_offs + [[-1, -1]])
                if block is None or not gold:
                    found: Sequence[tuple[int, int]] = ()
                elif rows is not None and row >= 0 and self.blocks is not None:
                    found = self._spans(row, gold)
                else:
                    found = find_answer_spans(z_offs, block["text"], gold, A)
                spans.append([(z0 + s, e - s) for s, e in found])
                cand_rows.append(row)
        L = max(len(s) for s in seqs)
        correct = torch.zeros(B * K, L, A, dtype=torch.bool)
        for n, found in enumerate(spans):
            for i, w in found:
                correct[n, i, w] = True
        cand_rows_t = torch.tensor(cand_rows, dtype=torch.long).view(B, K)
        batch = {
            "query_input_ids": torch.tensor(_pad(x_seqs, self.pad), dtype=torch.long),
            "query_attention_mask": torch.tensor(_pad([[1] * len(s) for s in x_seqs], 0), dtype=torch.long),
            "input_ids": torch.tensor(_pad(seqs, self.pad), dtype=torch.long).view(B, K, L),
            "attention_mask": torch.tensor(_pad([[1] * len(s) for s in seqs], 0), dtype=torch.long).view(B, K, L),
            "token_type_ids": torch.tensor(_pad(types, 0), dtype=torch.long).view(B, K, L),
            "context_mask": torch.tensor(_pad(ctx, False), dtype=torch.bool).view(B, K, L),
            "span_start_mask": torch.tensor(_pad(may_start, False), dtype=torch.bool).view(B, K, L),
            "span_end_mask": torch.tensor(_pad(may_end, False), dtype=torch.bool).view(B, K, L),
            "z_char_offsets": torch.tensor(_pad(offs, [-1, -1]), dtype=torch.long).view(B, K, L, 2),
            "correct_spans": correct.view(B, K, L, A),
            "answer_in_block": correct.view(B, K, -1).any(2),
            "candidate_mask": cand_rows_t != MISSING_ROW,
            "candidate_rows": cand_rows_t,
        }
        if embeddings is not None:
            D = next((np.asarray(e).shape[-1] for e in embeddings if len(e)), 1)
            emb = np.zeros((B, K, D), dtype=np.float32)
            for b, e in enumerate(embeddings):
                for k in range(min(K, len(e))):
                    if real[b * K + k]:
                        emb[b, k] = e[k]  # the null document and empty slots keep 0
            batch["block_embeddings"] = torch.from_numpy(emb)
        return batch

    def __call__(self, rows: Sequence[dict], generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Training rows -> batch (K = top_k always, so shapes are fixed). `generator` is unused
        (nothing random here); it is accepted for the trainer's collate signature."""
        if self.blocks is None:
            raise ValueError("QACollator needs `blocks` (and `block_embeddings`) to collate rows with block_rows")
        beam: dict[str, torch.Tensor] = {}
        if self.retrieve is not None:
            top, beam = self.beam_batch([r["question"] for r in rows], [r.get("answers", []) for r in rows])
            rows = [{**r, "block_rows": top[i].tolist()} for i, r in enumerate(rows)]
        blocks, embs, table_rows = [], [], []
        for r in rows:
            rr = [int(x) for x in list(r["block_rows"])[: self.top_k]]
            rr += [MISSING_ROW] * (self.top_k - len(rr))
            table_rows.append(rr)
            blocks.append([None if x < 0 else self.blocks[x] for x in rr])
            if self.block_embeddings is not None:
                embs.append(self.block_embeddings[np.clip(rr, 0, None)])  # rows < 0 are zeroed in encode
        batch = self.encode([r["question"] for r in rows], blocks, embs if self.block_embeddings is not None else None,
                            [r.get("answers", []) for r in rows], table_rows)
        return {**batch, **beam}
