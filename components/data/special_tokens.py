"""The token schema every collator and model shares: the special ids, and the label of positions
that carry no loss. One definition, so that a tokenizer's ids reach masking, REALM's
`[CLS] x [SEP] z [SEP]` inputs and the readers by the same names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

IGNORE_INDEX = -100  # label of positions that carry no loss (torch cross_entropy's default)
# Candidate-row sentinels of a retrieved top-k (REALM pre-training and open-QA batches).
NULL_ROW = -1     # the null document: an empty z, `[CLS] x [SEP] [SEP]`
MISSING_ROW = -2  # no document in this slot (the index returned fewer than K): masked out


@dataclass(frozen=True)
class SpecialTokens:
    """Special token ids. `special` are never masked nor drawn as random replacements; `vocab_size`
    bounds the replacement draw (0 when a caller needs only the four ids)."""

    pad: int
    cls: int
    sep: int
    mask: int
    vocab_size: int = 0
    special: tuple[int, ...] = field(default=())

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "SpecialTokens":
        return cls(
            pad=tokenizer.pad_token_id, cls=tokenizer.cls_token_id, sep=tokenizer.sep_token_id,
            mask=tokenizer.mask_token_id, vocab_size=len(tokenizer),
            special=tuple(sorted(set(tokenizer.all_special_ids))),
        )

    def replacement_ids(self) -> torch.Tensor:
        """Ids the 10% 'random token' corruption may draw from: the vocabulary minus specials."""
        if self.vocab_size <= 0:
            raise ValueError("SpecialTokens.vocab_size is 0: build it with SpecialTokens.from_tokenizer")
        banned = set(self.special) | {self.pad, self.cls, self.sep, self.mask}
        keep = torch.ones(self.vocab_size, dtype=torch.bool)
        keep[[i for i in banned if 0 <= i < self.vocab_size]] = False
        return keep.nonzero().squeeze(1)
