"""Stage `prepare_corpus`: read the configured source, normalise, de-duplicate, write data/corpus/.

    python -m flows.prepare_corpus          # what `dvc repro prepare_corpus` runs
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from components.data.errors import DataError
from components.data.prepare import prepare_corpus
from components.paths import CORPUS
from flows import run_main
from flows._stage import Artifact, Dataset, run_stage


def _retry_io_only(task, task_run, state) -> bool:
    """Retry transient I/O (S3, network); a bad input file will be just as bad on the next try."""
    try:
        state.result()
    except (DataError, ValueError):
        return False
    except Exception:  # noqa: BLE001
        return True
    return False


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=_retry_io_only)
def read_clean_write(data_params, out_dir: str) -> dict:
    return prepare_corpus(data_params, out_dir)


def _metrics(card: dict) -> dict:
    return {"passages": card["passages"], "duplicates_dropped": card["dedupe"]["duplicates_dropped"],
            "skipped_lines": card["read"]["skipped"], "queries_train": card["queries"]["train"],
            "queries_test": card["queries"]["test"]}


def _report(card: dict) -> str:
    return (f"prepare_corpus: {card['passages']} passages ({card['dedupe']['duplicates_dropped']} duplicates dropped, "
            f"{card['read']['skipped']} bad lines skipped, {card['dropped_empty']} empty dropped), queries {card['queries']}")


@flow(name="prepare_corpus", log_prints=True)
def prepare_corpus_flow() -> dict:
    return run_stage("prepare_corpus", ["data"], lambda params, run: read_clean_write(params.data, str(CORPUS)),
                     outputs=[Dataset(CORPUS, "corpus")], metrics=_metrics,
                     artifacts=[Artifact(CORPUS / "data_card.json")], report=_report)


if __name__ == "__main__":
    run_main(prepare_corpus_flow, heartbeat=False)
