"""The one shape of a stage flow: open the stage's MLflow run, log its inputs, run the body, log
its metrics and outputs, print a line. Each flow in flows/ states only what differs:

    @flow(name="tokenize", log_prints=True)
    def tokenize_flow() -> dict:
        return run_stage("tokenize", ["tokenize"], lambda params, run: tokenize_and_pack(...),
                         inputs=[Dataset(CORPUS, "corpus")], artifacts=[Artifact(TOKENS / "tokenize_card.json")])

Call it inside the `@flow` function, so the body's `@task`s run in that flow.

Models: `models=[Model(path, name, flavor)]` logs each saved folder as an MLflow 3 logged model of
the stage run. Retrievers (an encoder folder with sentence-transformers files: [CLS] pooling, dot
product, REALM's projection as a Dense module) use the `sentence_transformers` flavor; MLM encoders
the `transformers` flavor (a pipeline of `task`); the open-QA readers `python_function`
(flows/_reader_model.py: question + context(s) in, the answer span out). Each logged model carries
`rr.pipeline_run` (the parent run), so evaluate attaches its metrics (`attach_metrics`) to the
models of the same pipeline run; finetune `register`s one retriever under an alias:

    import mlflow
    model = mlflow.sentence_transformers.load_model("models:/retro-realm-retriever@current")
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Callable, Iterator, Sequence

from components.config import Params
from components.metric_buffer import metric_key
from components.tracking import ENV_PARENT, StageRun
from components.tracking_server import is_server
from components.training.memory import peak_rss_mb
from flows._runtime import params_from_env, prefect_tags


@dataclass(frozen=True)
class Dataset:
    """A file or folder logged as an MLflow dataset (with its md5) under `name`."""
    path: os.PathLike
    name: str
    optional: bool = False  # log it only when it exists


@dataclass(frozen=True)
class Artifact:
    """A file or folder logged as an MLflow artifact (a large one as a reference)."""
    path: os.PathLike
    artifact_path: str | None = None
    optional: bool = False  # log it only when it exists


@dataclass(frozen=True)
class Model:
    """A saved model folder logged as an MLflow logged model `name` of the stage run (skipped when
    the folder does not exist): `sentence_transformers` for retrievers, `python_function` for an
    open-QA reader folder, `transformers` (+ task) else."""
    path: os.PathLike
    name: str
    flavor: str = "transformers"
    task: str | None = None
    card: Callable | None = None  # transformers: (run, path, name, task) -> the ModelCard MLflow stores (flows/_model_card.py)


def numbers(summary: dict) -> dict[str, float]:
    """The summary's numeric values (bools count, as 0/1): what most stages log as metrics."""
    return {k: v for k, v in summary.items() if isinstance(v, (int, float))}


log = logging.getLogger(__name__)


def artifact_key(name: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) from a stage or phase name."""
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")


class _ProgressArtifact(logging.Handler):
    """Turns the trainer's progress records (`extra["rr_progress"]`) into one Prefect progress
    artifact: percent of the current training phase, the phase and its last line as description.
    At most one update every `min_interval` seconds, and always a phase's last step."""

    def __init__(self, key: str, min_interval: float = 2.0):
        super().__init__(logging.INFO)
        self.key, self.min_interval, self.artifact_id, self._last = key, min_interval, None, 0.0

    def emit(self, record: logging.LogRecord) -> None:
        info = getattr(record, "rr_progress", None)
        if info is None:
            return
        done = info["step"] >= info["max_steps"]
        if not done and time.monotonic() - self._last < self.min_interval:
            return
        self._last = time.monotonic()
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        pct = 100.0 * info["step"] / max(1, info["max_steps"])
        try:
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(pct, key=self.key, description=record.getMessage())
            else:
                update_progress_artifact(self.artifact_id, pct, description=record.getMessage())
        except Exception:  # noqa: BLE001 - outside a run, or the API is busy: the log line is what counts
            pass


@contextlib.contextmanager
def training_progress(stage: str) -> Iterator[None]:
    """Inside a flow run: the training loops' progress as the artifact `<stage>-progress`."""
    handler = _ProgressArtifact(f"{artifact_key(stage)}-progress")
    logger = logging.getLogger("components.training.trainer")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def mlflow_run_url(uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI (for the embedded store: the UI `mlflow ui` serves by default),
    in the model-training view (MLflow 3.17's UI follows its GenAI / Model training toggle, which
    this parameter sets, over the experiment's `mlflow.experimentKind` tag)."""
    base = uri.rstrip("/") if is_server(uri) else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def eval_rows(table: dict) -> list[dict]:
    """metrics/eval.json ({dataset: {system: metrics}}, plus "split" and "comparisons") as rows."""
    return [{"dataset": ds, "system": system, **m} for ds, systems in table.items() if isinstance(systems, dict)
            for system, m in systems.items()]


def publish_eval_artifacts(report: str, rows: list[dict], run_url: str, link_text: str, description: str) -> None:
    """In the current flow run: the eval table as the Prefect artifacts `eval-table` (Markdown:
    rows and paired comparisons) and `eval-rows` (a table), and the link `mlflow-pipeline-run`."""
    from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

    create_markdown_artifact(report, key="eval-table", description="retro-realm evaluation: every system, paired comparisons")
    if rows:  # none when no set had a question: the Markdown says so
        cols = sorted({k for r in rows for k in r} - {"dataset", "system"})
        create_table_artifact([{"dataset": r["dataset"], "system": r["system"], **{k: r.get(k) for k in cols}} for r in rows],
                              key="eval-rows", description="metrics/eval.json as rows")
    create_link_artifact(run_url, link_text=link_text, key="mlflow-pipeline-run", description=description)


def _present(item: Dataset | Artifact) -> bool:
    return not item.optional or os.path.exists(item.path)


def run_stage(stage: str, sections: list[str], body: Callable[[Params, StageRun], dict], *,
              params: Params | None = None, inputs: Sequence[Dataset] = (), outputs: Sequence[Dataset] = (),
              metrics: Callable[[dict], dict[str, float]] = numbers, step: Callable[[dict], int] | None = None,
              log_more: Callable[[StageRun, dict], None] | None = None, artifacts: Sequence[Artifact] = (),
              models: Sequence[Model] | Callable[[Params], Sequence[Model]] = (),
              on_models: Callable[[StageRun, dict[str, str]], None] | None = None,
              report: Callable[[dict], str] | None = None, quiet: bool = False) -> dict:
    """Run `body(params, run)` inside the stage's MLflow run and return what it returned.

    In order: `inputs` as input datasets, the body, `outputs` as output datasets, `metrics(result)`
    at `step(result)` (0 by default), `models` as logged models (a list, or one made from the
    params) then `on_models(run, {name: model id})`, `log_more(run, result)`, `artifacts`, then the printed line
    `report(result)` (default "<stage>: <result>"; none with `quiet`). `sections` are the params
    sections the run logs and digests; `params` defaults to RR_PARAMS (else params.yaml).
    """
    params = params if params is not None else params_from_env()
    with StageRun(stage, params, sections, extra_tags=prefect_tags()) as run:
        for d in filter(_present, inputs):
            run.log_dataset(d.path, name=d.name)
        with training_progress(stage):  # a training stage's loops: the `<stage>-progress` artifact
            result = body(params, run)
        for d in filter(_present, outputs):
            run.log_dataset(d.path, name=d.name, context="output")
        # every stage's peak host memory (a training stage's own, from its summary; torchrun's ranks
        # are waited-for children of this process)
        logged = {"peak_rss_mb": round(peak_rss_mb(children=True), 1), **metrics(result)}
        run.log_metrics_now(logged, step=step(result) if step is not None else 0)
        wanted = models(params) if callable(models) else models
        if wanted:
            ids = log_models(run, wanted)
            if on_models is not None:
                on_models(run, ids)
        if log_more is not None:
            log_more(run, result)
        for a in filter(_present, artifacts):
            run.log_artifact(a.path, artifact_path=a.artifact_path)
        if not quiet:
            print(report(result) if report is not None else f"{stage}: {result}")
        return result


# ----------------------------------------------------------------------------------------------
# MLflow logged models
# ----------------------------------------------------------------------------------------------
FLAVORS = ("sentence_transformers", "transformers", "python_function")
READER_MODEL_CODE = Path(__file__).with_name("_reader_model.py")


def _requirements(flavor: str) -> list[str]:
    # Pinned from this environment: MLflow would otherwise infer them by loading the model in a subprocess.
    extra = {"sentence_transformers": ["sentence-transformers"], "python_function": ["pandas", "numpy"]}.get(flavor, [])
    return [f"{p}=={version(p)}" for p in ["torch", "transformers", "safetensors", *extra]]


def reader_signature():
    """question + context (a string) or contexts (a list of strings) -> the answer span."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, Schema

    inputs = Schema([ColSpec("string", "question"), ColSpec("string", "context", required=False),
                     ColSpec(Array("string"), "contexts", required=False)])
    outputs = Schema([ColSpec("string", "answer"), ColSpec("long", "context_index"), ColSpec("long", "start"),
                      ColSpec("long", "end"), ColSpec("double", "score")])
    return ModelSignature(inputs=inputs, outputs=outputs)


READER_EXAMPLE = {"question": ["who founded the city of aldmoor?"],
                  "context": ["The city of Aldmoor was founded by Kessa Varn on the north bank of the river."]}


def _log_reader(run: StageRun, path: Path, name: str, tags: dict[str, str]):
    """The reader folder (HF QA model + tokenizer, `OpenQA.save_pretrained`'s reader/) as a pyfunc
    with the lengths it was trained with, and a copy of `components` so it loads without the repo."""
    import shutil

    import mlflow
    import pandas as pd
    from mlflow.models import Model

    ft = run.params.finetune
    openqa_cfg = path.parent / "openqa_config.json"  # the system folder's: its span limit, scorer and softmax
    saved = json.loads(openqa_cfg.read_text()) if openqa_cfg.is_file() else {}
    config = {"query_len": ft.query_len, "passage_len": ft.passage_len, "max_answer_tokens": ft.max_answer_tokens,
              **{k: v for k, v in saved.items() if k != "retriever_type" and v is not None}}
    with tempfile.TemporaryDirectory() as tmp:
        code = Path(tmp) / "components"
        shutil.copytree(Path(__file__).resolve().parents[1] / "components", code, ignore=shutil.ignore_patterns("__pycache__"))
        return Model.log(None, name=name, flavor=mlflow.pyfunc, python_model=str(READER_MODEL_CODE),
                         artifacts={"reader": str(path)}, model_config=config, code_paths=[str(code)],
                         signature=reader_signature(), input_example=pd.DataFrame(READER_EXAMPLE),
                         run_id=run.run_id, tags=tags, pip_requirements=_requirements("python_function"))


def log_model(run: StageRun, path: str | os.PathLike, name: str, flavor: str, task: str | None = None,
              card: Callable | None = None) -> str:
    """Log the folder `path` as the logged model `name` of `run`; returns its model id. `card` (the
    transformers flavor): makes the model card MLflow stores, which it would otherwise look up on the HF
    hub under the folder's path, warning twice when that fails."""
    import mlflow
    from mlflow.models import Model

    if flavor not in FLAVORS:
        raise ValueError(f"flavor={flavor!r}; known: {FLAVORS}")
    mlflow.set_tracking_uri(run.uri)
    # Model.log creates the logged model in the fluent API's current experiment: make it the run's
    mlflow.set_experiment(experiment_id=run.client.get_run(run.run_id).info.experiment_id)
    tags = {"rr.stage": run.stage, "rr.pipeline_run": os.environ.get(ENV_PARENT, ""), "rr.path": str(path)}
    t0 = time.perf_counter()
    if flavor == "sentence_transformers":
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(path), device="cpu")
        info = Model.log(None, name=name, flavor=mlflow.sentence_transformers, model=model, run_id=run.run_id, tags=tags,
                         pip_requirements=_requirements(flavor))
    elif flavor == "python_function":
        info = _log_reader(run, Path(path), name, tags)
    else:
        import transformers

        # a pipeline, not the folder: MLflow 3.17 reads a folder's task through an API transformers 5 changed
        pipe = transformers.pipeline(task, model=str(path), tokenizer=str(path), device="cpu")
        info = Model.log(None, name=name, flavor=mlflow.transformers, transformers_model=pipe, task=task,
                         model_card=card(run, Path(path), name, task) if card else None, run_id=run.run_id, tags=tags,
                         pip_requirements=_requirements(flavor))
    log.info("logged model %s (%s) from %s in %.1fs: %s", name, flavor, path, time.perf_counter() - t0, info.model_uri)
    return info.model_id


def log_models(run: StageRun, models: Sequence[Model]) -> dict[str, str]:
    """`log_model` for each `Model` whose folder exists; {name: model id}. A model that cannot be
    logged is a warning, never a failed stage: its folder is still an artifact."""
    ids = {}
    for m in models:
        if not Path(m.path).is_dir():
            continue
        try:
            ids[m.name] = log_model(run, m.path, m.name, m.flavor, m.task, m.card)
        except Exception as e:  # noqa: BLE001 - a model MLflow cannot save: its folder is an artifact anyway
            log.warning("could not log %s (%s) as an MLflow model: %s: %s", m.name, m.flavor, type(e).__name__, str(e)[:300])
    return ids


def register(run: StageRun, model_id: str) -> str:
    """Register `model_id` as a new version of `tracking.registry_name` and point
    `tracking.registry_alias` at it (the alias follows the latest pipeline run). Returns the version."""
    import mlflow

    t = run.params.tracking
    mlflow.set_tracking_uri(run.uri)
    mv = mlflow.register_model(f"models:/{model_id}", t.registry_name, tags={"rr.pipeline_run": os.environ.get(ENV_PARENT, "")})
    run.client.set_registered_model_alias(t.registry_name, t.registry_alias, mv.version)
    run.set_tags({"rr.registered_model": f"{t.registry_name}/{mv.version}"})
    log.info("registered %s version %s, alias @%s -> models:/%s@%s", t.registry_name, mv.version, t.registry_alias,
             t.registry_name, t.registry_alias)
    return mv.version


def pipeline_models(run: StageRun) -> dict[str, str]:
    """{name: model id}: for each name, the newest model logged in this pipeline run, else (a stage
    DVC skipped as unchanged, or a stage run on its own) the newest of that name in the experiment."""
    exp = run.client.get_run(run.run_id).info.experiment_id
    parent = os.environ.get(ENV_PARENT, "")
    ours: dict[str, str] = {}
    newest: dict[str, str] = {}
    for m in run.client.search_logged_models([exp], order_by=[{"field_name": "creation_time", "ascending": False}],
                                             max_results=1000):
        newest.setdefault(m.name, m.model_id)
        if parent and m.tags.get("rr.pipeline_run") == parent:
            ours.setdefault(m.name, m.model_id)
    return {**newest, **ours}


def attach_metrics(run: StageRun, by_model: dict[str, dict[str, float]], dataset: tuple[str, str] | None = None) -> int:
    """Log each model's metrics on `run` with its model id (and the dataset they were measured on),
    so the logged model's page shows them. Models not found are skipped. Returns how many were attached."""
    from mlflow.entities import Metric

    ids = pipeline_models(run)
    ts, n, batch = int(time.time() * 1000), 0, []
    for name, metrics in by_model.items():
        if name not in ids:
            continue
        for k, v in metrics.items():
            batch.append(Metric(metric_key(k), float(v), ts, 0, model_id=ids[name],
                                dataset_name=dataset[0] if dataset else None, dataset_digest=dataset[1] if dataset else None))
            n += 1
    for i in range(0, len(batch), 1000):
        run.client.log_batch(run.run_id, metrics=batch[i : i + 1000])
    return n
