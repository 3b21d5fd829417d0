"""Whole-word masks, 80/10/10 corruption and the MLM / RetroMAE collators.

    .venv/bin/python -m pytest tests/test_masking.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from components.config_shared import EncoderParams
from components.config_stages import RetroMAEParams
from components.data.masking import (
    IGNORE_INDEX, MLMCollator, RetroMAECollator, SpecialTokens, counter_hash, mask_budget,
    whole_word_mask,
)

IDS = SpecialTokens(pad=0, cls=2, sep=3, mask=4, vocab_size=120, special=(0, 1, 2, 3, 4))
HYP = settings(max_examples=40, deadline=None)


def hf_walk(word_ids: list[int], ratio: float, keys: list[float]) -> set[int]:
    """HF `_whole_word_mask`, written as the obvious loop: visit words by key, take one if it fits."""
    words: dict[int, list[int]] = {}
    for pos, w in enumerate(word_ids):
        if w >= 0:
            words.setdefault(w, []).append(pos)
    n = sum(len(v) for v in words.values())
    budget = max(1, round(n * ratio)) if n else 0
    chosen: set[int] = set()
    for w in sorted(words, key=lambda w: keys[w]):
        if len(chosen) >= budget:
            break
        if len(chosen) + len(words[w]) > budget:
            continue
        chosen.update(words[w])
    return chosen


@st.composite
def word_rows(draw, max_piece: int = 4):
    """A (N, L) word_ids batch: -1 specials at both ends, words of 1..max_piece pieces, -1 padding."""
    n_rows = draw(st.integers(1, 4))
    L = draw(st.integers(3, 40))
    rows = []
    for _ in range(n_rows):
        pieces = draw(st.lists(st.integers(1, max_piece), min_size=0, max_size=L))
        ids: list[int] = []
        for w, k in enumerate(pieces):
            if len(ids) + k > L - 2:
                break
            ids += [w] * k
        rows.append([-1] + ids + [-1] * (L - 1 - len(ids)))
    return torch.tensor(rows, dtype=torch.long)


def words_of(row: torch.Tensor) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for pos, w in enumerate(row.tolist()):
        if w >= 0:
            out.setdefault(w, set()).add(pos)
    return out


# ----------------------------------------------------------------------------------------------
# whole_word_mask
# ----------------------------------------------------------------------------------------------
@HYP
@given(word_rows(max_piece=4), st.floats(0.05, 0.95), st.integers(0, 2**31 - 1))
def test_whole_word_mask_matches_hf_walk_exactly(word_ids, ratio, seed):
    # Words of <= 4 pieces and passes=4: the vectorised rounds must equal HF's walk bit for bit.
    keys = torch.rand(word_ids.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mask = whole_word_mask(word_ids, ratio, keys, passes=4)
    for b in range(word_ids.size(0)):
        want = hf_walk(word_ids[b].tolist(), ratio, keys[b].tolist())
        assert set(mask[b].nonzero().squeeze(1).tolist()) == want


@HYP
@given(word_rows(max_piece=9), st.floats(0.05, 0.95), st.integers(0, 2**31 - 1), st.integers(1, 4))
def test_whole_word_mask_properties(word_ids, ratio, seed, passes):
    keys = torch.rand(word_ids.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mask = whole_word_mask(word_ids, ratio, keys, passes=passes)
    assert not mask[word_ids < 0].any(), "specials / padding masked"
    for b in range(word_ids.size(0)):
        words = words_of(word_ids[b])
        masked = set(mask[b].nonzero().squeeze(1).tolist())
        for positions in words.values():  # all pieces of a word or none
            assert positions <= masked or not (positions & masked)
        n = sum(len(v) for v in words.values())
        budget = max(1, round(n * ratio)) if n else 0
        longest = max((len(v) for v in words.values()), default=1)
        assert len(masked) <= budget
        # The first round alone takes a prefix that stops short of the budget by < one word.
        assert len(masked) >= min(budget - longest + 1, n) or len(masked) == budget


def test_whole_word_mask_needs_passes_to_skip_and_continue():
    # Words visited in order with lengths 3, 4, 2, 2, 1; n = 12, ratio 0.5 -> budget 6.
    # HF: take 3 (3), skip 4, take 2 (5), skip 2, take 1 (6). Each round adds one step of that walk.
    lengths, order = [3, 4, 2, 2, 1], [0.1, 0.2, 0.3, 0.4, 0.5]
    word_ids = torch.tensor([[-1] + [w for w, k in enumerate(lengths) for _ in range(k)] + [-1]])
    keys = torch.tensor([order + [0.9] * (word_ids.size(1) - len(order))], dtype=torch.float64)
    counts = [int(whole_word_mask(word_ids, 0.5, keys, passes=p).sum()) for p in (1, 2, 3, 4)]
    assert counts == [3, 5, 6, 6]
    assert set(whole_word_mask(word_ids, 0.5, keys, passes=3)[0].nonzero().squeeze(1).tolist()) == hf_walk(
        word_ids[0].tolist(), 0.5, keys[0].tolist()
    )


def test_mask_budget_rounding():
    n = torch.tensor([0, 1, 5, 10, 128])
    assert mask_budget(n, 0.3).tolist() == [0, 1, round(5 * 0.3), 3, round(128 * 0.3)]


def test_counter_hash_is_deterministic_and_spread():
    seed = torch.arange(4).view(4, 1)
    i = torch.arange(20000).view(1, -1)
    h = counter_hash(seed, torch.tensor(1), i)
    assert torch.equal(h, counter_hash(seed, torch.tensor(1), i))
    assert h.min() >= 0 and h.max() < 2**32
    u = h.double() / 2**32
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    # different seeds / streams give (essentially) unrelated draws
    assert (h[0] == h[1]).float().mean() < 0.01
    assert (h[0] == counter_hash(seed[:1], torch.tensor(2), i)[0]).float().mean() < 0.01
    # Same bits as plain Python integers (so no int64 overflow or signed-shift surprise on any device).
    def mix(x):
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
        return (x >> 16) ^ x

    def py_hash(seed, *cs):
        h = mix(seed)
        for c in cs:
            h = mix((h + c * 0x9E3779B9 + 0x7F4A7C15) & 0xFFFFFFFF)
        return h

    for s_, c1, c2 in [(7, 3, 0), (2**31 - 2, 2, 511), (0, 1, 127)]:
        assert counter_hash(torch.tensor(s_), torch.tensor(c1), torch.tensor(c2)).item() == py_hash(s_, c1, c2)


# ----------------------------------------------------------------------------------------------
# collators
# ----------------------------------------------------------------------------------------------
def random_rows(n_rows: int, max_len: int, seed: int, multi_piece: float = 0.3) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n_rows):
        n = int(rng.integers(1, max_len))
        ids = rng.integers(5, IDS.vocab_size, n)
        words = np.cumsum(rng.random(n) > multi_piece) + 17  # ids need not start at 0
        rows.append({"input_ids": ids.astype(np.int32).tolist(), "word_ids": words.astype(np.int32).tolist()})
    return rows


def retro_params(**kw) -> RetroMAEParams:
    enc = EncoderParams(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position=64)
    return RetroMAEParams(encoder=enc, **{"max_len": 24, "mask_pool_size": 16, **kw})


def test_retromae_collator_layout():
    rows = random_rows(6, 40, seed=0)
    batch = RetroMAECollator(IDS, retro_params(max_len=24), seed=3)(rows)
    B, L = batch["encoder_input_ids"].shape
    assert B == 6 and L <= 24
    for key in ("encoder_input_ids", "attention_mask", "encoder_labels", "decoder_input_ids", "word_ids"):
        assert batch[key].shape == (B, L) and batch[key].dtype == torch.long
    assert batch["decoder_seed"].shape == (B,)
    for b, row in enumerate(rows):
        n = min(len(row["input_ids"]), 22)
        dec = batch["decoder_input_ids"][b]
        assert dec[0] == IDS.cls and dec[n + 1] == IDS.sep and (dec[n + 2 :] == IDS.pad).all()
        assert dec[1 : n + 1].tolist() == row["input_ids"][:n]  # original, truncated
        assert batch["attention_mask"][b].tolist() == [1] * (n + 2) + [0] * (L - n - 2)
        w = batch["word_ids"][b]
        assert w[0] == -1 and (w[n + 1 :] == -1).all() and w[1] == 0  # renumbered from 0
        assert (torch.diff(w[1 : n + 1]) >= 0).all() and (torch.diff(w[1 : n + 1]) <= 1).all()
    labels, enc, dec = batch["encoder_labels"], batch["encoder_input_ids"], batch["decoder_input_ids"]
    masked = labels != IGNORE_INDEX
    assert torch.equal(labels[masked], dec[masked])  # labels are the original ids
    assert torch.equal(enc[~masked], dec[~masked])  # unmasked positions untouched
    assert not masked[batch["word_ids"] < 0].any()  # specials / pad never masked


def test_collator_masks_whole_words_at_ratio():
    rows = random_rows(64, 100, seed=1)
    batch = RetroMAECollator(IDS, retro_params(max_len=96, encoder_mask_ratio=0.3), seed=0)(rows)
    masked = batch["encoder_labels"] != IGNORE_INDEX
    for b in range(len(rows)):
        words = words_of(batch["word_ids"][b])
        got = set(masked[b].nonzero().squeeze(1).tolist())
        n = sum(len(v) for v in words.values())
        for positions in words.values():
            assert positions <= got or not (positions & got)
        assert max(1, round(n * 0.3)) - 3 <= len(got) <= max(1, round(n * 0.3))  # words have <= ~4 pieces


def test_80_10_10_statistics():
    rows = random_rows(400, 128, seed=2, multi_piece=0.0)
    batch = MLMCollator(IDS, 0.3, 128, seed=5)(rows)
    masked = batch["encoder_labels"] != IGNORE_INDEX
    inp, orig = batch["encoder_input_ids"][masked], batch["encoder_labels"][masked]
    n = masked.sum().item()
    assert n > 5000
    frac_mask = (inp == IDS.mask).float().mean().item()
    frac_keep = (inp == orig).float().mean().item()
    frac_rand = 1 - frac_mask - frac_keep
    assert abs(frac_mask - 0.8) < 0.02 and abs(frac_keep - 0.1) < 0.015 and abs(frac_rand - 0.1) < 0.015
    assert not torch.isin(inp[inp != IDS.mask], torch.tensor(IDS.special)).any()  # random ids are never specials


def test_collators_are_deterministic_and_resumable():
    rows_a, rows_b = random_rows(8, 30, seed=3), random_rows(8, 30, seed=4)
    c1 = RetroMAECollator(IDS, retro_params(), seed=11)
    first = c1(rows_a)
    state = c1.state_dict()
    second = c1(rows_b)

    c2 = RetroMAECollator(IDS, retro_params(), seed=11)
    for k, v in c2(rows_a).items():
        assert torch.equal(v, first[k]), k
    c3 = RetroMAECollator(IDS, retro_params(), seed=999)
    c3.load_state_dict(state)  # resume after the first batch
    for k, v in c3(rows_b).items():
        assert torch.equal(v, second[k]), k
    assert not torch.equal(c1(rows_a)["encoder_labels"], first["encoder_labels"])  # masks are dynamic


def test_mlm_collator_and_pad_to_max_len():
    rows = random_rows(3, 10, seed=5)
    batch = MLMCollator(IDS, 0.3, 20, seed=0, pad_to_max_len=True)(rows)
    assert set(batch) == {"encoder_input_ids", "attention_mask", "encoder_labels", "word_ids"}
    assert batch["encoder_input_ids"].shape == (3, 20)


def test_collator_rejects_misaligned_rows():
    with pytest.raises(ValueError, match="differ in length"):
        MLMCollator(IDS, 0.3, 20)([{"input_ids": [5, 6, 7], "word_ids": [0, 1]}])


def test_collators_use_the_trainers_step_generator():
    """Masks must depend only on the generator the Trainer hands in (seeded by step): that is what
    makes a resumed run draw the same masks as an uninterrupted one."""
    import torch

    from components.config_stages import RetroMAEParams
    from components.data.masking import MLMCollator, RetroMAECollator, SpecialTokens

    ids = SpecialTokens(pad=0, cls=2, sep=3, mask=4, vocab_size=100, special=(0, 1, 2, 3, 4))
    rows = [{"input_ids": list(range(10, 40)), "word_ids": list(range(30))} for _ in range(3)]
    for collate in (MLMCollator(ids, 0.3, 64, seed=1), RetroMAECollator(ids, RetroMAEParams(), seed=1)):
        a = collate(rows, generator=torch.Generator().manual_seed(7))
        collate(rows)  # advancing the collator's own stream must not matter
        b = collate(rows, generator=torch.Generator().manual_seed(7))
        assert all(torch.equal(a[k], b[k]) for k in a)
