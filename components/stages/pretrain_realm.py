"""Stage body of `pretrain_realm@<arm>`: REALM pre-training (Guu et al. 2020) with an asynchronously
refreshed MIPS index.

    python -m flows.pretrain_realm --arm refreshed                   # one process (the flow)
    RR_STAGE_ITEM=stale torchrun --standalone --nproc_per_node=2 -m components.stages.pretrain_realm

Two arms of one recipe, REALM's stale-MIPS ablation (the paper: NQ EM 38.2 -> 28.7): `refreshed`
refreshes every `realm.refresh_every` steps into models/realm/; `stale` is the same run with the
index refreshed `realm.stale_factor` times less often (0: never after the first), into
models/realm-stale/ (`RealmParams.for_arm`). Each arm is evaluated with its own towers and its own
final index.

`train_realm`, in order:
1. Rows: the blocks with a salient span to mask (`eligible_rows`), minus `realm.heldout_queries`
   held-out blocks whose fixed masked queries never train; they stay in the index (knowledge, not
   questions). The probe sets: components/eval/realm_probes.py.
2. The model: `build_model` (components/models/realm.py) with the ICT warm-up of the retriever,
   then the reader warm-up (components/training/warmups.py). The arms share them: whichever runs
   first trains them into `warmup_root`, the other resumes their finished checkpoints. What follows
   from the same weights is shared there too: the NER tags, the first index with its probes and the
   held-out accuracy at step 0. `realm.freeze_reader` then freezes the reader; `realm.train.retriever_lr`
   gives the retriever its own lr group.
3. Training: the shared Trainer on `RealmCollator` batches (salient-span masked queries, the
   candidates searched in the CURRENT index, slot 0 the null document; REALM.forward rescores them
   with gradients into both towers). `IndexRefresh` (components/index/realm_refresh.py) builds the
   first index, refreshes it every `realm.refresh_every` steps and swaps it in at step boundaries.
   Under torchrun each refresh is sharded: every rank embeds 1/N of the blocks, the rows are
   all-gathered and every rank builds the same index (components/index/shard.py).
4. The end: held-out masked-token accuracy and probe recall with the final index and with the one
   training last used; models/realm/ (retriever/, knowledge_augmented_encoder/, index/first/,
   index/final/, model_card.md, realm_config.json; ict_retriever/ when ICT ran: the retriever after
   ICT, before any REALM step, evaluate's `ict` row), metrics/pretrain_realm.json,
   plots/realm_refresh.csv and the loss curve plots/loss_pretrain_realm.csv (`_stale` for the stale arm).

Resume: the Trainer restores weights, optimizer and RNG; the first refresh removes any half-written
index and builds from the RESUMED weights, so an index from a killed run is never used. Sync
refresh is deterministic; in async mode the step at which a new index lands depends on timing.
What each summary metric means, and why the stage is built so: docs/experiments/realm.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from components import paths
from components.config import Params
from components.data.realm_batch import RealmCollator, SpecialTokens, collate_queries, passage_columns
from components.data.realm_query import RealmQuery, eligible_rows, fixed_queries
from components.data.salient_spans import span_tagger_for
from components.eval.realm_probes import evaluate_mlm, probe_sets, run_probes
from components.index.faiss_index import IndexStore
from components.index.realm_refresh import IndexRefresh, RefreshContext, RefreshWrapper
from components.io import atomic_dir, remove_leftovers, write_json_atomic, write_text_atomic
from components.models.realm import REALM_CONFIG, build_model
from components.stages.common import (ENV_STAGE_ITEM, MetricRecorder, RankZeroLogger, checkpoint_dir, shared_phase,
                                      torchrun_worker, write_loss_curve, write_stage_metrics)
from components.training import distributed as D
from components.training.optim import LrGroup
from components.training.precision import autocast_for
from components.training.trainer import Trainer
from components.training.warmups import ict_warmup, reader_warmup

log = logging.getLogger(__name__)

STAGE = "pretrain_realm"


def arm_files(arm: str) -> tuple[Path, Path, Path]:
    """(models folder, summary JSON, refresh plot CSV) of `pretrain_realm@<arm>`."""
    suffix = "" if arm == "refreshed" else f"_{arm}"
    return (paths.REALM_ARM_OUT[arm], paths.METRICS / f"{STAGE}{suffix}.json",
            paths.PLOTS / f"realm_refresh{suffix}.csv")


def checkpoint_root(params: Params, arm: str = "refreshed", corpus_dir: Path = paths.CORPUS,
                    retromae_dir: Path = paths.RETROMAE_ENCODER) -> Path:
    """The arm's checkpoint folder (its training steps and index versions), keyed by the
    realm and retromae params and by the encoder it starts from (`params`: the arm's own, `for_arm`)."""
    return checkpoint_dir(STAGE if arm == "refreshed" else f"{STAGE}_{arm}", params, ["realm", "retromae"], corpus_dir,
                          inputs=[retromae_dir])


def warmup_root(params: Params, corpus_dir: Path = paths.CORPUS, retromae_dir: Path = paths.RETROMAE_ENCODER) -> Path:
    """The warm-ups' checkpoint folder (ICT, the reader's), shared by the arms: they differ only in
    their refresh cadence, which no warm-up reads (`params`: before `for_arm`). It also holds what the
    arms compute alike before their first step: ner_entities.json, first_index/ and
    first_index_heldout_eval.json."""
    return checkpoint_dir(f"{STAGE}_warmup", params, ["realm", "retromae"], corpus_dir, inputs=[retromae_dir])


def split_rows(blocks, p, special: SpecialTokens, seed: int,
               ner_cache: Path | None = None) -> tuple[list[int], list[int], list[RealmQuery], dict]:
    """The blocks with a salient span, split into training rows and `realm.heldout_queries` held-out
    rows (at most a quarter); the held-out rows' fixed masked queries; the inputs of the fixed
    training queries that measure staleness. `ner_cache`: the NER tagger's entities file (`eligible_rows`)."""
    rows = eligible_rows(blocks, p, special.mask, seed, ner_cache=ner_cache)
    rng = np.random.default_rng(seed)
    n_held = min(p.heldout_queries, len(rows) // 4)
    held = sorted(rng.choice(rows, size=n_held, replace=False).tolist()) if n_held else []
    train_rows = sorted(set(rows) - set(held))
    if len(train_rows) < p.train.batch_size:
        raise ValueError(f"only {len(train_rows)} blocks have a salient span to mask, "
                         f"fewer than realm.train.batch_size={p.train.batch_size}")
    held_queries = fixed_queries(blocks, held, p, special, seed + 1, draws=p.heldout_draws)
    stale_rows = rng.choice(train_rows, size=min(p.staleness_probes, len(train_rows)), replace=False).tolist()
    stale_x = collate_queries(fixed_queries(blocks, stale_rows, p, special, seed + 2), p, special)
    return train_rows, held, held_queries, {k: stale_x[k] for k in ("x_input_ids", "x_attention_mask")}


def retriever_lr_groups(train) -> list[LrGroup]:
    """`realm.train.retriever_lr`: the retriever (towers and projections) at its own base lr; none
    when null (one rate, the paper's)."""
    if train.retriever_lr is None:
        return []
    return [LrGroup("retriever", lambda name: name.startswith("retriever."), train.retriever_lr)]


def _model_card(params: Params, summary: dict, info: dict) -> str:
    p = params.realm
    return "\n".join([
        "# REALM (retriever + knowledge-augmented encoder)", "",
        "Trained by retro-realm (`dvc repro pretrain_realm`): REALM pre-training (Guu et al. 2020) with salient-span",
        f"masking and an index refreshed every {p.refresh_every} steps ({p.refresh_mode}).", "",
        f"- retriever init: `{info['retriever_init']}`; knowledge-augmented encoder init: `{info['knowledge_augmented_encoder_init']}`",
        f"- index: `index/first/` (built at step {summary.get('first_index_step')}), `index/final/` (step {summary.get('step')})",
        f"- probes: {summary.get('probe_set')} (n={summary.get('probe_n')}), recall@{p.staleness_k} = {summary.get('recall_at_k')}", "",
        "## Params", "```json", json.dumps(p.model_dump(mode="json"), indent=2), "```", "",
        "## Summary", "```json", json.dumps(summary, indent=2, default=str), "```", "",
        "## Load", "```python",
        "from components.models.realm import REALM",
        "from components.models.retriever import Retriever",
        "from components.index.faiss_index import BlockIndex",
        'model = REALM.from_pretrained("models/realm")          # retriever + knowledge_augmented_encoder',
        'retriever = Retriever.from_pretrained("models/realm/retriever")',
        *(['ict = Retriever.from_pretrained("models/realm/ict_retriever")  # after ICT, before REALM: its start'] if "ict_steps" in info else []),
        'index = BlockIndex.load("models/realm/index/final")',
        "```",
    ]) + "\n"


def train_realm(
    params: Params,
    run=None,
    *,
    refresh_wrapper: RefreshWrapper | None = None,
    tokens_dir: Path = paths.TOKENS,
    corpus_dir: Path = paths.CORPUS,
    retromae_dir: Path = paths.RETROMAE_ENCODER,
    out_dir: Path | None = None,
    metrics_path: Path | None = None,
    plot_path: Path | None = None,
    arm: str = "refreshed",
) -> dict:
    """Run the stage for one arm (`refreshed` or `stale`); returns the summary also written to
    `metrics_path` (rank 0). The paths default to the arm's (`arm_files`).

    `refresh_wrapper(body, step=, reason=) -> dict` runs each refresh (the flow passes the Prefect
    subflow `refresh_index`; default: call `body()`)."""
    import datasets

    from components.data.tokenize import load_tokenizer

    warm_root = warmup_root(params, corpus_dir, retromae_dir)
    params = params.model_copy(update={"realm": params.realm.for_arm(arm)})
    default_out, default_metrics, default_plot = arm_files(arm)
    out_dir, metrics_path, plot_path = out_dir or default_out, metrics_path or default_metrics, plot_path or default_plot
    p = params.realm
    pe = params.tracking.progress_every  # progress lines in the probes too
    tokenizer = load_tokenizer(tokens_dir / "tokenizer")
    special = SpecialTokens.from_tokenizer(tokenizer)
    blocks = datasets.load_from_disk(str(tokens_dir / "blocks"))
    block_ids = np.asarray(blocks["block_id"])
    block_doc = np.asarray(blocks["doc_id"])
    ckpt_root = checkpoint_root(params, arm, corpus_dir, retromae_dir)
    # The process group must exist before asking for the rank (the Trainer would create it later, too late).
    rank0 = D.init_distributed(params.compute).rank == 0
    if rank0:  # what a kill cut short in the arm's own folder (refresh_history.json); the Trainer and the
        remove_leftovers(ckpt_root)  # index store sweep their subfolders, and no write is in flight yet
    if run is not None and rank0:
        tagger = span_tagger_for(p)
        run.set_tags({"realm.retriever_init": p.retriever_init, "realm.refresh_mode": p.refresh_mode,
                      "realm.span_tagger": "regex (ner_missing fallback)" if tagger.fallback else tagger.kind})

    seed = params.compute.seed
    train_rows, held, held_queries, stale_x = split_rows(blocks, p, special, seed, ner_cache=warm_root / "ner_entities.json")
    probes = probe_sets(held_queries, blocks, block_ids, block_doc, corpus_dir, tokenizer, p, special)
    main_probes, held_probes, held_entity = probes[""], probes["heldout_"], probes["heldout_entity_"]
    probe = partial(run_probes, probes=probes, block_ids=block_ids, block_doc=block_doc, k=p.staleness_k)
    log.info("%s: %d blocks, %d trainable (+%d held out, %d with an answer in another block), probes: %s (%d)", STAGE,
             len(blocks), len(train_rows), len(held), len(held_probes) if held_probes else 0,
             main_probes.kind if main_probes else "none", len(main_probes) if main_probes else 0)

    # The warm-ups are the same computation in both arms: the first arm to get here trains them, the
    # other resumes their final checkpoints (`shared_phase`).
    with shared_phase(warm_root, f"{STAGE}@{arm} warm-ups"):
        ict = partial(ict_warmup, blocks=blocks, params=params, special=special, out_dir=warm_root / "ict",
                      log_fn=RankZeroLogger(run), exclude=set(held))
        model, info = build_model(params, tokenizer, retromae_dir, warm_up_retriever=ict)
        if p.reader_warmup_steps:
            info.update(reader_warmup(model.knowledge_augmented_encoder, blocks, train_rows, params, special,
                                      warm_root / "reader_warmup", RankZeroLogger(run)))
    ict_retriever = ckpt_root / paths.ICT_RETRIEVER  # the ICT-only control: the retriever REALM starts from
    if "ict_steps" in info and rank0:  # ICT ran, or was resumed finished (its final checkpoint's weights)
        model.retriever.save_pretrained(ict_retriever, tokenizer)
    if p.freeze_reader:  # after its warm-up: REALM steps then train the retriever only
        model.freeze_reader()
    if run is not None and rank0:
        run.set_tags({"realm.knowledge_augmented_encoder_init": info["knowledge_augmented_encoder_init"],
                      "realm.probe_set": main_probes.kind if main_probes else "none"})

    train = p.train
    if train.num_workers:
        log.warning("realm.train.num_workers=%d ignored: the collate searches the live index, which worker processes cannot see",
                    train.num_workers)
        train = train.model_copy(update={"num_workers": 0})
    store = IndexStore(ckpt_root / "index", use_gpu="auto")
    collator = RealmCollator(blocks, p, special, model.retriever, store.search,  # realm.query_tower: who embeds x for the search
                             query_encoder=(lambda: refresh.query_encoder()) if p.query_tower == "index_export" else None)
    recorder = MetricRecorder(run)
    # The arms start from the same weights, so the first arm to start saves the first index and the
    # held-out accuracy at step 0 beside the warm-ups, and the other reads them.
    refresh = IndexRefresh(RefreshContext(blocks.select_columns(passage_columns(p)), block_ids, p, special, stale_x, probe),
                           store, run=run, wrapper=refresh_wrapper, history_path=ckpt_root / "refresh_history.json", rank0=rank0,
                           start_cache=warm_root / "first_index")
    ev_start: dict[str, float] = {}
    ev_start_file = warm_root / "first_index_heldout_eval.json"

    def on_train_start(step: int, trainer: Trainer) -> None:
        refresh.on_train_start(step, trainer)
        if rank0 and step == 0:  # the start of the curve: held-out accuracy before any update (not on a resume)
            if ev_start_file.is_file():
                ev_start.update(json.loads(ev_start_file.read_text()))
                return
            with autocast_for(params.compute.precision, trainer.device):
                ev_start.update(evaluate_mlm(trainer.raw_model, collator, held_queries, refresh.active,
                                             batch_size=trainer.micro_batch, progress_every=pe))
            write_json_atomic(ev_start_file, ev_start)

    trainer = Trainer(model, train_rows, collator, train, params.compute, ckpt_root, log_fn=recorder,
                      hooks={"on_train_start": on_train_start, "on_step_end": refresh.on_step_end},
                      log_every=params.tracking.log_every, param_prefix="realm.train",
                      progress_every=params.tracking.progress_every, lr_groups=retriever_lr_groups(train))
    refresh.ctx.amp_dtype = trainer.amp_dtype  # index embeddings in the precision REALM's rescoring runs in
    try:
        result = trainer.fit()
        timing = refresh.finish(trainer)
    finally:
        refresh.close()

    summary: dict[str, Any] = {"step": result.step, "resumed_from": result.resumed_from or 0, "bad_steps": result.bad_steps,
                               "train_seconds": round(result.elapsed_s, 2), **info}
    if not rank0:
        D.barrier()
        return summary

    # held-out masked-token accuracy: with the final index, and with the index training used last
    final_index = refresh.active
    stale_at_end = refresh.train_index is not final_index
    with autocast_for(params.compute.precision, trainer.device):
        # in training's micro-batches: a held-out batch holds top_k joint inputs per query, and a larger
        # one than training's would set the stage's peak memory
        ev = evaluate_mlm(trainer.raw_model, collator, held_queries, final_index, batch_size=trainer.micro_batch, progress_every=pe)
        ev_train = (evaluate_mlm(trainer.raw_model, collator, held_queries, refresh.train_index, batch_size=trainer.micro_batch,
                                 progress_every=pe) if stale_at_end else ev)
    last, start = refresh.ok_rows[-1], refresh.ok_rows[0]
    train_probe = probe(trainer.raw_model.retriever, refresh.train_index) if stale_at_end else last
    cadence = [r for r in refresh.history if r.get("reason") == "cadence"]
    stale_vals = [r["staleness"] for r in refresh.ok_rows if r.get("staleness") is not None and r.get("reason") == "cadence"]
    first = store.first()
    summary.update({
        "loss": recorder.tail_mean("loss", train.max_steps), "mlm_acc": recorder.tail_mean("mlm_acc", train.max_steps),
        "final_loss": result.metrics.get("loss"), "final_mlm_acc": result.metrics.get("mlm_acc"),
        "eval_mlm_acc": ev.get("mlm_acc"), "eval_loss": ev.get("loss"), "eval_tokens": ev.get("tokens"),
        "eval_mlm_acc_train_index": ev_train.get("mlm_acc"), "eval_mlm_acc_start": ev_start.get("mlm_acc"),
        "k": p.staleness_k, "recall_at_k_start": start.get("recall_at_k"),
        "recall_at_k": last.get("recall_at_k"), "mean_rank": last.get("mean_rank"),
        "recall_at_k_train_index": train_probe.get("recall_at_k"), "mean_rank_train_index": train_probe.get("mean_rank"),
        "probe_set": main_probes.kind if main_probes else "none", "probe_n": len(main_probes) if main_probes else 0,
        # held-out masked queries (block-level gold, own block excluded): first index, final, training's last
        "heldout_n": len(held_probes) if held_probes else 0,
        "heldout_recall_at_k_start": start.get("heldout_recall_at_k"), "heldout_mean_rank_start": start.get("heldout_mean_rank"),
        "heldout_recall_at_k": last.get("heldout_recall_at_k"), "heldout_mean_rank": last.get("heldout_mean_rank"),
        "heldout_recall_at_k_train_index": train_probe.get("heldout_recall_at_k"),
        "heldout_entity_n": len(held_entity) if held_entity else 0,
        "heldout_entity_recall_at_k_start": start.get("heldout_entity_recall_at_k"),
        "heldout_entity_mean_rank_start": start.get("heldout_entity_mean_rank"),
        "heldout_entity_recall_at_k": last.get("heldout_entity_recall_at_k"),
        "heldout_entity_mean_rank": last.get("heldout_entity_mean_rank"),
        "heldout_entity_recall_at_k_train_index": train_probe.get("heldout_entity_recall_at_k"),
        "refreshes": sum(1 for r in cadence if r.get("ok")), "failures": sum(1 for r in cadence if not r.get("ok")),
        "mean_staleness": float(np.mean(stale_vals)) if stale_vals else None,
        "final_index_version": final_index.version, "first_index_version": first.version if first else None,
        "first_index_step": first.step if first else None,
        "fraction_hidden": timing.get("fraction_hidden", 0.0), "refresh_hidden_s": timing.get("hidden_s", 0.0),
        "refresh_blocked_s": timing.get("blocked_s", 0.0), "refresh_build_s": timing.get("build_s", 0.0),
        "refresh_deferred": timing.get("steps_due_while_busy", 0.0),
    })
    summary = {k: v for k, v in summary.items() if v is not None}

    # outputs, each written atomically
    store.set_current(final_index.version)  # CURRENT on disk = the final version (cheap: once, at the end)
    with atomic_dir(out_dir) as tmp:
        trainer.raw_model.retriever.save_pretrained(tmp / "retriever", tokenizer)  # + its tokenizer, root and query tower
        trainer.raw_model.knowledge_augmented_encoder.save_pretrained(tmp / "knowledge_augmented_encoder")
        tokenizer.save_pretrained(str(tmp / "knowledge_augmented_encoder"))
        write_json_atomic(tmp / REALM_CONFIG, {"marginalization": trainer.raw_model.marginalization})
        (first or final_index).save(tmp / "index" / "first", extra_meta={"role": "first"})
        final_index.save(tmp / "index" / "final", extra_meta={"role": "final"})
        write_text_atomic(tmp / "model_card.md", _model_card(params, summary, info))
        if "ict_steps" in info:
            shutil.copytree(ict_retriever, tmp / paths.ICT_RETRIEVER)
    write_text_atomic(plot_path, refresh.csv_text())
    write_loss_curve(paths.loss_curve(f"{STAGE}@{arm}"), result.curve)
    summary = write_stage_metrics(metrics_path, summary)
    log.info("%s: %s", STAGE, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()})
    D.barrier()
    return summary


def main() -> None:
    arm = os.environ[ENV_STAGE_ITEM]
    torchrun_worker(f"{STAGE}@{arm}", lambda params, run: train_realm(params, run, arm=arm))


if __name__ == "__main__":
    main()
