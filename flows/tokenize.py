"""Stage `tokenize`: train (or load) the WordPiece tokenizer, tokenise, pack blocks into data/tokens/.

    python -m flows.tokenize                # what `dvc repro tokenize` runs
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.data.tokenize import tokenize_corpus
from components.tracking import StageRun
from flows._runtime import CORPUS, TOKENS, params_from_env, prefect_tags


@task(cache_policy=NO_CACHE)
def tokenize_and_pack(tok_params, corpus_dir: str, out_dir: str) -> dict:
    return tokenize_corpus(tok_params, corpus_dir, out_dir)


@flow(name="tokenize", log_prints=True)
def tokenize_flow() -> dict:
    params = params_from_env()
    with StageRun("tokenize", params, ["tokenize"], extra_tags=prefect_tags()) as run:
        run.log_dataset(CORPUS, name="corpus", context="input")
        card = tokenize_and_pack(params.tokenize, str(CORPUS), str(TOKENS))
        run.log_dataset(TOKENS / "pretrain", name="pretrain_blocks", context="output")
        run.log_dataset(TOKENS / "blocks", name="retrieval_blocks", context="output")
        run.log_metrics_now({k: card[k] for k in ("vocab_size", "tokens", "pretrain_blocks", "retrieval_blocks")}
                            | {f"throughput_{k}": v for k, v in card["throughput"].items()})
        run.log_artifact(TOKENS / "tokenizer", artifact_path="tokenizer")
        run.log_artifact(TOKENS / "tokenize_card.json")
        print(f"tokenize: {card['tokens']} tokens -> {card['pretrain_blocks']} pretrain blocks, "
              f"{card['retrieval_blocks']} retrieval blocks ({card['throughput']['tokens_per_s']:.0f} tokens/s)")
        return card


if __name__ == "__main__":
    tokenize_flow()
