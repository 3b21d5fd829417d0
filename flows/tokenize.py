"""Stage `tokenize`: train a WordPiece tokenizer (or take the warm start's), tokenise, pack blocks into data/tokens/.

    python -m flows.tokenize                # what `dvc repro tokenize` runs
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.data.tokenize import tokenize_corpus
from components.paths import CORPUS, TOKENS
from flows import run_main
from flows._stage import Artifact, Dataset, run_stage


# log_prints off: `datasets` fingerprints functions with dill, which disassembles them with print()
# into a captured stdout; the flow's print capture would turn each bytecode line into a log line.
@task(cache_policy=NO_CACHE, log_prints=False)
def tokenize_and_pack(tok_params, corpus_dir: str, out_dir: str, warm_start: str | None = None) -> dict:
    return tokenize_corpus(tok_params, corpus_dir, out_dir, warm_start=warm_start)


def _metrics(card: dict) -> dict:
    return ({k: card[k] for k in ("vocab_size", "tokens", "pretrain_blocks", "retrieval_blocks")}
            | {f"throughput_{k}": v for k, v in card["throughput"].items()})


def _report(card: dict) -> str:
    return (f"tokenize: {card['tokens']} tokens -> {card['pretrain_blocks']} pretrain blocks, "
            f"{card['retrieval_blocks']} retrieval blocks ({card['throughput']['tokens_per_s']:.0f} tokens/s)")


def _warm_start(params) -> str | None:
    if params.warm_start.path is None:  # the usual case: no need to import torch (encoder.py) to say so
        return None
    from components.models.encoder import warm_start_path

    return warm_start_path(params)


@flow(name="tokenize", log_prints=True)
def tokenize_flow() -> dict:
    # warm_start.path set: the corpus is tokenized with that encoder's own tokenizer
    return run_stage("tokenize", ["tokenize", "warm_start"],
                     lambda params, run: tokenize_and_pack(params.tokenize, str(CORPUS), str(TOKENS), _warm_start(params)),
                     inputs=[Dataset(CORPUS, "corpus")],
                     outputs=[Dataset(TOKENS / "pretrain", "pretrain_blocks"), Dataset(TOKENS / "blocks", "retrieval_blocks")],
                     metrics=_metrics, report=_report,
                     artifacts=[Artifact(TOKENS / "tokenizer", "tokenizer"), Artifact(TOKENS / "tokenize_card.json")])


if __name__ == "__main__":
    run_main(tokenize_flow, heartbeat=False)
