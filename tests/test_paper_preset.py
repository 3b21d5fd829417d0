"""The paper preset's recipe (issue 18, items 3-8): block lengths that cannot disagree, REALM's
warm-up rule, ICT training the projection, x as one sentence, REALM's title/body document input,
salient spans as REALM tags them (spaCy types, the regex fallback's WARNING), a refresh that logs."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from components.config import load_params
from components.config_file import ParamsError
from components.config_stages import RealmParams
from components.data import realm_batch as rb
from components.data import realm_query as rq
from components.data import salient_spans as ss
from components.data.special_tokens import SpecialTokens
from components.data.token_spans import sentence_token_spans
from components.models.ict import ICTModel
from components.models.realm import tiny_bert_config
from components.models.retriever import Retriever
from components.training.optim import lr_at
from tests.conftest import ROOT

SP = SpecialTokens(pad=0, cls=2, sep=3, mask=4)
PRESETS = {"default": [], "tiny": [ROOT / "params/tiny.yaml"], "small": [ROOT / "params/small.yaml"],
           "paper": [ROOT / "params/paper.yaml"]}
REALM_SPAN_TYPES = tuple(RealmParams().span_types)  # params.yaml's realm.span_types: the one copy of REALM's labels


# ----------------------------------------------------------------------------------------------
# presets and block lengths
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_loads_and_its_block_lengths_agree(name):
    p = load_params(ROOT / "params.yaml", presets=PRESETS[name])
    # a full retrieval block plus [CLS]/[SEP] fits what the reader and the document tower read
    assert p.realm.block_len >= p.tokenize.retrieval_block_len + 2
    if name != "tiny":
        assert p.realm.block_len == p.tokenize.retrieval_block_len + 2  # no padding wasted either


def test_disagreeing_block_lengths_name_both_params():
    with pytest.raises(ParamsError) as e:
        load_params(ROOT / "params.yaml", presets=PRESETS["paper"], overrides={"tokenize.retrieval_block_len": 288})
    msg = str(e.value)
    assert "realm.block_len=288" in msg and "tokenize.retrieval_block_len=288" in msg and "lose 2 token" in msg


def test_paper_preset_runs_realms_recipe():
    p = load_params(ROOT / "params.yaml", presets=PRESETS["paper"])
    r = p.realm
    assert (r.ict_steps, r.ict_batch_size, r.ict_lr, r.ict_mask_rate, r.ict_query_len) == (100000, 4096, 1e-4, 0.9, 64)
    assert r.retriever_init == "retromae" and r.train.warmup_rule == "realm" and r.train.warmup_steps() == 10000
    assert (r.query_unit, r.doc_input, r.span_tagger, r.ner_missing) == ("sentence", "title_body", "spacy", "error")
    assert tuple(r.span_types) == REALM_SPAN_TYPES and "CARDINAL" not in r.span_types and "MONEY" not in r.span_types
    assert (r.query_len, r.block_len, r.top_k, r.max_masks) == (96, 288, 8, 10)
    assert p.retromae.mask_pool_size == 256


@pytest.mark.parametrize("name", ["default", "tiny", "small"])
def test_tiny_and_small_keep_todays_choices(name):
    r = load_params(ROOT / "params.yaml", presets=PRESETS[name]).realm
    assert (r.query_unit, r.doc_input, r.train.warmup_rule, r.ict_query_len) == ("window", "body", "ratio", None)
    # small masks REALM's NER spans; tiny's synthetic world keeps the regex tagger it always used
    assert (r.span_tagger, tuple(r.span_types)) == ({"default": "spacy", "tiny": "regex", "small": "spacy"}[name], REALM_SPAN_TYPES)
    assert r.train.warmup_steps() == int(r.train.warmup_ratio * r.train.max_steps)


# ----------------------------------------------------------------------------------------------
# REALM's warm-up rule
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps, want", [(200000, 10000), (100000, 10000), (5000, 500), (500, 100), (50, 100)])
def test_realm_warmup_rule_is_the_references(steps, want):
    train = RealmParams().train.model_copy(update={"max_steps": steps, "warmup_rule": "realm", "lr": 1e-3})
    assert train.warmup_steps() == want == min(10000, max(100, int(steps / 10)))
    assert lr_at(want - 1, train) == pytest.approx(1e-3)  # warm-up ends at the peak
    ratio = train.model_copy(update={"warmup_rule": "ratio", "warmup_ratio": 0.05})
    assert ratio.warmup_steps() == int(0.05 * steps)


# ----------------------------------------------------------------------------------------------
# ICT trains the retriever's projection
# ----------------------------------------------------------------------------------------------
def test_ict_trains_the_projection_and_both_towers():
    torch.manual_seed(0)
    retriever = Retriever.from_config(tiny_bert_config(), retriever_dim=8, share_towers=False)
    model = ICTModel(retriever)
    before = {n: t.detach().clone() for n, t in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    batch = {"q_input_ids": torch.randint(5, 100, (4, 6), generator=g), "q_attention_mask": torch.ones(4, 6, dtype=torch.long),
             "d_input_ids": torch.randint(5, 100, (4, 10), generator=g), "d_attention_mask": torch.ones(4, 10, dtype=torch.long)}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(batch)["loss"].backward()
    opt.step()
    moved = {n for n, t in model.named_parameters() if not torch.equal(t, before[n])}
    for name in ("retriever.query_projection.weight", "retriever._passage_projection.weight",
                 "retriever.query_projection.bias", "retriever._passage_projection.bias"):
        assert name in moved, name
    # the ICT warm-up hands REALM this very module: its trained projection, not a fresh one
    assert model.retriever is retriever


# ----------------------------------------------------------------------------------------------
# x as one sentence
# ----------------------------------------------------------------------------------------------
TEXT = "Alpha went home. Then Zorvan Teluk crossed the river in 1875 with many men. Beta stayed behind."


def _block(text: str) -> dict:
    """A block row with one token per word (ids from 10), char offsets and word ids."""
    import re

    words = list(re.finditer(r"\w+|[^\w\s]", text))
    return {"input_ids": [10 + i for i in range(len(words))], "word_ids": list(range(len(words))),
            "offsets": [[m.start(), m.end()] for m in words], "text": text, "char_spans": [], "block_id": "b0"}


@pytest.mark.parametrize("unit", ["window", "sentence"])
def test_x_is_the_spans_sentence_or_a_window(unit):
    p = RealmParams(query_len=40, max_masks=4, span_tagger="regex", exclude_spans_in_query=False, query_unit=unit)
    row = _block(TEXT)
    sents = sentence_token_spans(row["text"], row["offsets"])
    assert len(sents) == 3
    for seed in range(20):
        q = rq.make_query(row, p, np.random.default_rng(seed), mask_token_id=SP.mask, row=0)
        window = [lab if lab != -100 else t for t, lab in zip(q.input_ids, q.labels)]  # the span restored
        lo = row["input_ids"].index(window[0])  # ids are unique in this block
        assert window == row["input_ids"][lo:lo + len(window)]  # a contiguous piece of the block
        inside = [s for s in sents if s[0] <= lo and lo + len(window) <= s[1]]
        if unit == "sentence":
            assert inside, (seed, lo, len(window))  # never crosses a sentence boundary ...
            assert len(window) == inside[0][1] - inside[0][0]  # ... and is the whole sentence (it fits)
        else:
            assert len(window) == len(row["input_ids"])  # the block fits query_len: x is all of it


def test_a_sentence_longer_than_query_len_is_cut_around_the_span():
    p = RealmParams(query_len=8, max_masks=4, span_tagger="regex", exclude_spans_in_query=False, query_unit="sentence")
    row = _block(TEXT)
    for seed in range(10):
        q = rq.make_query(row, p, np.random.default_rng(seed), mask_token_id=SP.mask, row=0)
        assert len(q.input_ids) == 6 and q.masked is not None
        assert all(t == SP.mask for t in q.input_ids[q.masked[0]:q.masked[1]])


# ----------------------------------------------------------------------------------------------
# the document tower's input
# ----------------------------------------------------------------------------------------------
def test_title_body_input_is_realms_featurize_document():
    p = RealmParams(block_len=10, doc_input="title_body")
    out = rb.passage_inputs([[20, 21, 22, 23, 24, 25, 26], [30]], p, SP, titles=[[7, 8], []])
    assert out["input_ids"].tolist() == [[2, 7, 8, 3, 20, 21, 22, 23, 24, 3], [2, 3, 30, 3, 0, 0, 0, 0, 0, 0]]
    assert out["token_type_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0, 0, 0, 0]]
    assert out["attention_mask"].tolist() == [[1] * 10, [1] * 4 + [0] * 6]
    body = rb.passage_inputs([[20, 21], [30]], RealmParams(block_len=10, doc_input="body"), SP)
    assert set(body) == {"input_ids", "attention_mask"} and body["input_ids"].tolist() == [[2, 20, 21, 3], [2, 30, 3, 0]]
    with pytest.raises(ValueError, match="title"):
        rb.passage_inputs([[20]], p, SP)


def test_dense_eval_embeds_the_same_title_body_input():
    from components.eval.dense import add_specials_title_body

    p = RealmParams(block_len=10, doc_input="title_body")
    ref = rb.passage_inputs([[20, 21, 22, 23, 24, 25, 26], [30]], p, SP, titles=[[7, 8], []])
    ids, mask, types = add_specials_title_body([([7, 8], [20, 21, 22, 23, 24, 25, 26]), ([], [30])], SP.cls, SP.sep, SP.pad, 10)
    assert ids.tolist() == ref["input_ids"].tolist() and types.tolist() == ref["token_type_ids"].tolist()
    assert mask.tolist() == ref["attention_mask"].tolist()


def test_collate_carries_the_document_towers_input_for_rescoring():
    p = RealmParams(block_len=12, top_k=3, doc_input="title_body")
    lookup = [{"input_ids": [20 + i, 40 + i], "title_ids": [60 + i]} for i in range(5)]
    q = rb.RealmQuery([11, SP.mask, 13], [-100, 12, -100], source_row=0)
    cand = np.array([[-1, 2, -2]])
    b = rb.collate([q], cand, lookup, p, SP)
    assert b["p_input_ids"].shape[:2] == (1, 3)
    flat = rb.passage_inputs([[], [22, 42], []], p, SP, titles=[[], [62], []])
    for k in ("input_ids", "attention_mask", "token_type_ids"):
        assert b[f"p_{k}"][0].tolist() == flat[k].tolist(), k
    # the body alone reaches the reader, as before
    assert b["z_input_ids"][0, 1].tolist()[:3] == [22, 42, SP.sep]
    assert "p_input_ids" not in rb.collate([q], cand, lookup, p.model_copy(update={"doc_input": "body"}), SP)


def test_the_refresh_collate_reads_titles_and_feeds_encode_passage():
    p = RealmParams(block_len=12, doc_input="title_body")
    rows = [{"input_ids": [20, 21], "title_ids": [60]}, {"input_ids": [30], "title_ids": []}]
    assert rb.passage_columns(p) == ["input_ids", "title_ids"] and rb.passage_columns(RealmParams()) == ["input_ids"]
    batch = rb.passage_batch(rows, p, SP)
    assert batch["input_ids"].tolist() == rb.passage_inputs([[20, 21], [30]], p, SP, titles=[[60], []])["input_ids"].tolist()
    torch.manual_seed(0)
    r = Retriever.from_config(tiny_bert_config(), retriever_dim=8).eval()
    with torch.no_grad():
        assert r.encode_passage(**batch).shape == (2, 8)  # what the refresh calls on a collated batch


def test_encode_passage_with_no_token_types_is_all_zeros():
    torch.manual_seed(0)
    r = Retriever.from_config(tiny_bert_config(), retriever_dim=8).eval()
    ids = torch.randint(5, 100, (3, 7))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        assert torch.equal(r.encode_passage(ids, mask), r.encode_passage(ids, mask, torch.zeros_like(ids)))
        assert not torch.allclose(r.encode_passage(ids, mask), r.encode_passage(ids, mask, torch.ones_like(ids)))


def test_tokenize_gives_each_block_its_titles_tokens(tmp_path):
    from components.data.tokenize import title_token_ids, train_wordpiece

    tok = train_wordpiece(["Zorvan Teluk crossed the river", "the river"] * 5, vocab_size=200, min_frequency=1)
    got = title_token_ids(["Zorvan Teluk", None, ""], tok)
    assert got[0] == tok("Zorvan Teluk", add_special_tokens=False)["input_ids"] and got[1] == [] and got[2] == []


# ----------------------------------------------------------------------------------------------
# salient spans as REALM tags them
# ----------------------------------------------------------------------------------------------
def test_realm_span_types_are_named_entities_and_dates():
    assert "DATE" in REALM_SPAN_TYPES and {"PERSON", "ORG", "GPE", "LOC", "NORP"} <= set(REALM_SPAN_TYPES)
    assert not {"CARDINAL", "ORDINAL", "QUANTITY", "MONEY", "PERCENT", "TIME"} & set(REALM_SPAN_TYPES)


@pytest.fixture
def ruler_nlp(monkeypatch):
    """spaCy's real NER code path with an entity ruler instead of a trained model, so the spans are
    known exactly: PERSON, DATE, GPE, CARDINAL and MONEY spans (tests/test_ner_spans.py runs the model)."""
    import spacy

    nlp = spacy.blank("en")
    ruler = nlp.add_pipe("entity_ruler")
    ruler.add_patterns([
        {"label": "PERSON", "pattern": "Zorvan Teluk"}, {"label": "DATE", "pattern": "12 March 1875"},
        {"label": "GPE", "pattern": "Ardel"}, {"label": "CARDINAL", "pattern": "1,200"},
        {"label": "MONEY", "pattern": [{"LOWER": "5"}, {"LOWER": "dollars"}]},
    ])
    ss._spacy_error.cache_clear()
    ss._ENTITIES.clear()
    monkeypatch.setattr(ss, "_load_spacy", lambda model=ss.SPACY_MODEL: nlp)
    yield nlp
    ss._spacy_error.cache_clear()
    ss._ENTITIES.clear()


SPACY_TEXT = "On 12 March 1875 Zorvan Teluk led 1,200 men to Ardel for 5 dollars."


def test_spacy_path_masks_only_realms_types(ruler_nlp):
    def labels(tagger):
        return [(SPACY_TEXT[s:e], lab) for s, e, lab in ss.find_salient_spans(SPACY_TEXT, tagger)]

    everything = labels("spacy")
    assert ("1,200", "CARDINAL") in everything and ("5 dollars", "MONEY") in everything
    realm = ss.span_tagger_for(RealmParams(span_tagger="spacy"))
    assert realm.kind == "spacy" and not realm.fallback
    assert labels(realm) == [("12 March 1875", "DATE"), ("Zorvan Teluk", "PERSON"), ("Ardel", "GPE")]


def test_spacy_types_reach_the_masked_spans(ruler_nlp):
    row = _block(SPACY_TEXT)
    p = RealmParams(query_len=40, max_masks=4, span_tagger="spacy", exclude_spans_in_query=False)
    masked = set()
    for seed in range(40):
        q = rq.make_query(row, p, np.random.default_rng(seed), mask_token_id=SP.mask, row=0)
        masked.add(SPACY_TEXT[row["offsets"][q.masked[0]][0]:row["offsets"][q.masked[1] - 1][1]])
    assert masked == {"12 March 1875", "Zorvan Teluk", "Ardel"}


# ----------------------------------------------------------------------------------------------
# a long refresh logs
# ----------------------------------------------------------------------------------------------
def test_embed_blocks_logs_progress_lines(caplog):
    from components.index import embed

    rows = [{"input_ids": [1, 2, 3]} for _ in range(10)]
    with caplog.at_level(logging.INFO, logger=embed.__name__):
        emb, _ = embed.embed_blocks(lambda b: np.zeros((len(b), 4)), rows, 2, progress=False, desc="embed", log_every=4)
    lines = [r.getMessage() for r in caplog.records if r.name == embed.__name__]
    assert emb.shape == (10, 4) and lines == ["embed 4/10 (40%) " + lines[0].split("(40%) ")[1], *lines[1:]]
    assert [ln.split()[1] for ln in lines] == ["4/10", "8/10"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=embed.__name__):
        embed.embed_blocks(lambda b: np.zeros((len(b), 4)), rows, 5, progress=False, desc="embed", log_every_s=0.0)
    assert [r.getMessage().split()[1] for r in caplog.records if r.name == embed.__name__] == ["5/10", "10/10"]
