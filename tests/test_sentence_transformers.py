"""Every encoder folder the pipeline writes loads with `SentenceTransformer(path)` and encodes as
the pipeline does: [CLS] pooling, dot product, and REALM's projection (a Dense module)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from components import paths
from components.data.tokenize import load_tokenizer
from components.models.biencoder import BiEncoder
from components.models.encoder import cls_pool, load_encoder, save_encoder
from components.models.retriever import Retriever
from tests.conftest import build_data_and_encoders, tiny_params

TEXTS = ["who founded the city of aldmoor", "the river runs north of the old bridge", "a"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("st")
    build_data_and_encoders(root, tiny_params(), encoder_dirs=("retromae/encoder",))
    return root, load_tokenizer(root / paths.TOKENS / "tokenizer")


def _ids(tok, texts, max_len=48):
    t = tok(texts, max_length=max_len, truncation=True, padding=True, return_tensors="pt", return_token_type_ids=False)
    return t["input_ids"], t["attention_mask"]


def _st(path):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    model.max_seq_length = 48
    return model


def test_encoder_folder_is_a_cls_dot_sentence_transformer(built):
    root, tok = built
    folder = root / paths.MODELS / "retromae/encoder"  # save_encoder's default, as pretrain_retromae/mlm write it
    st = _st(folder)
    assert st.similarity_fn_name == "dot"
    pooling = json.loads((folder / "1_Pooling/config.json").read_text())
    assert pooling["pooling_mode_cls_token"] and not pooling["pooling_mode_mean_tokens"]
    enc = load_encoder(folder).eval()
    with torch.no_grad():
        want = cls_pool(enc, *_ids(tok, TEXTS)).numpy()
    got = st.encode(TEXTS, convert_to_numpy=True)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_biencoder_folder_is_a_cls_dot_sentence_transformer(built, tmp_path):
    root, tok = built
    model = BiEncoder(load_encoder(root / paths.MODELS / "retromae/encoder")).eval()
    model.save_pretrained(tmp_path / "ft", tok, max_seq_length=48)
    with torch.no_grad():
        want = model.encode_query(*_ids(tok, TEXTS)).numpy()
    np.testing.assert_allclose(_st(tmp_path / "ft").encode(TEXTS), want, atol=1e-5)


@pytest.mark.parametrize("share_towers", [True, False])
def test_realm_retriever_folder_encodes_queries_with_its_projection(built, tmp_path, share_towers):
    root, tok = built
    torch.manual_seed(0)
    retriever = Retriever.from_encoder(root / paths.MODELS / "retromae/encoder", retriever_dim=16, share_towers=share_towers).eval()
    retriever.save_pretrained(tmp_path / "retriever", tok)
    st = _st(tmp_path / "retriever")
    assert st.get_embedding_dimension() == 16 and st.similarity_fn_name == "dot"
    with torch.no_grad():
        want = retriever.encode_query(*_ids(tok, TEXTS)).numpy()
    np.testing.assert_allclose(st.encode(TEXTS), want, atol=1e-5)
    again = Retriever.from_pretrained(tmp_path / "retriever")  # the custom layout still loads
    with torch.no_grad():
        np.testing.assert_allclose(again.eval().encode_query(*_ids(tok, TEXTS)).numpy(), want, atol=1e-6)


def test_init_encoder_saved_without_sentence_transformers_files_on_request(built, tmp_path):
    root, tok = built
    save_encoder(load_encoder(root / paths.MODELS / "retromae/encoder"), tok, tmp_path / "plain", sentence_transformers=False)
    assert not (tmp_path / "plain" / "modules.json").exists()
