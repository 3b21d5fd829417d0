"""Masking for retrieval-oriented pre-training: whole-word MLM masks, the RetroMAE decoder's
position-specific masks, and the batch collators.

    from components.data.masking import SpecialTokens, RetroMAECollator, MLMCollator
    ids = SpecialTokens.from_tokenizer(tokenizer)
    collate = RetroMAECollator(ids, params.retromae, seed=params.compute.seed)
    batch = collate(rows)            # rows: [{"input_ids": [...], "word_ids": [...]}, ...] (no specials)
    out = model(batch)               # components.models.retromae.RetroMAE

Whole-word masking, budget semantics (same as HF `DataCollatorForWholeWordMask._whole_word_mask`):
the words of a sequence are visited in a random order and a word is masked when it still fits in the
token budget `max(1, round(n * ratio))`; a word that does not fit is skipped and the walk goes on
(so shorter words later in the order can still fill the budget). One difference from HF: `n` counts
the maskable tokens only (HF counts [CLS]/[SEP] too), so the ratio is a ratio of real tokens.
The walk is vectorised as `passes` rounds of "take the longest prefix (in random order) of the
still-fitting words"; each round reproduces HF's walk up to the next skipped word and shrinks the
remaining gap, so `passes` rounds are exact whenever no word is longer than `passes` pieces
(otherwise the mask may be at most a few tokens under budget). Never more than the budget.

Randomness: collators draw everything from their own `torch.Generator` (seeded; `state_dict()` /
`load_state_dict()` for resume). The RetroMAE decoder masks are drawn later, on the model's device,
from a per-row `decoder_seed` the collator emits, through `counter_hash` (a stateless hash, so the
masks are a pure function of the batch: integer arithmetic and a stable sort give the same masks
on any device, and again after a resume):

    pool = decoder_mask_pool(word_ids, seed, ratio, pool_size)      # (B, P, L) whole-word masks
    choice = decoder_row_choice(seed, attention_mask, pool.size(1))  # (B, L) pool entry of each row
    visible = position_specific_mask(pool, choice, attention_mask)   # (B, L, L) what row i may read
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from components.data.special_tokens import IGNORE_INDEX, SpecialTokens


# ----------------------------------------------------------------------------------------------
# whole-word masks (pure functions of their inputs; run on any device)
# ----------------------------------------------------------------------------------------------
def mask_budget(n_tokens: torch.Tensor, ratio: float) -> torch.Tensor:
    """Tokens to mask per sequence: max(1, round(n * ratio)), 0 for an empty sequence."""
    budget = torch.round(n_tokens.double() * ratio).long().clamp(min=1)
    return torch.where(n_tokens > 0, budget, torch.zeros_like(budget))


def whole_word_mask(word_ids: torch.Tensor, ratio: float, word_keys: torch.Tensor, passes: int = 4) -> torch.Tensor:
    """Pick whole words until `round(n * ratio)` tokens are masked (see the module docstring).

    word_ids:  (N, L) long, word index of each token in [0, W); -1 = never mask (specials, pad).
    word_keys: (N, W) random priority of each word id (any real dtype; lower is visited first).
    returns    (N, L) bool, True = masked.
    """
    N, L = word_ids.shape
    W = word_keys.size(1)
    maskable = word_ids >= 0  # (N, L)
    wid = word_ids.clamp(min=0)  # (N, L) -1 -> 0, then zeroed by `maskable` wherever it matters
    # int32 counts: half the memory traffic of int64 on the (N, W) work arrays (N = B * pool size).
    word_len = torch.zeros(N, W, dtype=torch.int32, device=word_ids.device)
    word_len.scatter_add_(1, wid, maskable.int())  # (N, W) tokens per word id (0 = no such word)
    gap = mask_budget(maskable.sum(1), ratio).int().unsqueeze(1)  # (N, 1) tokens still to mask

    # Random visiting order of the words; ids with no tokens sort last.
    last = torch.inf if word_keys.is_floating_point() else torch.iinfo(word_keys.dtype).max
    # stable: equal keys (rare 32-bit hash ties) break by word id, the same way on every device
    order = torch.argsort(word_keys.masked_fill(word_len == 0, last), dim=1, stable=True)  # (N, W)
    sorted_len = word_len.gather(1, order)  # (N, W) word lengths in visiting order
    free = sorted_len > 0  # (N, W) real words not taken yet
    for k in range(passes):
        # Usually the first round fills every budget (most words are one piece): stop early. On a
        # GPU this is a sync, but RetroMAE builds its masks right after one, so the queue is empty.
        if k and not bool((gap > 0).any()):
            break
        # Words HF's walk could still take: free and individually fitting the gap. The prefix of
        # them whose running length fits is exactly what the walk takes before its next skip.
        fits = free & (sorted_len <= gap)  # (N, W)
        running = torch.where(fits, sorted_len, 0).cumsum(1, dtype=torch.int32)  # (N, W)
        take = fits & (running <= gap)
        free &= ~take
        gap = gap - torch.where(take, running, 0).amax(1, keepdim=True)  # running total at the last take

    taken = (sorted_len > 0) & ~free  # (N, W) in visiting order
    chosen = torch.zeros_like(taken).scatter_(1, order, taken)  # (N, W) back in word-id order
    return chosen.gather(1, wid) & maskable  # (N, L) every piece of a chosen word


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finaliser (xor-shift-multiply). Values stay < 2**32 and the multiplier is
    # < 2**27, so int64 arithmetic never overflows and every device computes the same bits.
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def counter_hash(seed: torch.Tensor, *counters: torch.Tensor) -> torch.Tensor:
    """Stateless random bits: a hash of (seed, counters...) in [0, 2**32), broadcast over the inputs.

    Used instead of a stateful generator for the RetroMAE decoder masks: they are built on the
    model's device from the batch's `decoder_seed`, without a host sync and reproducibly on resume.
    """
    h = _mix32(seed.long() & _M32)
    for c in counters:
        h = _mix32((h + (c.long() & _M32) * 0x9E3779B9 + 0x7F4A7C15) & _M32)
    return h


def mlm_corrupt(
    input_ids: torch.Tensor, mask: torch.Tensor, ids: SpecialTokens, generator: torch.Generator,
    replacement_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's 80/10/10: masked positions become [MASK] (80%), a random non-special token (10%),
    or stay (10%). Returns (corrupted input_ids, labels = original id where masked else -100)."""
    pool = ids.replacement_ids() if replacement_ids is None else replacement_ids
    # Draw for every position (not only the masked ones) so the generator advances by a fixed
    # amount per batch shape: reproducible and independent of which positions were masked.
    u = torch.rand(input_ids.shape, generator=generator)
    random_tok = pool[torch.randint(len(pool), input_ids.shape, generator=generator)]
    out = torch.where(mask & (u < 0.8), torch.full_like(input_ids, ids.mask), input_ids)
    out = torch.where(mask & (u >= 0.8) & (u < 0.9), random_tok, out)
    labels = torch.where(mask, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    return out, labels


# ----------------------------------------------------------------------------------------------
# enhanced decoding: the position-specific attention mask
# ----------------------------------------------------------------------------------------------
# Independent random streams of the decoder masks (inputs to `counter_hash` next to the row seed).
_STREAM_POOL, _STREAM_ROW = 1, 2


def decoder_mask_pool(word_ids: torch.Tensor, seed: torch.Tensor, ratio: float, pool_size: int, passes: int = 4) -> torch.Tensor:
    """P whole-word masks per sequence at `ratio` (True = hidden from the decoder).

    word_ids (B, L) long (-1 = special/pad: never masked), seed (B,) long -> (B, P, L) bool with
    P = min(pool_size, L): a row never needs more pool entries than it has positions (the reference
    collator draws min(len, 128) masks).
    """
    B, L = word_ids.shape
    P = min(pool_size, L)
    dev = word_ids.device
    p = torch.arange(P, device=dev).view(1, P, 1)
    w = torch.arange(L, device=dev).view(1, 1, L)  # word ids are < L (renumbered per row by the collator)
    keys = counter_hash(seed.view(B, 1, 1), torch.tensor(_STREAM_POOL, device=dev), p, w)  # (B, P, L) int word priorities
    words = word_ids[:, None, :].expand(B, P, L).reshape(B * P, L)  # (B*P, L)
    return whole_word_mask(words, ratio, keys.reshape(B * P, L), passes).view(B, P, L)


def decoder_row_choice(seed: torch.Tensor, attention_mask: torch.Tensor, pool_size: int) -> torch.Tensor:
    """Which pool entry each decoder row i uses: (B, L) long, uniform over the row's first
    min(n_b, P) entries (n_b = real tokens incl. specials, as the reference collator)."""
    B, L = attention_mask.shape
    n = attention_mask.sum(1).clamp(min=1, max=pool_size)  # (B,)
    i = torch.arange(L, device=attention_mask.device).view(1, L)
    return counter_hash(seed.view(B, 1), torch.tensor(_STREAM_ROW, device=seed.device), i) % n.view(B, 1)  # (B, L)


def position_specific_mask(pool: torch.Tensor, choice: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """visible[b, i, j] (B, L, L) bool: may decoder row i attend to position j?

    Row i sees everything its pool draw leaves unmasked, except itself (it must predict its own
    token) and padding. Position 0 holds the sentence embedding and is never in a pool mask (special
    token), so every row but row 0 sees it; this also keeps padded rows from being all-False (SDPA
    would return NaN there). Row 0 ([CLS], no loss) still sees [SEP] and the unmasked tokens.
    """
    B, P, L = pool.shape
    hidden = pool.gather(1, choice.view(B, L, 1).expand(B, L, L))  # (B, L, L) row i's draw
    visible = ~hidden & attention_mask.bool().view(B, 1, L)  # padding keys never visible
    visible &= ~torch.eye(L, dtype=torch.bool, device=pool.device)  # never itself
    visible[:, 1:, 0] = True  # the sentence embedding, for every row but its own
    return visible


# ----------------------------------------------------------------------------------------------
# collators
# ----------------------------------------------------------------------------------------------
def _renumber_words(w: np.ndarray) -> np.ndarray:
    """Word ids 0, 1, 2... by change points (robust to blocks whose ids do not start at 0);
    negative input ids (tokens outside any word) stay -1 and are never masked."""
    if len(w) == 0:
        return w.astype(np.int64)
    new = np.concatenate([[0], np.cumsum(w[1:] != w[:-1])]).astype(np.int64)
    return np.where(w < 0, -1, new)


class MLMCollator:
    """Rows {input_ids, word_ids} (no specials) -> padded whole-word-masked MLM batch.

    Output (all torch tensors, B rows, L = longest row + 2 unless `pad_to_max_len`):
      encoder_input_ids (B, L) long  [CLS] tokens [SEP] [PAD]..., 80/10/10-corrupted at masked words
      attention_mask    (B, L) long  1 on real tokens (incl. [CLS]/[SEP]), 0 on padding
      encoder_labels    (B, L) long  original id at masked positions, -100 elsewhere
      word_ids          (B, L) long  word index (0-based per row); -1 on [CLS]/[SEP]/[PAD]
    """

    def __init__(
        self, ids: SpecialTokens, mask_ratio: float, max_len: int, *, seed: int = 0,
        pad_to_max_len: bool = False, passes: int = 4,
    ):
        if max_len < 3:
            raise ValueError(f"max_len={max_len} leaves no room for tokens between [CLS] and [SEP]")
        self.ids, self.mask_ratio, self.max_len = ids, float(mask_ratio), int(max_len)
        self.seed, self.pad_to_max_len, self.passes = int(seed), pad_to_max_len, passes
        self._replacement = ids.replacement_ids()
        self.generator = torch.Generator().manual_seed(self.seed)
        self._worker: int | None = None

    # -- resume -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.generator.set_state(state["generator"])

    def _gen(self) -> torch.Generator:
        # DataLoader workers each get a copy of the collator; give each its own stream (seeded by
        # seed and worker id) so they do not all draw the same masks. num_workers=0: the main stream.
        info = torch.utils.data.get_worker_info()
        if info is not None and self._worker != info.id:
            self._worker = info.id
            self.generator.manual_seed(self.seed * 1009 + 7919 * (info.id + 1))
        return self.generator

    # -- batching ---------------------------------------------------------------------------
    def pad(self, rows: Sequence[dict]) -> dict[str, torch.Tensor]:
        """Add [CLS]/[SEP], truncate to max_len, pad. Returns input_ids, attention_mask, word_ids."""
        room = self.max_len - 2
        toks = [np.asarray(r["input_ids"], dtype=np.int64)[:room] for r in rows]
        words = [_renumber_words(np.asarray(r["word_ids"], dtype=np.int64)[:room]) for r in rows]
        for t, w in zip(toks, words):
            if len(t) != len(w):
                raise ValueError(f"input_ids ({len(t)}) and word_ids ({len(w)}) differ in length")
        B = len(rows)
        L = self.max_len if self.pad_to_max_len else max(len(t) for t in toks) + 2
        input_ids = np.full((B, L), self.ids.pad, dtype=np.int64)
        word_ids = np.full((B, L), -1, dtype=np.int64)
        attention = np.zeros((B, L), dtype=np.int64)
        for b, (t, w) in enumerate(zip(toks, words)):  # one loop per row, slices inside
            n = len(t)
            input_ids[b, 0], input_ids[b, 1 : n + 1], input_ids[b, n + 1] = self.ids.cls, t, self.ids.sep
            word_ids[b, 1 : n + 1] = w
            attention[b, : n + 2] = 1
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention),
            "word_ids": torch.from_numpy(word_ids),
        }

    def encoder_mask(self, word_ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        keys = torch.rand(word_ids.shape, generator=generator, dtype=torch.float64)  # (B, W=L) word priorities
        return whole_word_mask(word_ids, self.mask_ratio, keys, self.passes)

    def mlm_batch(self, padded: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
        mask = self.encoder_mask(padded["word_ids"], generator)  # (B, L) bool
        enc_ids, labels = mlm_corrupt(padded["input_ids"], mask, self.ids, generator, self._replacement)
        return {
            "encoder_input_ids": enc_ids,
            "attention_mask": padded["attention_mask"],
            "encoder_labels": labels,
            "word_ids": padded["word_ids"],
        }

    def __call__(self, rows: Sequence[dict], generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        # The shared Trainer passes a generator seeded from (seed, step, rank, micro-batch): masks then
        # depend only on the step, so a resumed run draws exactly the masks of an uninterrupted one.
        return self.mlm_batch(self.pad(rows), generator if generator is not None else self._gen())


class RetroMAECollator(MLMCollator):
    """MLMCollator at `encoder_mask_ratio`, plus what the RetroMAE decoder needs:

      decoder_input_ids (B, L) long  the original (unmasked) ids incl. [CLS]/[SEP]/[PAD]
      decoder_seed      (B,)   long  per-row seed of the decoder's mask pool (drawn on device)
    """

    def __init__(self, ids: SpecialTokens, params: Any, *, seed: int = 0, pad_to_max_len: bool = False, passes: int = 4):
        # params: a RetroMAEParams (duck-typed: max_len, encoder_mask_ratio).
        super().__init__(ids, params.encoder_mask_ratio, params.max_len, seed=seed, pad_to_max_len=pad_to_max_len, passes=passes)

    def __call__(self, rows: Sequence[dict], generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        g = generator if generator is not None else self._gen()
        padded = self.pad(rows)
        batch = self.mlm_batch(padded, g)
        batch["decoder_input_ids"] = padded["input_ids"]
        batch["decoder_seed"] = torch.randint(0, 2**31 - 1, (len(rows),), generator=g)
        return batch
