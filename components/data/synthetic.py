"""The synthetic "fact world": a deterministic corpus + questions, the tiny preset's data source and the tests'
fixture.

Fictional entities (people, towns, companies, rivers) with made-up pronounceable names have
`attributes_per_entity` facts each. Every entity gets `docs_per_entity` passages that state a subset of
its facts in varied phrasing, in shuffled order, padded with filler sentences that name OTHER entities
(so a passage that mentions a name is not necessarily about it). `distractor_docs` passages are generic
prose about no entity. Questions ask for one fact of one entity; their gold documents are exactly the
entity's passages that state that fact, and the answer string occurs verbatim in each of them.

Values are drawn from small shared pools (professions, colours, other entities' names...), so an answer
cannot be found without the entity name: retrieval matters.

Every entity name and attribute value in a passage is marked as a char span (`salient_span_mask` for
REALM). Same params -> byte-identical world (one `random.Random(seed)`, no hash-ordered iteration).
The templates, value pools and names are `synthetic_text.py`; this module draws the world from them.

    .venv/bin/python -m components.data.synthetic            # print an example passage + questions
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

from components.config_stages import SplitParams, SyntheticParams
from components.data.synthetic_text import (ATTRIBUTES, DISTRACTOR_NAMING, DISTRACTOR_SENTENCES, DISTRACTOR_TITLES,
                                            ENTITY_LABEL, FILLERS_NAMING, FILLERS_PLAIN, FISH, FLAG_COLOURS,
                                            INDUSTRIES, INSTRUMENTS, INTROS, KINDS, LOGO_ANIMALS, NUM_LAKES, PETS,
                                            PRODUCTS, PROFESSIONS, REGIONS, TITLES, WATER_COLOURS, NameRegistry,
                                            join_sentences, render)

SPLITS = ("train", "dev", "test")

# Probabilities that shape the documents (not knobs: changing them changes every synthetic world).
_P_EXTRA_DOC_FOR_FACT = 0.3  # a fact already stated in one doc is repeated in another doc of the entity
_P_FILLER_NAMES_OTHER = 0.6  # a filler sentence names another entity
_P_INTRO_FIRST = 0.75
_FILLERS_PER_DOC = (1, 3)
_DISTRACTOR_SENTENCES = (3, 6)
_P_DISTRACTOR_NAMES_ENTITY = 0.5

# ----------------------------------------------------------------------------------------------
# the world
# ----------------------------------------------------------------------------------------------
@dataclass
class World:
    """A generated fact world. All fields are plain JSON-able lists/dicts.

    passages: `{doc_id, title, text, spans: [{start, end, label}]}`
    queries:  `{qid, text, split}`;   qrels: `{split: {qid: {doc_id: 1}}}` (all three splits present)
    qa:       `{id, question, answers: [str], positive_ctx: doc_id, split}`
    entities: `{entity_id, name, kind, facts: {attribute: value}, doc_ids: [...]}` (ground truth, for tests
              and debugging; not part of the corpus)
    """

    passages: list[dict]
    queries: list[dict]
    qrels: dict[str, dict[str, dict[str, int]]]
    qa: list[dict]
    entities: list[dict] = field(default_factory=list)

    def to_records(self) -> dict[str, Any]:
        """Deep copy as plain dicts (what the corpus writer serialises)."""
        return copy.deepcopy({"passages": self.passages, "queries": self.queries, "qrels": self.qrels,
                              "qa": self.qa, "entities": self.entities})

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of the world: equal fingerprints <=> byte-identical worlds."""
        blob = json.dumps(self.to_records(), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def summary(self) -> dict[str, int]:
        out = {"passages": len(self.passages), "entities": len(self.entities), "queries": len(self.queries)}
        out.update({f"queries_{s}": len(self.qrels[s]) for s in SPLITS})
        return out


@dataclass
class _Entity:
    idx: int
    kind: str
    name: str
    values: dict[str, str] = field(default_factory=dict)  # all 8 attributes (only `stated` ones are used)
    stated: list[str] = field(default_factory=list)
    doc_facts: list[list[str]] = field(default_factory=list)  # per doc: attributes it states
    doc_keys: list[int] = field(default_factory=list)  # indices into the generated doc list


def _make_entities(p: SyntheticParams, rng: random.Random, names: NameRegistry) -> list[_Entity]:
    kinds = [KINDS[i % len(KINDS)] for i in range(p.num_entities)]
    rng.shuffle(kinds)
    return [_Entity(i, k, names.new()) for i, k in enumerate(kinds)]


def _assign_values(ents: list[_Entity], rng: random.Random, names: NameRegistry) -> None:
    """Draw every attribute of every entity. References point at other entities of the right kind (or at
    spare made-up names when the world has none); values of one entity are pairwise distinct."""
    by_kind: dict[str, list[str]] = {k: [e.name for e in ents if e.kind == k] for k in KINDS}
    spare: dict[str, list[str]] = {}
    lakes = ["Lake " + names.new() for _ in range(NUM_LAKES)]

    def ref(kind: str, avoid: set[str]) -> str:
        pool = by_kind[kind]
        for _ in range(100 if pool else 0):  # rejection first: `avoid` is tiny, a scan of `pool` is O(n)
            v = rng.choice(pool)
            if v not in avoid:
                return v
        free = [v for v in pool if v not in avoid]
        if free:
            return rng.choice(free)
        # no (other) entity of that kind in this world: use a few made-up names that are no entity
        extra = spare.setdefault(kind, [])
        free = [v for v in extra if v not in avoid]
        if len(free) < 3:
            extra.append(names.new())
            free.append(extra[-1])
        return rng.choice(free)

    birth: dict[str, int] = {}
    for e in ents:  # pass 1: scalar values (years first, so references below can stay consistent)
        v = e.values
        if e.kind == "person":
            b = rng.randint(1700, 1950)
            birth[e.name] = b
            v["birth_year"], v["death_year"] = str(b), str(b + rng.randint(25, 90))
            v["profession"], v["instrument"], v["pet"] = (rng.choice(PROFESSIONS), rng.choice(INSTRUMENTS),
                                                          rng.choice(PETS))
        elif e.kind == "town":
            v["founded_year"] = str(rng.randint(1100, 1900))
            v["population"] = f"{rng.randint(12, 980) * 100:,}"  # 1,200 .. 98,000: always has a comma
            v["flag_colour"], v["industry"], v["region"] = (rng.choice(FLAG_COLOURS), rng.choice(INDUSTRIES),
                                                             rng.choice(REGIONS))
        elif e.kind == "company":
            v["employees"] = str(rng.randint(15, 950))  # 2-3 digits: never equal to a year
            v["product"], v["logo_animal"] = rng.choice(PRODUCTS), rng.choice(LOGO_ANIMALS)
        else:
            v["length"] = f"{rng.randint(60, 1900)} km"
            v["bridges"] = str(rng.randint(2, 40))
            v["mapped_year"] = str(rng.randint(1500, 1900))
            v["mouth"], v["fish"], v["water_colour"] = rng.choice(lakes), rng.choice(FISH), rng.choice(WATER_COLOURS)
    for e in ents:  # pass 2: references to other entities
        v, me = e.values, {e.name}
        if e.kind == "person":
            v["home_town"] = ref("town", me)
            v["employer"] = ref("company", me)
            v["mentor"] = ref("person", me)
        elif e.kind == "town":
            v["river"] = ref("river", me)
            v["mayor"] = ref("person", me)
            v["twin_town"] = ref("town", me | {v["river"]})
        elif e.kind == "company":
            v["founder"] = ref("person", me)
            v["ceo"] = ref("person", me | {v["founder"]})
            v["headquarters"] = ref("town", me)
            v["rival"] = ref("company", me)
            b = birth.get(v["founder"])
            v["founded_year"] = str(b + rng.randint(22, 55) if b else rng.randint(1750, 1990))
        else:
            v["source"] = ref("town", me)
            v["mapped_by"] = ref("person", me)
        e.values = {a: v[a] for a in ATTRIBUTES[e.kind]}  # canonical attribute order
        assert len(set(e.values.values())) == len(e.values), (e.name, e.values)


def _plan_docs(e: _Entity, p: SyntheticParams, rng: random.Random) -> None:
    """Choose the stated attributes and which docs state them: each one in at least one doc."""
    attrs = list(ATTRIBUTES[e.kind])
    chosen = set(rng.sample(attrs, min(p.attributes_per_entity, len(attrs))))
    e.stated = [a for a in attrs if a in chosen]
    n = p.docs_per_entity
    e.doc_facts = [[] for _ in range(n)]
    order = e.stated[:]
    rng.shuffle(order)
    offset = rng.randrange(n)
    for i, a in enumerate(order):  # round-robin: coverage, and docs share the facts out evenly
        e.doc_facts[(offset + i) % n].append(a)
    for a in order:
        for d in range(n):
            if a not in e.doc_facts[d] and rng.random() < _P_EXTRA_DOC_FOR_FACT:
                e.doc_facts[d].append(a)


def _fillers(e: _Entity, n: int, others: list[str], rng: random.Random) -> list[tuple[str, list[dict]]]:
    """`n` distinct fact-free sentences; many name another entity (never e itself or one of e's values)."""
    ent, own = (e.name, ENTITY_LABEL), set(e.values.values()) | {e.name}
    naming = rng.sample(FILLERS_NAMING, min(n, len(FILLERS_NAMING)))
    plain = rng.sample(FILLERS_PLAIN, min(n, len(FILLERS_PLAIN)))
    out, used = [], set()
    for _ in range(n):
        if others and naming and rng.random() < _P_FILLER_NAMES_OTHER:
            for _ in range(20):  # rejection: `own` is tiny, `others` may be large
                o = rng.choice(others)
                if o not in own and o not in used:
                    used.add(o)
                    out.append(render(naming.pop(), {"E": ent, "O": (o, ENTITY_LABEL)}))
                    break
            else:
                out.append(render(plain.pop(), {}))
        elif plain:
            out.append(render(plain.pop(), {}))
    return out


def _entity_doc(e: _Entity, facts: list[str], others: list[str], rng: random.Random) -> dict:
    ent = (e.name, ENTITY_LABEL)
    intro = render(rng.choice(INTROS[e.kind]), {"E": ent})
    body = []
    for a in facts:
        stmts = ATTRIBUTES[e.kind][a][0]
        body.append(render(rng.choice(stmts), {"E": ent, "V": (e.values[a], a)}))
    body += _fillers(e, rng.randint(*_FILLERS_PER_DOC), others, rng)
    rng.shuffle(body)
    if rng.random() < _P_INTRO_FIRST:
        body.insert(0, intro)
    else:
        body.insert(rng.randrange(len(body) + 1), intro)
    text, spans = join_sentences(body)
    title = render(rng.choice(TITLES[e.kind]), {"E": ent})[0]
    return {"title": title, "text": text, "spans": spans}


def _distractor_doc(others: list[str], rng: random.Random) -> dict:
    k = rng.randint(*_DISTRACTOR_SENTENCES)
    sents = [render(s, {}) for s in rng.sample(DISTRACTOR_SENTENCES, k)]
    if others and rng.random() < _P_DISTRACTOR_NAMES_ENTITY:
        sents.insert(rng.randrange(len(sents) + 1),
                     render(rng.choice(DISTRACTOR_NAMING), {"O": (rng.choice(others), ENTITY_LABEL)}))
    text, spans = join_sentences(sents)
    return {"title": rng.choice(DISTRACTOR_TITLES), "text": text, "spans": spans}


def _unique(make, seen: set[str]) -> dict:
    """Re-draw a document until its text is new: the corpus stage drops exact duplicates."""
    for _ in range(50):
        doc = make()
        if doc["text"] not in seen:
            seen.add(doc["text"])
            return doc
    # practically unreachable; a numbered note keeps it unique and fact-free
    doc["text"] += f" Note {len(seen)}."
    seen.add(doc["text"])
    return doc


def assign_splits(groups: list[str], split: SplitParams) -> list[str]:
    """Split items into train/dev/test by `split` fractions, keeping items of one group together.

    `groups[i]` is item i's group key. Deterministic in (groups, split.seed); the counts are the requested
    fractions of the items, rounded, up to the size of the last group placed."""
    keys = sorted(set(groups))
    random.Random(split.seed).shuffle(keys)
    size: dict[str, int] = {}
    for g in groups:
        size[g] = size.get(g, 0) + 1
    n = len(groups)
    want = {"test": round(split.test * n), "dev": round(split.dev * n)}
    where, have = {}, {"test": 0, "dev": 0}
    for g in keys:
        s = next((s for s in ("test", "dev") if have[s] < want[s]), "train")
        if s != "train":
            have[s] += size[g]
        where[g] = s
    return [where[g] for g in groups]


def _questions(ents: list[_Entity], p: SyntheticParams, doc_ids: list[str], rng: random.Random) -> list[dict]:
    out = []
    for e in ents:
        order = e.stated[:]
        rng.shuffle(order)
        first_template = {a: rng.randrange(len(ATTRIBUTES[e.kind][a][1])) for a in order}
        for j in range(p.questions_per_entity):
            a = order[j % len(order)]
            qs = ATTRIBUTES[e.kind][a][1]
            text = render(qs[(first_template[a] + j // len(order)) % len(qs)], {"E": (e.name, ENTITY_LABEL)})[0]
            gold = sorted(doc_ids[e.doc_keys[d]] for d, facts in enumerate(e.doc_facts) if a in facts)
            value = e.values[a]
            answers = [value] + ([value.split()[0]] if value.endswith(" km") else [])
            out.append({"question": text, "answers": answers, "gold": gold, "group": f"{e.idx}:{a}"})
    return out


def generate_world(p: SyntheticParams, split: SplitParams | None = None) -> World:
    """Build the fact world for `p` (sizes, seed), with questions split by `split` (default SplitParams())."""
    split = split or SplitParams()
    rng = random.Random(p.seed)
    names = NameRegistry(rng)
    ents = _make_entities(p, rng, names)
    _assign_values(ents, rng, names)
    all_names = [e.name for e in ents]

    docs: list[dict] = []
    seen: set[str] = set()
    for e in ents:
        _plan_docs(e, p, rng)
        for facts in e.doc_facts:
            e.doc_keys.append(len(docs))
            docs.append(_unique(lambda: _entity_doc(e, facts, all_names, rng), seen))
    for _ in range(p.distractor_docs):
        docs.append(_unique(lambda: _distractor_doc(all_names, rng), seen))

    # shuffle the corpus so one entity's docs are not neighbours (packing would put them in one block)
    perm = list(range(len(docs)))
    rng.shuffle(perm)
    width = max(5, len(str(len(docs))))
    doc_ids = [""] * len(docs)
    for new, old in enumerate(perm):
        doc_ids[old] = f"syn-{new:0{width}d}"
    passages = [{"doc_id": doc_ids[old], **docs[old]} for old in perm]

    qs = _questions(ents, p, doc_ids, rng)
    rng.shuffle(qs)
    splits = assign_splits([q["group"] for q in qs], split)
    qwidth = max(5, len(str(len(qs))))
    queries, qa = [], []
    qrels: dict[str, dict[str, dict[str, int]]] = {s: {} for s in SPLITS}
    for i, (q, s) in enumerate(zip(qs, splits)):
        qid = f"q-{i:0{qwidth}d}"
        queries.append({"qid": qid, "text": q["question"], "split": s})
        qrels[s][qid] = {d: 1 for d in q["gold"]}
        qa.append({"id": qid, "question": q["question"], "answers": q["answers"], "positive_ctx": q["gold"][0],
                   "split": s})

    ewidth = max(5, len(str(len(ents))))
    entities = [{"entity_id": f"e-{e.idx:0{ewidth}d}", "name": e.name, "kind": e.kind,
                 "facts": {a: e.values[a] for a in e.stated},
                 "doc_ids": [doc_ids[k] for k in e.doc_keys]} for e in ents]
    return World(passages, queries, qrels, qa, entities)


if __name__ == "__main__":
    import time

    t0 = time.perf_counter()
    w = generate_world(SyntheticParams(), SplitParams())
    dt = time.perf_counter() - t0
    print(f"generated in {dt * 1000:.1f} ms: {w.summary()}  fingerprint {w.fingerprint()[:16]}")
    e = w.entities[0]
    by_id = {p["doc_id"]: p for p in w.passages}
    for d in e["doc_ids"]:
        print(json.dumps(by_id[d], ensure_ascii=False))
    for q in w.qa:
        if any(q["positive_ctx"] == d for d in e["doc_ids"]):
            print(json.dumps(q, ensure_ascii=False))
