"""The synthetic fact world: determinism, answerability, spans, splits.

    .venv/bin/python -m pytest tests/test_synthetic.py -q
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from components.config_stages import SplitParams, SyntheticParams
from components.data.synthetic import SPLITS, World, assign_splits, generate_world
from components.data.synthetic_text import ENTITY_LABEL, NameRegistry, _template_vocab

ROOT = Path(__file__).resolve().parents[1]
_NAME = re.compile(r"[A-Z][a-z]+")


@pytest.fixture(scope="module")
def world() -> World:
    return generate_world(SyntheticParams(), SplitParams())


def _index(w: World):
    docs = {p["doc_id"]: p for p in w.passages}
    ent_of_doc = {d: e for e in w.entities for d in e["doc_ids"]}
    by_name = {e["name"]: e for e in w.entities}
    return docs, ent_of_doc, by_name


def _question_target(q: dict, by_name: dict) -> tuple[dict, str]:
    """(entity, attribute) a question asks about: the one entity name in it, the fact equal to the answer."""
    ents = [by_name[t] for t in _NAME.findall(q["question"]) if t in by_name]
    assert len(ents) == 1, q
    attrs = [a for a, v in ents[0]["facts"].items() if v == q["answers"][0]]
    assert len(attrs) == 1, (q, ents[0])
    return ents[0], attrs[0]


def _stating_docs(e: dict, attr: str, docs: dict) -> set[str]:
    return {d for d in e["doc_ids"] if any(s["label"] == attr for s in docs[d]["spans"])}


def check_world(w: World, p: SyntheticParams, split: SplitParams) -> None:
    """Every structural promise of the generator, for any params."""
    docs, ent_of_doc, by_name = _index(w)
    k = min(p.attributes_per_entity, 8)
    # sizes and ids
    assert len(w.entities) == p.num_entities
    assert len(w.passages) == p.num_entities * p.docs_per_entity + p.distractor_docs
    assert len(docs) == len(w.passages), "doc_ids must be unique"
    assert len({x["text"] for x in w.passages}) == len(w.passages), "the corpus stage drops duplicate texts"
    assert len(w.queries) == len(w.qa) == p.num_entities * p.questions_per_entity
    assert len({q["qid"] for q in w.queries}) == len(w.queries)
    for x in w.passages:  # already normalised (corpus.normalize_text is a no-op, so spans survive)
        assert x["text"] == " ".join(x["text"].split()) and x["title"] == " ".join(x["title"].split())
        assert set(x) == {"doc_id", "title", "text", "spans"}
    # spans: in bounds, sorted, disjoint, and each slice is exactly what it labels
    names = set(by_name)
    for x in w.passages:
        prev_end = 0
        for s in x["spans"]:
            assert prev_end <= s["start"] < s["end"] <= len(x["text"]), (x, s)
            prev_end = s["end"]
            piece = x["text"][s["start"]:s["end"]]
            if s["label"] == ENTITY_LABEL:
                assert piece in names, (x["doc_id"], piece)
            else:
                assert piece == ent_of_doc[x["doc_id"]]["facts"][s["label"]], (x["doc_id"], s, piece)
    # every entity name mention in a text is marked (names occur only where they were written)
    for x in w.passages:
        marked = {(s["start"], s["end"]) for s in x["spans"]}
        for m in _NAME.finditer(x["text"]):
            if m.group() in names:
                assert any(a <= m.start() and m.end() <= b for a, b in marked), (x["text"], m.group())
    # every stated fact is stated in at least one of the entity's docs
    for e in w.entities:
        assert len(e["facts"]) == k and len(e["doc_ids"]) == p.docs_per_entity
        for attr in e["facts"]:
            assert _stating_docs(e, attr, docs), (e["name"], attr)
    # answerability: gold docs are exactly the entity's docs stating the fact; the answer is in each
    split_of = {q["qid"]: q["split"] for q in w.queries}
    for q in w.qa:
        e, attr = _question_target(q, by_name)
        gold = set(w.qrels[q["split"]][q["id"]])
        assert gold == _stating_docs(e, attr, docs), q
        assert q["positive_ctx"] in gold and split_of[q["id"]] == q["split"]
        for d in gold:
            for a in q["answers"]:
                assert a in docs[d]["text"], (q, docs[d]["text"])
        for d in set(e["doc_ids"]) - gold:  # no spurious answer in the entity's other docs
            assert not re.search(rf"\b{re.escape(q['answers'][0])}\b", docs[d]["text"]), (q, docs[d]["text"])
    # splits: disjoint, cover every query, agree with qrels; one fact never straddles two splits
    assert set(w.qrels) == set(SPLITS)
    seen = [qid for s in SPLITS for qid in w.qrels[s]]
    assert len(seen) == len(set(seen)) == len(w.queries)
    fact_split: dict[tuple, str] = {}
    for q in w.qa:
        e, attr = _question_target(q, by_name)
        assert fact_split.setdefault((e["name"], attr), q["split"]) == q["split"], q


PARAM_SETS = [
    SyntheticParams(),
    SyntheticParams(num_entities=1, docs_per_entity=3, attributes_per_entity=1, questions_per_entity=4,
                    distractor_docs=0, seed=0),
    SyntheticParams(num_entities=3, docs_per_entity=5, attributes_per_entity=8, questions_per_entity=10,
                    distractor_docs=2, seed=1),
    SyntheticParams(num_entities=37, docs_per_entity=1, attributes_per_entity=8, questions_per_entity=8,
                    distractor_docs=5, seed=99),
]


@pytest.mark.parametrize("p", PARAM_SETS, ids=["default", "one-entity", "three-entities", "one-doc-each"])
def test_world_invariants(p: SyntheticParams) -> None:
    check_world(generate_world(p, SplitParams()), p, SplitParams())


def test_same_params_same_world_different_seed_different_world() -> None:
    p = SyntheticParams(num_entities=40)
    a, b = generate_world(p, SplitParams()), generate_world(p, SplitParams())
    assert a.to_records() == b.to_records() and a.fingerprint() == b.fingerprint()
    c = generate_world(p.model_copy(update={"seed": p.seed + 1}), SplitParams())
    assert c.fingerprint() != a.fingerprint()
    assert {e["name"] for e in c.entities} != {e["name"] for e in a.entities}
    # the split seed moves questions between splits, never the corpus or the questions themselves
    d = generate_world(p, SplitParams(seed=14))
    assert d.passages == a.passages and [q["text"] for q in d.queries] == [q["text"] for q in a.queries]
    assert [q["split"] for q in d.queries] != [q["split"] for q in a.queries]


def test_byte_identical_across_processes_and_hash_seeds(world: World) -> None:
    """No dependence on set/dict hash order: other PYTHONHASHSEEDs give the same bytes."""
    code = ("from components.config_stages import SplitParams, SyntheticParams; "
            "from components.data.synthetic import generate_world; "
            "print(generate_world(SyntheticParams(), SplitParams()).fingerprint())")
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             check=True, timeout=60)
        assert out.stdout.strip() == world.fingerprint()


def test_split_fractions(world: World) -> None:
    n = len(world.queries)
    counts = Counter(q["split"] for q in world.queries)
    assert counts["test"] == round(0.2 * n) and counts["dev"] == round(0.1 * n)
    assert counts["train"] == n - counts["test"] - counts["dev"]
    w = generate_world(SyntheticParams(num_entities=50), SplitParams(dev=0.25, test=0.0))
    assert Counter(q["split"] for q in w.queries) == Counter({"train": 112, "dev": 38})
    assert w.qrels["test"] == {}


def test_assign_splits_keeps_groups_together() -> None:
    groups = [f"g{i // 3}" for i in range(300)]  # 100 groups of 3
    out = assign_splits(groups, SplitParams(dev=0.1, test=0.2, seed=5))
    assert out == assign_splits(groups, SplitParams(dev=0.1, test=0.2, seed=5))
    for g in set(groups):
        assert len({s for s, gg in zip(out, groups) if gg == g}) == 1
    c = Counter(out)
    assert abs(c["test"] - 60) < 3 and abs(c["dev"] - 30) < 3 and sum(c.values()) == 300


def test_fillers_name_other_entities(world: World) -> None:
    """Names occur in docs that are not about them, so a title/keyword match alone is not retrieval."""
    docs, ent_of_doc, by_name = _index(world)
    foreign = 0
    for x in world.passages:
        own = ent_of_doc.get(x["doc_id"])
        own_values = set(own["facts"].values()) if own else set()
        for s in x["spans"]:
            piece = x["text"][s["start"]:s["end"]]
            if s["label"] == ENTITY_LABEL and (own is None or piece != own["name"]) and piece not in own_values:
                foreign += 1
    assert foreign > len(world.passages) // 2
    # for many questions some non-gold doc contains the asked entity's name
    hard = 0
    for q in world.qa:
        e, _ = _question_target(q, by_name)
        gold = set(world.qrels[q["split"]][q["id"]])
        hard += any(e["name"] in x["text"] for x in world.passages if x["doc_id"] not in gold)
    assert hard > len(world.qa) // 2


def test_values_shared_and_phrasing_varied(world: World) -> None:
    """An answer alone does not identify the entity, and the same attribute is phrased in several ways."""
    docs, _, by_name = _index(world)
    answers = Counter(q["answers"][0] for q in world.qa)
    shared = sum(1 for q in world.qa if answers[q["answers"][0]] > 1)
    assert shared > len(world.qa) // 3
    for attr in ("profession", "flag_colour", "product"):
        values = [e["facts"][attr] for e in world.entities if attr in e["facts"]]
        assert len(set(values)) < len(values), attr  # pools are small: entities share values
    shapes: dict[str, set[str]] = {}
    for q in world.qa:
        e, attr = _question_target(q, by_name)
        shapes.setdefault(attr, set()).add(q["question"].replace(e["name"], "{E}"))
    assert sum(len(v) > 1 for v in shapes.values()) >= len(shapes) // 2
    stmt_shapes: dict[str, set[str]] = {}
    for e in world.entities:
        for d in e["doc_ids"]:
            for sent in re.split(r"(?<=\.) ", docs[d]["text"]):
                for attr, v in e["facts"].items():
                    if v in sent and e["name"] in sent:
                        stmt_shapes.setdefault(attr, set()).add(sent.replace(e["name"], "{E}").replace(v, "{V}"))
    assert all(len(v) >= 2 for v in stmt_shapes.values()), stmt_shapes


def test_names_are_made_up_and_prefix_free(world: World) -> None:
    import random

    reg = NameRegistry(random.Random(0))
    names = sorted(reg.new() for _ in range(3000))
    vocab = _template_vocab()
    assert len(set(names)) == len(names)
    assert all(n[0].isupper() and n[1:].islower() and n.lower() not in vocab for n in names)
    for a, b in zip(names, names[1:]):  # sorted: a prefix pair would be adjacent
        assert not b.startswith(a), (a, b)
    assert not any(re.search(r"\d", x["text"]) for x in world.passages if x["doc_id"] not in
                   {d for e in world.entities for d in e["doc_ids"]}), "distractor prose has no numbers"


def test_records_are_plain_json(world: World) -> None:
    rec = world.to_records()
    assert json.loads(json.dumps(rec)) == rec
    rec["passages"][0]["text"] = "changed"
    assert world.passages[0]["text"] != "changed", "to_records must be a copy"
    assert set(world.qa[0]) == {"id", "question", "answers", "positive_ctx", "split"}
    assert set(world.queries[0]) == {"qid", "text", "split"}


def test_default_world_is_fast() -> None:
    t0 = time.perf_counter()
    generate_world(SyntheticParams(), SplitParams())
    assert time.perf_counter() - t0 < 1.0
