"""realm.query_tower (issue 28 item 3): `live` embeds x for the top-k search with the query tower being
trained; `index_export` (REALM's) with the query tower of the snapshot that built the index searched,
through the real IndexRefresh, IndexStore and RealmCollator (the trainer is a stand-in that holds the
model, as the Trainer's hooks see it)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from components.config_stages import RealmParams
from components.data import realm_batch as rb
from components.data.realm_query import RealmQuery
from components.data.special_tokens import SpecialTokens
from components.index.faiss_index import IndexStore
from components.index.realm_refresh import IndexRefresh, RefreshContext
from components.models.realm import tiny_bert_config
from components.models.retriever import Retriever, encode_queries

SP = SpecialTokens(pad=0, cls=2, sep=3, mask=4)
N_BLOCKS = 8


@pytest.fixture
def blocks():
    import datasets

    ids = [[10 + i, 20 + i, 30 + (i % 3), 40] for i in range(N_BLOCKS)]
    return datasets.Dataset.from_dict({"input_ids": ids, "block_id": [f"b{i}" for i in range(N_BLOCKS)]})


def _retriever(seed: int = 0) -> Retriever:
    torch.manual_seed(seed)
    return Retriever.from_config(tiny_bert_config(), retriever_dim=8).eval()


def _step(r: Retriever) -> None:
    """A stand-in optimiser step: every weight of the live towers moves."""
    with torch.no_grad():
        for prm in r.parameters():
            prm.add_(0.05 * torch.randn_like(prm))


QUERIES = [RealmQuery([11, SP.mask, 13], [-100, 12, -100], source_row=0),
           RealmQuery([15, 16, SP.mask], [-100, -100, 33], source_row=1)]


def _x(queries) -> dict[str, torch.Tensor]:
    return rb.collate_queries(queries, RealmParams(), SP)


class Recorder:
    """A search that records the query vectors it is sent."""

    def __init__(self, search):
        self.search, self.sent = search, []

    def __call__(self, q, k):
        self.sent.append(np.array(q, copy=True))
        return self.search(q, k)


def _setup(tmp_path, blocks, tower: str):
    p = RealmParams(query_tower=tower, refresh_every=1, refresh_mode="sync", top_k=3, block_len=8, index_type="flat",
                    staleness_k=2, embed_batch_size=4)
    store = IndexStore(tmp_path / "index", use_gpu=False)
    live = _retriever()
    refresh = IndexRefresh(RefreshContext(blocks.select_columns(["input_ids"]), np.asarray(blocks["block_id"]), p, SP,
                                          {k: v for k, v in _x(QUERIES).items() if k in ("x_input_ids", "x_attention_mask")}),
                           store, rank0=True)
    search = Recorder(store.search)
    collator = rb.RealmCollator(blocks, p, SP, live, search,
                                query_encoder=refresh.query_encoder if tower == "index_export" else None)
    return p, live, refresh, search, collator, SimpleNamespace(raw_model=SimpleNamespace(retriever=live), step=0)


def test_index_export_queries_use_the_weights_of_the_snapshot_that_built_the_index(tmp_path, blocks):
    p, live, refresh, search, collator, trainer = _setup(tmp_path, blocks, "index_export")
    try:
        refresh.on_train_start(0, trainer)  # index v1 from the step-0 weights
        at_build = copy.deepcopy(live)
        _step(live)  # training moves the live towers; the index still holds step-0 document vectors
        collator.batch(QUERIES)
        want, now = encode_queries(at_build, _x(QUERIES)), encode_queries(live, _x(QUERIES))
        assert not np.allclose(want, now, atol=1e-4)  # the step did move the query tower
        np.testing.assert_allclose(search.sent[-1], want, rtol=1e-5, atol=1e-6)
        assert refresh.active_encoder is not live and not any(prm.requires_grad for prm in refresh.active_encoder.parameters())

        refresh.on_step_end(1, trainer)  # a sync refresh from the step-1 weights is swapped in ...
        collator.batch(QUERIES)  # ... and from now on its query tower embeds x
        np.testing.assert_allclose(search.sent[-1], encode_queries(live, _x(QUERIES)), rtol=1e-5, atol=1e-6)
    finally:
        refresh.close()


def test_live_queries_use_the_towers_being_trained(tmp_path, blocks):
    p, live, refresh, search, collator, trainer = _setup(tmp_path, blocks, "live")
    try:
        refresh.on_train_start(0, trainer)
        _step(live)
        collator.batch(QUERIES)
        np.testing.assert_allclose(search.sent[-1], encode_queries(live, _x(QUERIES)), rtol=1e-5, atol=1e-6)
        assert refresh.active_encoder is None  # no snapshot is kept alive for live
    finally:
        refresh.close()
