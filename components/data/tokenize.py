"""`tokenize`: get a WordPiece tokenizer, tokenise the corpus, pack pre-training and retrieval blocks.

Output folder (swapped in atomically; schemas in docs/contracts.md):
    tokenizer/     HF tokenizer folder (trained on the corpus, or the warm start's, `warm_start.path`)
    pretrain/      packed blocks for RetroMAE / MLM: block_id, input_ids, word_ids
    blocks/        retrieval blocks for REALM and eval: block_id, doc_id, title, text, input_ids,
                   word_ids, offsets, char_spans, title_ids (the title's tokens: REALM's document
                   tower reads `[CLS] title [SEP] body [SEP]` with realm.doc_input=title_body)
    tokenize_card.json

Token ids carry no special tokens; models add [CLS]/[SEP]. `word_ids` number whole words inside
each block (WordPiece continuations share their word's id): whole-word masking needs them.
Packing happens here rather than in `prepare_corpus` because a block size is counted in tokens,
which needs the tokenizer.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from components.config_stages import TokenizeParams
from components.data.errors import DataError
from components.io import atomic_dir, write_json_atomic

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------
def train_wordpiece(texts, vocab_size: int, lowercase: bool = True, min_frequency: int = 2):
    """Train a BERT-style WordPiece tokenizer with `tokenizers` and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts) if hasattr(texts, "__len__") else None)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.decoder = decoders.WordPiece()
    return BertTokenizerFast(tokenizer_object=tok, do_lower_case=lowercase, unk_token="[UNK]", pad_token="[PAD]",
                             cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def load_tokenizer(path: str | Path):
    """A local HF tokenizer folder (or a hub name when online). Must be a fast tokenizer with offsets."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise DataError(path, f"cannot load a tokenizer here ({e})",
                        fix="use a folder with tokenizer.json / vocab.txt (warm_start.path: a local copy of the model with its "
                        "tokenizer; a hub name needs network)") from None
    if not getattr(tok, "is_fast", False):
        raise DataError(path, "tokenizer is not a fast (Rust) tokenizer; offsets/word ids need one", fix="save it with tokenizers")
    for name in ("cls_token_id", "sep_token_id", "mask_token_id", "pad_token_id"):
        if getattr(tok, name) is None:
            raise DataError(path, f"tokenizer has no {name.removesuffix('_id')}", fix="use a BERT-style WordPiece tokenizer")
    return tok


def tokenizer_source(warm_start: str | None = None) -> str:
    """"train" (a WordPiece trained on the corpus) or the folder / hub name to load one from: the warm
    start's own tokenizer, since the warm-started encoder reads only its own ids."""
    return "train" if warm_start is None else str(warm_start)


# ----------------------------------------------------------------------------------------------
# tokenise (parallel, via datasets.map) and pack
# ----------------------------------------------------------------------------------------------
def _tokenize_batch(batch, tokenizer):
    enc = tokenizer(batch["text"], add_special_tokens=False, return_offsets_mapping=True,
                    return_attention_mask=False, return_token_type_ids=False)
    word_ids = [[w if w is not None else -1 for w in enc.word_ids(i)] for i in range(len(batch["text"]))]
    return {"input_ids": enc["input_ids"], "word_ids": word_ids, "offsets": [[list(o) for o in offs] for offs in enc["offset_mapping"]]}


def tokenize_passages(passages, tokenizer, num_proc: int = 1, batch_size: int = 1000):
    """passages: a `datasets.Dataset` with doc_id/title/text/spans. Adds input_ids, word_ids, offsets."""
    return passages.map(_tokenize_batch, batched=True, batch_size=batch_size, num_proc=num_proc if num_proc > 1 else None,
                        fn_kwargs={"tokenizer": tokenizer}, desc="tokenize")


def word_chunks(word_ids: np.ndarray, max_len: int) -> list[tuple[int, int]]:
    """Split [0, n) into chunks of <= max_len tokens, cutting between words where possible.

    A single word longer than max_len is cut inside the word (nothing is ever dropped).
    """
    n = len(word_ids)
    out, start = [], 0
    while start < n:
        end = min(start + max_len, n)
        if end < n and word_ids[end] == word_ids[end - 1]:
            # back off to the start of the word that straddles the cut, unless the chunk is one word
            word_start = end - 1
            while word_start > start and word_ids[word_start - 1] == word_ids[end]:
                word_start -= 1
            if word_start > start:
                end = word_start
        out.append((start, end))
        start = end
    return out


def _renumber(word_ids: np.ndarray, offset: int) -> tuple[np.ndarray, int]:
    """Make word ids 0-based and contiguous inside a chunk, starting at `offset`."""
    if len(word_ids) == 0:
        return word_ids, offset
    change = np.concatenate([[0], (np.diff(word_ids) != 0).astype(np.int64)])
    new = offset + np.cumsum(change)
    return new.astype(np.int32), int(new[-1]) + 1


def pack_pretrain_blocks(tokenized, max_len: int) -> dict[str, list]:
    """Greedy packing of consecutive passages into blocks of <= max_len tokens (RetroMAE-style).

    A passage that does not fit in the open block starts a new one; a passage longer than max_len
    is split at word boundaries. Every token of the corpus lands in exactly one block.
    """
    blocks: dict[str, list] = {"block_id": [], "input_ids": [], "word_ids": []}
    cur_ids: list[np.ndarray] = []
    cur_words: list[np.ndarray] = []
    cur_len = next_word = 0

    def close() -> None:
        nonlocal cur_ids, cur_words, cur_len, next_word
        if cur_len:
            blocks["block_id"].append(f"p{len(blocks['block_id']):07d}")
            blocks["input_ids"].append(np.concatenate(cur_ids).astype(np.int32))
            blocks["word_ids"].append(np.concatenate(cur_words).astype(np.int32))
        cur_ids, cur_words, cur_len, next_word = [], [], 0, 0

    for row in tokenized.select_columns(["input_ids", "word_ids"]).with_format("numpy"):
        ids, words = np.asarray(row["input_ids"]), np.asarray(row["word_ids"])
        for s, e in word_chunks(words, max_len):
            if cur_len + (e - s) > max_len:
                close()
            w, next_word = _renumber(words[s:e], next_word)
            cur_ids.append(ids[s:e])
            cur_words.append(w)
            cur_len += e - s
    close()
    return blocks


def split_retrieval_blocks(tokenized, max_len: int) -> dict[str, list]:
    """Each passage becomes one or more blocks of <= max_len tokens (REALM's knowledge corpus)."""
    cols = ["block_id", "doc_id", "title", "text", "input_ids", "word_ids", "offsets", "char_spans"]
    blocks: dict[str, list] = {c: [] for c in cols}
    for row in tokenized:
        ids, words, offs = np.asarray(row["input_ids"], dtype=np.int32), np.asarray(row["word_ids"]), np.asarray(row["offsets"], dtype=np.int32).reshape(-1, 2)
        chunks = word_chunks(words, max_len) or [(0, 0)]
        for i, (s, e) in enumerate(chunks):
            c0 = int(offs[s, 0]) if e > s else 0
            c1 = int(offs[e - 1, 1]) if e > s else len(row["text"])
            # the first chunk keeps any leading text; the last keeps any trailing text (nothing lost)
            c0 = 0 if i == 0 else c0
            c1 = len(row["text"]) if i == len(chunks) - 1 else c1
            spans = [[sp["start"] - c0, sp["end"] - c0] for sp in (row["spans"] or []) if sp["start"] >= c0 and sp["end"] <= c1]
            blocks["block_id"].append(row["doc_id"] if len(chunks) == 1 else f"{row['doc_id']}#{i}")
            blocks["doc_id"].append(row["doc_id"])
            blocks["title"].append(row["title"])
            blocks["text"].append(row["text"][c0:c1])
            blocks["input_ids"].append(ids[s:e])
            blocks["word_ids"].append(_renumber(words[s:e], 0)[0])
            blocks["offsets"].append((offs[s:e] - c0).astype(np.int32))
            blocks["char_spans"].append(spans)
    return blocks


def title_token_ids(titles: list, tokenizer, batch_size: int = 1000) -> list[list[int]]:
    """Token ids (no specials) of each block's title; a missing title is empty."""
    out: list[list[int]] = []
    for i in range(0, len(titles), batch_size):
        chunk = [t or "" for t in titles[i:i + batch_size]]
        out.extend(tokenizer(chunk, add_special_tokens=False, return_attention_mask=False,
                             return_token_type_ids=False)["input_ids"])
    return out


def tokenize_corpus(p: TokenizeParams, corpus_dir: str | Path, out_dir: str | Path,
                    warm_start: str | None = None) -> dict:
    """Run the stage body; returns the tokenize card (also written to out_dir).

    `warm_start`: the resolved `warm_start.path` folder (or hub name); its tokenizer is used, since the
    warm-started encoder reads only its own ids. Without one a WordPiece is trained on the corpus.
    """
    import datasets

    corpus_dir = Path(corpus_dir)
    table = pq.read_table(corpus_dir / "passages.parquet")
    passages = datasets.Dataset(table)
    if len(passages) == 0:
        raise DataError(corpus_dir / "passages.parquet", "corpus is empty", fix="rerun prepare_corpus on a non-empty source")
    t0 = time.perf_counter()
    source = tokenizer_source(warm_start)
    if source == "train":
        tokenizer = train_wordpiece(passages["text"], p.vocab_size, p.lowercase, p.min_frequency)
    else:
        tokenizer = load_tokenizer(source)
    t_train = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokenized = tokenize_passages(passages, tokenizer, p.num_proc, p.batch_size)
    t_tok = time.perf_counter() - t0
    n_tokens = int(sum(len(x) for x in tokenized["input_ids"]))
    t0 = time.perf_counter()
    pretrain = pack_pretrain_blocks(tokenized, p.pretrain_block_len)
    blocks = split_retrieval_blocks(tokenized, p.retrieval_block_len)
    blocks["title_ids"] = [np.asarray(t, dtype=np.int32) for t in title_token_ids(blocks["title"], tokenizer, p.batch_size)]
    t_pack = time.perf_counter() - t0

    with atomic_dir(out_dir) as tmp:
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        datasets.Dataset.from_dict(pretrain).save_to_disk(str(tmp / "pretrain"))
        datasets.Dataset.from_dict(blocks).save_to_disk(str(tmp / "blocks"))
        card = {
            "tokenizer": "train" if warm_start is None else "warm_start",
            "tokenizer_source": source,
            "vocab_size": len(tokenizer),
            "passages": len(passages),
            "tokens": n_tokens,
            "pretrain_blocks": len(pretrain["block_id"]),
            "pretrain_block_len": p.pretrain_block_len,
            "pretrain_tokens": int(sum(len(x) for x in pretrain["input_ids"])),
            "retrieval_blocks": len(blocks["block_id"]),
            "retrieval_block_len": p.retrieval_block_len,
            "retrieval_tokens": int(sum(len(x) for x in blocks["input_ids"])),
            "seconds": {"tokenizer": round(t_train, 3), "tokenize": round(t_tok, 3), "pack": round(t_pack, 3)},
            "throughput": {"docs_per_s": round(len(passages) / max(t_tok, 1e-9), 1), "tokens_per_s": round(n_tokens / max(t_tok, 1e-9), 1)},
            "num_proc": p.num_proc,
        }
        write_json_atomic(tmp / "tokenize_card.json", card)
    return card
