"""REALM pre-training (Guu et al. 2020, "REALM: Retrieval-Augmented Language Model Pre-Training").

    p(y | x) = sum_z p(y | x, z) p(z | x)              (eq. 1: marginalise over retrieved documents)
    p(z | x) = softmax_z( Embed_input(x) . Embed_doc(z) )                 (the `retriever`, eq. 2)
    p(y | x, z) = prod_j p(y_j | x, z)                    (the `knowledge_augmented_encoder`, eq. 3)

Pieces (paper names):

* `Retriever` (components/models/retriever.py): BERT [CLS] vector -> linear projection to
  `retriever_dim` (Embed = W_proj BERT_CLS), for both `encode_query` (Embed_input) and
  `encode_passage` (Embed_doc).
* `KnowledgeAugmentedEncoder`: BertForMaskedLM over `[CLS] x [SEP] z [SEP]` (token types 0 | 1).
  The `null_document` is an empty z: `[CLS] x [SEP] [SEP]`.
* `REALM`: scores the K candidates with the *current* retriever (gradients reach both towers,
  paper section 3.4: the stale MIPS index only *selects* the top k), runs the reader once on all
  B*K pairs, and marginalises.
* `build_model(params, tokenizer, retromae_dir)`: the REALM stage's model (towers per
  `realm.retriever_init`, the reader from RetroMAE's encoder when there is one).

Top-k retrieval from the FAISS index happens outside the model (components/data/realm_batch.py),
so the index can be rebuilt asynchronously while training (`refresh_index`); the batch carries the
candidates' token ids with the null document in slot 0.

Marginalisation (`RealmParams.marginalization`):
* `per_token` (default; what the released code computes, language/realm/model.py):
      log p(y_j | x) = logsumexp_z [ log p(y_j | x, z) + log p(z | x) ]  per masked token j,
      loss = - mean over all masked tokens of the batch.
  Each token may be explained by a different document.
* `per_sequence` (the paper's eq. 1 + 3 read literally):
      log p(y | x) = logsumexp_z [ sum_j log p(y_j | x, z) + log p(z | x) ]  per example,
      loss = - sum over examples / number of masked tokens in the batch (same scale as per_token).
  With one salient span per query both are close; they differ most for long spans.

Try it (random tiny weights):
    .venv/bin/python -c "from components.models.realm import demo; print(demo())"
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, BertForMaskedLM

from components.data.special_tokens import IGNORE_INDEX
from components.io import atomic_dir, write_json_atomic
from components.models.encoder import load_mlm_encoder, run_length_chunks
from components.models.retriever import Retriever

log = logging.getLogger(__name__)

Marginalization = Literal["per_token", "per_sequence"]

REALM_CONFIG = "realm_config.json"


# ----------------------------------------------------------------------------------------------
# knowledge-augmented encoder (the reader of REALM pre-training)
# ----------------------------------------------------------------------------------------------
def knowledge_augmented_inputs(
    x_ids: torch.Tensor, x_mask: torch.Tensor, z_ids: torch.Tensor, z_mask: torch.Tensor, pad_token_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Join every query with each of its K documents: `[CLS] x [SEP] z [SEP]`, packed to the left.

    x_ids (B, Lx) is `[CLS] x [SEP] pad...`; z_ids (B, K, Lz) is `z [SEP] pad...` (the
    null document: `[SEP] pad...`). Both right-padded. z is written directly after x's own last
    token, not after x's padding, so positions match those of the unpadded pair (BERT's absolute
    position embeddings would otherwise see a different sequence per batch).
    Returns input_ids, attention_mask, token_type_ids, each (B, K, L) with L = longest pair.
    """
    B, Lx = x_ids.shape
    K, Lz = z_ids.shape[1:]
    x_len = x_mask.sum(1)  # (B,)
    ids = torch.full((B, K, Lx + Lz), pad_token_id, dtype=x_ids.dtype, device=x_ids.device)
    mask = torch.zeros((B, K, Lx + Lz), dtype=x_mask.dtype, device=x_mask.device)
    ids[:, :, :Lx] = x_ids[:, None]  # x's padding is overwritten by z below, or stays masked
    mask[:, :, :Lx] = x_mask[:, None]
    z_pos = (x_len[:, None, None] + torch.arange(Lz, device=x_ids.device)).expand(B, K, Lz)  # (B, K, Lz)
    ids.scatter_(2, z_pos, z_ids)
    mask.scatter_(2, z_pos, z_mask.to(mask.dtype))
    token_type = torch.zeros_like(ids).scatter_(2, z_pos, z_mask.to(ids.dtype))  # 1 on z tokens only
    L = int((x_len[:, None] + z_mask.sum(-1)).max())  # longest real pair; the rest is padding
    return ids[..., :L], mask[..., :L], token_type[..., :L]


class KnowledgeAugmentedEncoder(nn.Module):
    """p(y_j | x, z): a BERT masked LM reading `[CLS] x [SEP] z [SEP]`.

    `masked_log_probs` runs the encoder on all B*K pairs (once, or in length chunks) and applies the
    (vocab-sized) MLM head only at the masked positions: the head is the most expensive part at small L.
    """

    def __init__(self, mlm: BertForMaskedLM):
        super().__init__()
        self.mlm = mlm
        self.length_chunk_tokens = 0  # compute.length_chunk_tokens (set by the Trainer): how the pairs run, not saved

    @classmethod
    def from_config(cls, config: BertConfig) -> "KnowledgeAugmentedEncoder":
        return cls(BertForMaskedLM(config))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "KnowledgeAugmentedEncoder":
        """From an HF BERT folder (RetroMAE/MLM output) through the shared loader: missing encoder
        weights raise, a missing MLM head is built tied to the word embeddings."""
        return cls(load_mlm_encoder(path))

    def save_pretrained(self, path: str | os.PathLike) -> Path:
        with atomic_dir(path) as tmp:
            self.mlm.save_pretrained(tmp)
        return Path(path)

    @property
    def pad_token_id(self) -> int:
        pad = self.mlm.config.pad_token_id
        return 0 if pad is None else int(pad)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        """Full MLM logits (N, L, V); for inspection and brute-force checks, not the training path."""
        return self.mlm(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits

    def masked_log_probs(
        self,
        input_ids: torch.Tensor,  # (B, K, L)
        attention_mask: torch.Tensor,  # (B, K, L)
        token_type_ids: torch.Tensor,  # (B, K, L)
        mask_batch: torch.Tensor,  # (M,) example index of each masked token
        mask_pos: torch.Tensor,  # (M,) its position (inside x, hence also inside the joint input)
    ) -> torch.Tensor:
        """log p(. | x, z_k) at every masked token for every document: (M, K, V), float32."""
        B, K, L = input_ids.shape

        def body(ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
            return self.mlm.bert(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state  # (n, w, H)

        # The B*K pairs differ in length (z's length, the null document's nothing), so with
        # length_chunk_tokens they run in length chunks, each at its own width; the masked positions lie
        # in x, before any pair's end, so the zeros padded back past a chunk's width are never read.
        hidden = run_length_chunks(body, input_ids.view(B * K, L), attention_mask.view(B * K, L), token_type_ids.view(B * K, L),
                                   chunk_tokens=self.length_chunk_tokens, pad_value=0.0)  # (B*K, L, H)
        hidden = hidden.view(B, K, L, -1)[mask_batch, :, mask_pos]  # (M, K, H): only masked tokens
        logits = self.mlm.cls(hidden)  # (M, K, V)
        return F.log_softmax(logits.float(), dim=-1)  # float32: logsumexp over K needs the precision


# ----------------------------------------------------------------------------------------------
# REALM
# ----------------------------------------------------------------------------------------------
class REALM(nn.Module):
    """Retriever + knowledge-augmented encoder, trained by maximising the marginal likelihood.

    `forward(batch)` takes the dict built by `components.data.realm_batch.collate`:
        x_input_ids (B, Lx)  `[CLS] masked x [SEP]`, x_attention_mask (B, Lx),
        x_labels (B, Lx)     original ids at masked positions, -100 elsewhere,
        z_input_ids (B, K, Lz) `z [SEP]` per candidate, slot 0 = null document `[SEP]`,
        z_attention_mask (B, K, Lz), candidate_mask (B, K) optional (False: no document, e.g.
        the index returned fewer than K; such slots get p(z|x) = 0).
    Returns scalars: loss, mlm_acc, retrieval_entropy, p_null, retrieval_utility, num_masked (the M
    masked tokens the loss averages over) and num_tokens (the real tokens the knowledge-augmented
    encoder read, for tokens/s).
    """

    def __init__(
        self,
        retriever: Retriever,
        knowledge_augmented_encoder: KnowledgeAugmentedEncoder,
        marginalization: Marginalization = "per_token",
        rescore_dropout: bool = True,
    ):
        super().__init__()
        if marginalization not in ("per_token", "per_sequence"):
            raise ValueError(f"marginalization must be per_token|per_sequence, got {marginalization!r}")
        self.retriever = retriever
        self.knowledge_augmented_encoder = knowledge_augmented_encoder
        self.marginalization = marginalization
        self.rescore_dropout = rescore_dropout  # realm.rescore_dropout: False keeps the towers' dropout off in training
        self.reader_frozen = False  # realm.freeze_reader, set by freeze_reader() once the reader warm-up is done
        self.train(self.training)

    def freeze_reader(self) -> "REALM":
        """Train the retriever only (`realm.freeze_reader`): the reader's parameters stop requiring
        gradients (so the optimiser holds no state for them), it stays in eval mode, and `forward`
        runs it under no_grad. The retriever's gradient is unchanged: d loss / d log p(z|x) needs
        log p(y|x,z) only as a value per z, never its graph. Call it after the reader warm-up."""
        self.knowledge_augmented_encoder.requires_grad_(False)
        self.reader_frozen = True
        return self.train(self.training)

    def train(self, mode: bool = True) -> "REALM":
        """As nn.Module.train, except: a frozen reader stays in eval mode (its dropout would only add
        noise to a constant p(y|x,z)); with rescore_dropout off the retriever towers stay in eval
        mode, which in BERT switches dropout only, so gradients still flow."""
        super().train(mode)
        if self.reader_frozen:
            self.knowledge_augmented_encoder.eval()
        if not self.rescore_dropout:
            self.retriever.eval()
        return self

    # -- construction / persistence -------------------------------------------------------------
    def save_pretrained(self, path: str | os.PathLike) -> Path:
        """`path/retriever/`, `path/knowledge_augmented_encoder/` (HF folders) and realm_config.json, atomically."""
        with atomic_dir(path) as tmp:
            self.retriever._write(tmp / "retriever")
            self.knowledge_augmented_encoder.mlm.save_pretrained(tmp / "knowledge_augmented_encoder")
            write_json_atomic(tmp / REALM_CONFIG, {"marginalization": self.marginalization})
        return Path(path)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "REALM":
        path = Path(path)
        cfg = json.loads((path / REALM_CONFIG).read_text())
        return cls(
            Retriever.from_pretrained(path / "retriever"),
            KnowledgeAugmentedEncoder.from_pretrained(path / "knowledge_augmented_encoder"),
            cfg["marginalization"],
        )

    # -- the model -------------------------------------------------------------------------------
    def retrieval_log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """log p(z | x) over the K candidates, with the CURRENT retriever: (B, K)."""
        x_ids, x_mask = batch["x_input_ids"], batch["x_attention_mask"]
        z_ids, z_mask = batch["z_input_ids"], batch["z_attention_mask"]
        B, K, Lz = z_ids.shape
        if "p_input_ids" in batch:
            # realm.doc_input=title_body: the collator built the document tower's own input,
            # `[CLS] title [SEP] body [SEP]` with token types 0 / 1, beside the reader's z.
            p_ids, p_mask, p_types = (batch[f"p_{k}"].flatten(0, 1) for k in ("input_ids", "attention_mask", "token_type_ids"))
        else:
            # Embed_doc input is `[CLS] z [SEP]`; x_ids[:, 0] is the [CLS] id, so no tokenizer is needed here.
            cls_col = x_ids[:, :1, None].expand(B, K, 1)
            p_ids = torch.cat([cls_col, z_ids], dim=-1).view(B * K, Lz + 1)  # (B*K, 1+Lz)
            p_mask = torch.cat([torch.ones_like(z_mask[..., :1]), z_mask], dim=-1).view(B * K, Lz + 1)
            p_types = None
        q = self.retriever.encode_query(x_ids, x_mask)  # (B, d)
        types = {} if p_types is None else {"token_type_ids": p_types}  # body-only towers take no token types
        d = self.retriever.encode_passage(p_ids, p_mask, **types).view(B, K, -1)  # (B, K, d)
        # float32 even under bf16 autocast: scores of tens with bf16's 8-bit mantissa would be
        # rounded by ~0.25, enough to reorder close candidates in p(z|x).
        with torch.autocast(device_type=q.device.type, enabled=False):
            scores = torch.einsum("bd,bkd->bk", q.float(), d.float())  # (B, K) relevance f(x, z)
        cand = batch.get("candidate_mask")
        if cand is not None:
            scores = scores.masked_fill(~cand.bool(), float("-inf"))
        return F.log_softmax(scores, dim=-1)  # (B, K)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x_ids, x_mask, labels = batch["x_input_ids"], batch["x_attention_mask"], batch["x_labels"]
        B = x_ids.shape[0]
        log_pz = self.retrieval_log_probs(batch)  # (B, K)
        K = log_pz.shape[1]

        mask_batch, mask_pos = (labels != IGNORE_INDEX).nonzero(as_tuple=True)  # (M,), (M,)
        targets = labels[mask_batch, mask_pos]  # (M,)
        M = targets.numel()
        if M == 0:  # nothing masked: a zero loss that still touches the graph (DDP-safe)
            zero = log_pz.sum() * 0.0
            return {"loss": zero, "mlm_acc": zero.detach(), "retrieval_entropy": zero.detach(),
                    "p_null": zero.detach(), "retrieval_utility": zero.detach(), "num_masked": zero.detach(),
                    "num_tokens": zero.detach()}

        ka_ids, ka_mask, ka_types = knowledge_augmented_inputs(
            x_ids, x_mask, batch["z_input_ids"], batch["z_attention_mask"], self.knowledge_augmented_encoder.pad_token_id)
        with torch.no_grad() if self.reader_frozen else contextlib.nullcontext():  # frozen: no graph through the reader
            log_py_all = self.knowledge_augmented_encoder.masked_log_probs(ka_ids, ka_mask, ka_types, mask_batch, mask_pos)  # (M, K, V)
        log_py = log_py_all.gather(-1, targets.view(M, 1, 1).expand(M, K, 1)).squeeze(-1)  # (M, K): log p(y_j|x,z)
        log_pz_tok = log_pz[mask_batch]  # (M, K)

        if self.marginalization == "per_token":
            # released code: each masked token marginalises over z on its own
            log_py_x = torch.logsumexp(log_py + log_pz_tok, dim=1)  # (M,)
            loss = -log_py_x.mean()
        else:
            # paper: one z explains the whole masked span; sum token log-probs per (example, z) first
            seq_log_py = log_py.new_zeros(B, K).index_add(0, mask_batch, log_py)  # (B, K): sum_j log p(y_j|x,z)
            has_mask = torch.zeros(B, dtype=torch.bool, device=x_ids.device)
            has_mask[mask_batch] = True
            log_py_x_seq = torch.logsumexp(seq_log_py + log_pz, dim=1)[has_mask]  # (B',)
            loss = -log_py_x_seq.sum() / M

        with torch.no_grad():
            stats = self._stats(log_py_all, log_py, log_pz, log_pz_tok, targets)
        return {"loss": loss, **stats, "num_masked": torch.tensor(float(M), device=loss.device),
                "num_tokens": ka_mask.sum().detach().float()}

    @staticmethod
    def _stats(log_py_all, log_py, log_pz, log_pz_tok, targets) -> dict[str, torch.Tensor]:
        # mlm_acc: argmax of the marginal p(v | x) = sum_z p(v | x, z) p(z | x), at each masked token
        marginal = torch.logsumexp(log_py_all + log_pz_tok[..., None], dim=1)  # (M, V)
        acc = (marginal.argmax(-1) == targets).float().mean()
        pz = log_pz.exp()  # (B, K)
        entropy = -(pz * log_pz.masked_fill(pz == 0, 0.0)).sum(-1).mean()  # 0 * log 0 := 0
        # retrieval_utility (released code): how much retrieving helps over the null document alone
        utility = (torch.logsumexp(log_py + log_pz_tok, dim=1) - log_py[:, 0]).mean()
        return {"mlm_acc": acc, "retrieval_entropy": entropy, "p_null": pz[:, 0].mean(), "retrieval_utility": utility}


# ----------------------------------------------------------------------------------------------
# construction for the stage
# ----------------------------------------------------------------------------------------------
def _encoder_config(params, tokenizer, retromae_dir: Path) -> BertConfig:
    """The BERT config for random towers / reader: RetroMAE's when it exists (same architecture), else
    built from `retromae.encoder` (the project's one encoder spec)."""
    if (retromae_dir / "config.json").is_file():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(retromae_dir))
    from components.models.encoder import build_encoder

    return build_encoder(params.retromae.encoder, len(tokenizer), tokenizer.pad_token_id, cls_token_id=tokenizer.cls_token_id,
                         sep_token_id=tokenizer.sep_token_id, mask_token_id=tokenizer.mask_token_id).config


def build_model(params, tokenizer, retromae_dir: Path,
                warm_up_retriever: Callable[[Retriever], dict] | None = None) -> tuple[REALM, dict]:
    """REALM for `params` (components.config.Params) -> (model, info for the summary).

    Retriever per `realm.retriever_init`: `retromae` = towers from `retromae_dir`, `ict` / `random`
    = random towers; for `retromae` and `ict` with `realm.ict_steps`, then `warm_up_retriever(retriever)`
    (the ICT warm-up, components.training.warmups; its metrics join `info`). It is a callback
    because it must run between the two inits: the reader's random init draws from the torch RNG
    after it. The reader starts from `retromae_dir` (masked-LM weights) when it exists, else random."""
    p = params.realm
    torch.manual_seed(params.compute.seed)  # same projection/reader init for every variant of a comparison
    info: dict[str, Any] = {"retriever_init": p.retriever_init}
    has_retromae = (retromae_dir / "config.json").is_file()
    if p.retriever_init == "retromae":
        if not has_retromae:
            raise FileNotFoundError(f"realm.retriever_init=retromae needs {retromae_dir} (run `dvc repro pretrain_retromae`), "
                                    "or set realm.retriever_init to ict or random")
        retriever = Retriever.from_encoder(retromae_dir, p.retriever_dim, p.share_towers)
    else:
        retriever = Retriever.from_config(_encoder_config(params, tokenizer, retromae_dir), p.retriever_dim, p.share_towers)
    if p.retriever_init == "ict" and p.ict_steps == 0:
        log.warning("realm.retriever_init=ict with realm.ict_steps=0: the retriever stays random")
    if p.retriever_init in ("ict", "retromae") and p.ict_steps and warm_up_retriever is not None:
        info.update(warm_up_retriever(retriever))
    if has_retromae:
        reader = KnowledgeAugmentedEncoder.from_pretrained(retromae_dir)
        info["knowledge_augmented_encoder_init"] = "retromae"
    else:
        reader = KnowledgeAugmentedEncoder.from_config(_encoder_config(params, tokenizer, retromae_dir))
        info["knowledge_augmented_encoder_init"] = "random"
    log.info("REALM: retriever_init=%s, knowledge_augmented_encoder from %s", p.retriever_init,
             retromae_dir if has_retromae else "a random init (no RetroMAE encoder found)")
    return REALM(retriever, reader, p.marginalization, rescore_dropout=p.rescore_dropout), info


def tiny_bert_config(vocab_size: int = 100, hidden: int = 32, layers: int = 1, heads: int = 2, max_position: int = 128) -> BertConfig:
    """A test-sized BERT config (dropout off so forward passes are deterministic)."""
    return BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=hidden * 2, max_position_embeddings=max_position,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)


def demo(seed: int = 0) -> dict[str, float]:
    """Random tiny REALM on a random batch; returns the forward's scalars."""
    torch.manual_seed(seed)
    cfg = tiny_bert_config()
    model = REALM(Retriever.from_config(cfg, 16), KnowledgeAugmentedEncoder.from_config(cfg))
    B, K, Lx, Lz = 2, 3, 8, 6
    x = torch.randint(5, 100, (B, Lx))
    x[:, 0], x[:, -1] = 2, 3
    labels = torch.full_like(x, IGNORE_INDEX)
    labels[:, 2:4] = x[:, 2:4]
    x[:, 2:4] = 4
    z = torch.randint(5, 100, (B, K, Lz))
    z[..., -1] = 3
    z[:, 0] = 0
    z[:, 0, 0] = 3
    z_mask = (z != 0).long()
    batch = {"x_input_ids": x, "x_attention_mask": torch.ones_like(x), "x_labels": labels,
             "z_input_ids": z, "z_attention_mask": z_mask}
    return {k: round(float(v.detach()), 4) for k, v in model(batch).items()}
