"""REALM's retriever (Guu et al. 2020, eq. 2): p(z | x) = softmax_z(Embed_input(x) . Embed_doc(z)).

    retriever = Retriever.from_encoder("models/retromae/encoder", retriever_dim=128)
    q = retriever.encode_query(ids, mask)        # (B, d)  Embed_input = W_proj BERT_CLS(x)
    z = retriever.encode_passage(ids, mask)      # (N, d)  Embed_doc
    scores = q @ z.T                             # (B, N)  inner products: what the MIPS index ranks

Towers are shared by default (`share_towers`, the released code's `share_embedders`); untied =
two independent copies. Saved as an HF encoder folder per tower plus `retriever_config.json`,
and as a sentence-transformers model of the query tower ([CLS] pooling, the projection as a Dense
module, dot product): `SentenceTransformer("models/realm/retriever").encode(texts)` == encode_query.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import BertConfig, BertModel

from components.io import atomic_dir, write_json_atomic
from components.models.encoder import load_encoder, run_length_chunks, write_sentence_transformers_config

RETRIEVER_CONFIG = "retriever_config.json"


# ----------------------------------------------------------------------------------------------
# retriever
# ----------------------------------------------------------------------------------------------
def _new_projection(hidden: int, dim: int) -> nn.Linear:
    # Semi-orthogonal init: with dim == hidden it is a rotation, so a RetroMAE [CLS] space keeps its
    # inner products at step 0 (a cold, random projection would throw away the warm start).
    proj = nn.Linear(hidden, dim)
    nn.init.orthogonal_(proj.weight)
    nn.init.zeros_(proj.bias)
    return proj


class Retriever(nn.Module):
    """Embed_input / Embed_doc: [CLS] of a BERT encoder, projected to `retriever_dim`; score = inner product.

    `encode_query(input_ids, attention_mask) -> (B, d)`, `encode_passage(...) -> (N, d)`,
    inputs `[CLS] tokens [SEP] pad...`. With `share_towers` one encoder + projection serves both;
    `passage_encoder`/`passage_projection` then are aliases, not registered twice (so the state
    dict and safetensors files hold each tensor once).
    """

    def __init__(
        self,
        query_encoder: nn.Module,
        query_projection: nn.Linear,
        passage_encoder: nn.Module | None = None,
        passage_projection: nn.Linear | None = None,
    ):
        super().__init__()
        if (passage_encoder is None) != (passage_projection is None):
            raise ValueError("give both passage_encoder and passage_projection (untied) or neither (shared)")
        self.query_encoder = query_encoder
        self.query_projection = query_projection
        self.share_towers = passage_encoder is None
        if not self.share_towers:
            self._passage_encoder = passage_encoder
            self._passage_projection = passage_projection
        self.length_chunk_tokens = 0  # compute.length_chunk_tokens (set by the Trainer): how the towers run, not saved

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def _from_encoder_module(cls, encoder: nn.Module, retriever_dim: int, share_towers: bool) -> "Retriever":
        proj = _new_projection(encoder.config.hidden_size, retriever_dim)
        if share_towers:
            return cls(encoder, proj)
        # Untied: the document tower starts as an exact copy and then drifts (REALM: share_embedders=False).
        return cls(encoder, proj, copy.deepcopy(encoder), copy.deepcopy(proj))

    @classmethod
    def from_config(cls, config: BertConfig, retriever_dim: int = 128, share_towers: bool = True) -> "Retriever":
        """Random BERT towers (`retriever_init: random`)."""
        return cls._from_encoder_module(BertModel(config, add_pooling_layer=False), retriever_dim, share_towers)

    @classmethod
    def from_encoder(cls, path: str | os.PathLike, retriever_dim: int = 128, share_towers: bool = True) -> "Retriever":
        """Towers from an HF encoder folder (`retriever_init: retromae`); fresh projection."""
        return cls._from_encoder_module(load_encoder(path), retriever_dim, share_towers)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Retriever":
        """Load what `save_pretrained` wrote."""
        path = Path(path)
        cfg = json.loads((path / RETRIEVER_CONFIG).read_text())

        def tower(name: str) -> tuple[nn.Module, nn.Linear]:
            enc = load_encoder(path / f"{name}_encoder")
            proj = nn.Linear(enc.config.hidden_size, cfg["retriever_dim"])
            proj.load_state_dict(load_file(str(path / f"{name}_projection.safetensors")))
            return enc, proj

        q_enc, q_proj = tower("query")
        if cfg["share_towers"]:
            return cls(q_enc, q_proj)
        return cls(q_enc, q_proj, *tower("passage"))

    def save_pretrained(self, path: str | os.PathLike, tokenizer=None) -> Path:
        """Write `path/` atomically: query_encoder/ (HF folder, safetensors) + query_projection.safetensors,
        and passage_encoder/ + passage_projection.safetensors when the towers are untied; plus the
        sentence-transformers files of the query tower (`write_sentence_transformers_retriever`).
        `tokenizer`: saved in `path/` and in query_encoder/ (where sentence-transformers reads it)."""
        with atomic_dir(path) as tmp:
            self._write(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
                tokenizer.save_pretrained(str(tmp / "query_encoder"))
        return Path(path)

    def _write(self, folder: Path) -> None:
        towers = [("query", self.query_encoder, self.query_projection)]
        if not self.share_towers:
            towers.append(("passage", self._passage_encoder, self._passage_projection))
        for name, enc, proj in towers:
            enc.save_pretrained(folder / f"{name}_encoder")
            save_file({k: v.detach().contiguous().cpu() for k, v in proj.state_dict().items()},
                      str(folder / f"{name}_projection.safetensors"))
        write_json_atomic(folder / RETRIEVER_CONFIG, {"retriever_dim": self.retriever_dim, "share_towers": self.share_towers})
        write_sentence_transformers_retriever(folder, self.query_encoder, self.query_projection)

    # -- towers ------------------------------------------------------------------------------------
    @property
    def retriever_dim(self) -> int:
        return self.query_projection.out_features

    @property
    def passage_encoder(self) -> nn.Module:
        return self.query_encoder if self.share_towers else self._passage_encoder

    @property
    def passage_projection(self) -> nn.Linear:
        return self.query_projection if self.share_towers else self._passage_projection

    def _embed(self, encoder: nn.Module, proj: nn.Linear, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids  # (N, L)

        def cls(ids: torch.Tensor, mask: torch.Tensor, tt: torch.Tensor) -> torch.Tensor:
            return encoder(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state[:, 0]  # (n, H)

        # length_chunk_tokens: the rows in length chunks (encoder.run_length_chunks), the same [CLS] up to rounding
        return proj(run_length_chunks(cls, input_ids, attention_mask, types, chunk_tokens=self.length_chunk_tokens))  # (N, d): projected [CLS]

    def encode_query(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Embed_input(x): (B, L) -> (B, d)."""
        return self._embed(self.query_encoder, self.query_projection, input_ids, attention_mask)

    def encode_passage(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Embed_doc(z): (N, L) -> (N, d). `token_type_ids` (N, L): REALM's `[CLS] title [SEP] body [SEP]`
        has 0 on the title part, 1 on the body (`realm.doc_input: title_body`); None = all 0."""
        return self._embed(self.passage_encoder, self.passage_projection, input_ids, attention_mask, token_type_ids)

    def forward(self, query_ids, query_mask, passage_ids, passage_mask) -> torch.Tensor:
        """Relevance scores (B, N) of every query against every passage (inner products)."""
        return self.encode_query(query_ids, query_mask) @ self.encode_passage(passage_ids, passage_mask).T


@torch.inference_mode()
def write_sentence_transformers_retriever(folder: Path, encoder: nn.Module, projection: nn.Linear,
                                          tower: str = "query_encoder") -> None:
    """modules.json: Transformer (`tower`/) -> [CLS] Pooling -> Dense (the projection, no
    activation), similarity dot: the embedding Embed_input(x) = W_proj BERT_CLS(x). The Dense
    weights are a copy of `<tower>_projection.safetensors` (a few KB), in sentence-transformers' layout."""
    hidden, dim = projection.in_features, projection.out_features
    write_sentence_transformers_config(folder / tower, hidden, encoder.config.max_position_embeddings)
    for name in ("modules.json", "1_Pooling", "config_sentence_transformers.json"):  # the model's, not the module's
        (folder / tower / name).replace(folder / name)
    write_json_atomic(folder / "modules.json", [
        {"idx": 0, "name": "0", "path": tower, "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
    ])
    write_json_atomic(folder / "2_Dense" / "config.json", {
        "in_features": hidden, "out_features": dim, "bias": projection.bias is not None,
        "activation_function": "torch.nn.modules.linear.Identity"})
    save_file({f"linear.{k}": v.detach().contiguous().cpu() for k, v in projection.state_dict().items()},
              str(folder / "2_Dense" / "model.safetensors"))


@torch.no_grad()  # vectors to search with, never trained through: also safe when called outside inference_mode
def encode_queries(retriever: Retriever, x: dict[str, torch.Tensor], batch_size: int = 256) -> np.ndarray:
    """Query vectors (Q, d) float32 of `x_input_ids` / `x_attention_mask` (Q, Lx), in eval mode
    (what the index is searched with: the probes, the staleness queries)."""
    dev = next(retriever.parameters()).device
    was = retriever.training
    retriever.eval()
    try:
        ids, mask = x["x_input_ids"], x["x_attention_mask"]
        out = [retriever.encode_query(ids[i:i + batch_size].to(dev), mask[i:i + batch_size].to(dev)).float().cpu()
               for i in range(0, ids.shape[0], batch_size)]
    finally:
        retriever.train(was)
    return torch.cat(out).numpy() if out else np.zeros((0, retriever.retriever_dim), np.float32)
