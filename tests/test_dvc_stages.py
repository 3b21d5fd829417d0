"""DVC owns the DAG: the two data stages run through `dvc repro`, are tracked as MLflow child runs,
and changing a `tokenize.*` param reruns only `tokenize` (and what follows), never prepare_corpus.
`dvc.yaml` and `components/paths.py` name the same folders."""

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from components import paths
from components.config import load_params
from tests.conftest import dvc_stages, make_workspace

ROOT = Path(__file__).resolve().parents[1]


def _repro(ws: Path, env: dict, *targets: str) -> str:
    venv_bin = str(Path(sys.executable).parent)
    env = {**env, "PATH": venv_bin + os.pathsep + env["PATH"]}
    out = subprocess.run(["dvc", "repro", *targets], cwd=ws, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _ran(stdout: str) -> set[str]:
    return {line.split("'")[1] for line in stdout.splitlines() if line.startswith("Running stage '")}


def _names(entries) -> list[str]:
    return [(next(iter(e)) if isinstance(e, dict) else e).rstrip("/") for e in entries or []]


def test_dvc_yaml_names_the_folders_of_components_paths():
    from flows._runtime import STAGES

    raw = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    # source_digest is no flow: it records the content behind data.path for prepare_corpus
    assert list(raw)[0] == "source_digest" and raw["source_digest"]["always_changed"]
    assert [k for k in raw if k != "source_digest"] == STAGES
    stages = {k: v for k, v in dvc_stages().items() if k != "source_digest"}
    assert {k.partition("@")[0] for k in stages} == set(STAGES)
    assert {"pretrain_realm@refreshed", "pretrain_realm@stale", "finetune_retriever@retromae-32", "finetune_retriever@init-32",
            "finetune_reader@bm25", "finetune_reader@realm", "finetune_reader@realm-stale"} <= set(stages)
    produced = [f for spec in stages.values() for f in _names(spec.get("outs"))]  # folders and plain files (cache: false)
    for name, spec in stages.items():
        # the stage summaries and plot tables are plain files beside the cached outputs (cache: false)
        cached = [o for o in spec.get("outs", []) if not (isinstance(o, dict) and next(iter(o.values())).get("cache") is False)]
        assert _names(cached) == [str(p) for p in paths.stage_outs(name)], name
        for dep in _names(spec.get("deps")):
            if dep.split("/")[0] in ("components", "flows"):
                assert (ROOT / dep).exists(), f"{name}: dep {dep} does not exist"
            elif dep != "data/source.json":  # a DAG folder: another stage's output, one inside one, or one holding several
                assert any(dep == o or dep.startswith(o + "/") or o.startswith(dep + "/") for o in produced), \
                    f"{name}: {dep} is no stage's output"
        uncached = _names(o for o in spec.get("outs", []) if o not in cached)
        assert all(Path(f).parent in (paths.METRICS, paths.PLOTS) for f in uncached), (name, uncached)
        if name.startswith(("pretrain_retromae", "pretrain_mlm", "finetune_")) or name == "pretrain_realm@refreshed":
            assert str(paths.stage_metrics(name.replace("pretrain_realm@refreshed", "pretrain_realm"))) in uncached, name
        assert _names(spec.get("metrics")) == (["metrics/headline"] if name == "evaluate" else []), name


def test_plots_draw_every_plot_file_with_templates_that_read_its_columns():
    """`plots:` names each CSV a stage writes (cache: false) and evaluate's figures; a template parses
    and every field it reads is a column of its CSV (or DVC's own `rev`)."""
    from components.eval.report import CURVE_COLUMNS

    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    plots = {name: p for entry in spec["plots"] for name, p in (entry.items() if isinstance(entry, dict) else [(entry, {})])}
    written = {f for s in dvc_stages().values() for f in _names(s.get("outs")) if f.startswith("plots/") and f.endswith(".csv")}
    drawn = {f for p in plots.values() for f in (p.get("y") or {})}
    assert "plots/label_efficiency.csv" in written and written == drawn
    assert {"metrics/eval/recall_at_k.png", "metrics/eval/label_efficiency.png"} <= set(plots)
    columns = {"plots/label_efficiency.csv": set(CURVE_COLUMNS), "plots/recall_at_k.csv": {"system", "k", "recall"}}
    for name in ("label_efficiency", "label_efficiency_recall", "recall_at_k"):
        p = plots[name]
        template = json.loads((ROOT / p["template"]).read_text())
        text = json.dumps(template)
        assert "<DVC_METRIC_DATA>" in text and "<DVC_METRIC_X>" in text and "<DVC_METRIC_Y>" in text, name
        (csv_file, y), = p["y"].items()
        assert {p["x"], y} <= columns[csv_file], name
        fields = {v for k, v in _walk(template) if k == "field" and not v.startswith("<DVC_METRIC_")}
        fields |= {f for k, v in _walk(template) if k == "filter" for f in re.findall(r"datum\.(\w+)", v)}
        assert fields and fields <= columns[csv_file] | {"rev"}, (name, fields - columns[csv_file])
    assert plots["label_efficiency"]["y"] == {"plots/label_efficiency.csv": "ndcg_at_10"}


def _walk(node):
    """(key, value) of every string leaf of a JSON document."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from ([(k, v)] if isinstance(v, str) else _walk(v))
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


@pytest.mark.slow
def test_data_stages_rerun_only_downstream(tmp_path, shared_prefect_api):
    ws = make_workspace(tmp_path / "ws")
    uri = f"sqlite:///{ws}/mlflow.db"
    env = {**os.environ, "PREFECT_API_URL": shared_prefect_api, "MLFLOW_TRACKING_URI": uri, "RR_PARENT_RUN_ID": ""}

    assert _ran(_repro(ws, env, "tokenize")) == {"source_digest", "prepare_corpus", "tokenize"}
    assert (ws / paths.TOKENS / "pretrain").is_dir() and (ws / "dvc.lock").exists()
    assert _ran(_repro(ws, env, "tokenize")) == {"source_digest"}  # nothing changed: only the digest re-reads

    params = (ws / "params.yaml").read_text().replace("vocab_size: 400", "vocab_size: 420")
    assert "vocab_size: 420" in params
    (ws / "params.yaml").write_text(params)
    assert _ran(_repro(ws, env, "tokenize")) == {"source_digest", "tokenize"}

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("retro-realm")
    runs = client.search_runs([exp.experiment_id])
    by_stage = {}
    for r in runs:
        by_stage.setdefault(r.data.tags["dvc.stage"], []).append(r)
    assert len(by_stage["prepare_corpus"]) == 1 and len(by_stage["tokenize"]) == 2
    tok = by_stage["tokenize"][0]
    assert tok.info.status == "FINISHED" and tok.data.tags.get("prefect.flow_run_id")
    assert {d.dataset.name for d in tok.inputs.dataset_inputs} >= {"corpus", "pretrain_blocks", "retrieval_blocks"}
    assert any(a.path == "tokenizer" for a in client.list_artifacts(tok.info.run_id))


def test_the_pipeline_flow_plans_with_dvcs_own_planner():
    """`flows.pipeline` keeps no DAG code: `--upto`/`--target`/`--only` are `dvc repro <stage>`,
    `dvc repro --downstream` and `--single-item`, in the order DVC visits the stages."""
    import contextlib

    from flows.pipeline import plan

    with contextlib.chdir(ROOT):
        realm = ["pretrain_realm@refreshed", "pretrain_realm@stale"]  # a foreach group names both arms
        assert plan(upto="pretrain_realm") == ["source_digest", "prepare_corpus", "tokenize", "pretrain_retromae", *realm]
        assert plan(upto="pretrain_realm@stale") == ["source_digest", "prepare_corpus", "tokenize", "pretrain_retromae", realm[1]]
        # an MLM change reruns the MLM fine-tunes and evaluate, nothing of RetroMAE, init or REALM
        sizes = load_params(ROOT / "params.yaml").finetune.train_sizes
        assert plan(target="pretrain_mlm") == ["pretrain_mlm", *(f"finetune_retriever@mlm-{n}" for n in sizes), "evaluate"]
        assert plan(target="tokenize", upto="pretrain_realm") == ["tokenize", "pretrain_retromae", *realm]
        assert plan(only="tokenize") == ["tokenize"]
        assert plan(only="finetune_reader") == ["finetune_reader@bm25", "finetune_reader@realm", "finetune_reader@realm-stale"]
        assert plan()[:2] == ["source_digest", "prepare_corpus"] and plan()[-1] == "evaluate"
        with pytest.raises(ValueError, match="unknown stage"):
            plan(target="nope")


def test_the_pipeline_plans_the_matrix_its_preset_and_overrides_write(tmp_path, monkeypatch):
    """`finetune_retriever`'s matrix items come from params.yaml, so the flow plans after writing the
    preset and overrides: planned before, `--preset small` ran the default's curve points only."""
    import flows.pipeline as fp
    from tests.conftest import make_workspace

    class Planned(Exception):
        pass

    real_plan = fp.plan

    def plan_then_stop(**kw):  # DVC's real plan, then stop before any stage runs
        raise Planned(real_plan(**kw))

    ws = make_workspace(tmp_path / "ws")
    monkeypatch.chdir(ws)
    monkeypatch.setattr(fp, "plan", plan_then_stop)
    sizes = [8, 24, "all"]
    assert load_params(ws / "params.yaml").finetune.train_sizes != sizes
    with pytest.raises(Planned) as planned:
        fp.pipeline.fn(overrides={"finetune.train_sizes": sizes}, only="finetune_retriever")
    starts = load_params(ws / "params.yaml").finetune.retrieval_inits
    assert sorted(planned.value.args[0]) == sorted(f"finetune_retriever@{s}-{n}" for s in starts for n in sizes)


def test_missing_outputs_names_what_a_partial_run_leaves_out(tmp_path):
    """`dvc exp save` refuses a workspace that lacks any output of dvc.yaml, which is the state after
    `--upto pretrain_realm` on a fresh clone (pretrain_mlm never ran): the pipeline names those
    outputs and skips the save instead of failing a run whose stages all succeeded."""
    import contextlib
    import shutil

    from flows.pipeline import missing_outputs

    for f in ("dvc.yaml", "params.yaml"):  # the matrix stages' items come from params.yaml
        shutil.copy(ROOT / f, tmp_path / f)
    subprocess.run([str(Path(sys.executable).parent / "dvc"), "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    spec = dvc_stages(tmp_path)
    declared = {s: _names(spec[s].get("outs")) + _names(spec[s].get("metrics")) + _names(spec[s].get("plots")) for s in spec}
    with contextlib.chdir(tmp_path):
        assert missing_outputs() == {s: d for s, d in declared.items() if d}
        for stage in ("source_digest", "prepare_corpus", "tokenize", "pretrain_retromae", "pretrain_realm@refreshed", "pretrain_realm@stale"):
            for out in map(Path, declared[stage]):
                if out.suffix:  # a file: data/source.json, metrics/<stage>.json, plots/*.csv
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.touch()
                else:
                    out.mkdir(parents=True)
        left = missing_outputs()
        assert {s.partition("@")[0] for s in left} == {"pretrain_mlm", "finetune_retriever", "finetune_reader", "evaluate"}
        assert "finetune_retriever@init-32" in left and "pretrain_realm@stale" not in left
        assert "models/mlm" in left["pretrain_mlm"]


@pytest.mark.slow
def test_matrix_stages_run_through_dvc_each_as_its_own_mlflow_run(tmp_path, shared_prefect_api):
    """`dvc repro --single-item <group>@<item>` runs the item's flow (`--item` / the arm from the
    stage name), which writes that item's outputs only and opens an MLflow run named by the stage."""
    from components.config import load_params
    from tests.conftest import build_data_and_encoders

    ws = make_workspace(tmp_path / "ws")
    build_data_and_encoders(ws, load_params(ws / "params.yaml"), ("retromae/encoder", "init/encoder", "mlm/encoder"))
    (ws / "models/realm").mkdir(parents=True)  # a stand-in dep: the BM25 reader starts from RetroMAE without REALM
    (ws / "models/realm/README").write_text("stand-in\n")
    uri = f"sqlite:///{ws}/mlflow.db"
    env = {**os.environ, "PREFECT_API_URL": shared_prefect_api, "MLFLOW_TRACKING_URI": uri, "RR_PARENT_RUN_ID": ""}
    for stage in ("finetune_retriever@init-all", "finetune_reader@bm25"):
        assert _ran(_repro(ws, env, "--single-item", stage)) == {stage}
    assert (ws / paths.retriever_out("init", "all") / "config.json").exists()
    assert not (ws / paths.retriever_out("mlm", "all")).exists()  # one item, one output
    assert (ws / paths.reader_out("bm25") / "openqa_config.json").exists()
    assert json.loads((ws / paths.stage_metrics("finetune_retriever@init-all")).read_text())["size"] == "all"
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("retro-realm")
    stages = {r.data.tags["dvc.stage"]: r for r in client.search_runs([exp.experiment_id])}
    assert {"finetune_retriever@init-all", "finetune_reader@bm25"} <= set(stages)
    assert all(stages[s].info.status == "FINISHED" for s in ("finetune_retriever@init-all", "finetune_reader@bm25"))
    # evaluate through DVC writes the curve DVC draws: `dvc plots show` loads every plot evaluate wrote
    (ws / "models/realm-stale").mkdir(parents=True)
    (ws / "models/realm-stale/README").write_text("stand-in\n")
    for stage in ("pretrain_retromae", "pretrain_mlm", "pretrain_realm@refreshed", "pretrain_realm@stale"):
        (ws / paths.loss_curve(stage)).parent.mkdir(parents=True, exist_ok=True)  # stand-ins: the pre-training stages' curves
        (ws / paths.loss_curve(stage)).write_text("step,loss\n1,2.0\n")
    assert _ran(_repro(ws, env, "--single-item", "evaluate")) == {"evaluate"}
    curve = (ws / "plots/label_efficiency.csv").read_text().splitlines()
    assert curve[0].startswith("dataset,start,size,questions") and [line.split(",")[1:3] for line in curve[1:]] == [["init", "all"]]
    shown = subprocess.run([str(Path(sys.executable).parent / "dvc"), "plots", "show", "--json"], cwd=ws, env=env,
                           capture_output=True, text=True, timeout=300)
    plots = json.loads(shown.stdout)
    failed = {e["name"] for e in plots.get("errors") or []}
    assert not failed & {"label_efficiency", "label_efficiency_recall", "metrics/eval/label_efficiency.png"}, plots["errors"]
    assert {"label_efficiency", "label_efficiency_recall", "metrics/eval/label_efficiency.png"} <= set(plots["data"])


def test_concurrent_plan_waits_only_for_the_stages_a_stage_needs():
    import contextlib

    from flows.pipeline import plan, upstream_in

    with contextlib.chdir(ROOT):
        stages = plan()
        needs = upstream_in(stages)
    assert needs["prepare_corpus"] == {"source_digest"}
    assert needs["finetune_retriever@init-32"] == {"source_digest", "prepare_corpus", "tokenize", "pretrain_retromae"}
    assert needs["finetune_reader@realm-stale"] >= {"pretrain_realm@stale"} and "pretrain_realm@refreshed" not in needs["finetune_reader@realm-stale"]
    assert "pretrain_realm@refreshed" not in needs["pretrain_realm@stale"]  # the two arms run side by side
    assert needs["evaluate"] == set(stages) - {"evaluate"}
    with contextlib.chdir(ROOT):  # a partial plan: only the stages in it are waited for
        assert upstream_in(["pretrain_mlm", "finetune_retriever@mlm-32"]) == {"pretrain_mlm": set(),
                                                                            "finetune_retriever@mlm-32": {"pretrain_mlm"}}


@pytest.mark.slow
def test_pipeline_concurrency_runs_independent_stages_side_by_side_and_records_them(tmp_path, shared_prefect_api):
    """`--concurrency 2`: the fine-tunes of a group run two at a time (their MLflow runs overlap),
    and each is in dvc.lock afterwards, so `dvc status` calls them up to date."""
    from components.config import load_params
    from tests.conftest import build_data_and_encoders

    ws = make_workspace(tmp_path / "ws", {"finetune.retrieval_inits": ["init", "mlm", "retromae"]})
    build_data_and_encoders(ws, load_params(ws / "params.yaml"), ("retromae/encoder", "init/encoder", "mlm/encoder"))
    uri = f"sqlite:///{ws}/mlflow.db"
    env = {**os.environ, "PREFECT_API_URL": shared_prefect_api, "MLFLOW_TRACKING_URI": uri, "RR_PARENT_RUN_ID": "",
           "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]}
    out = subprocess.run([sys.executable, "-m", "flows.pipeline", "--only", "finetune_retriever", "--concurrency", "2"], cwd=ws,
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    stages = [f"finetune_retriever@{s}-all" for s in ("init", "mlm", "retromae")]
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    assert set(stages) <= set(lock)
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "--json", *stages], cwd=ws, env=env, capture_output=True, text=True)
    assert json.loads(status.stdout or "{}") == {}, status.stdout
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("retro-realm")
    runs = {r.data.tags["dvc.stage"]: r.info for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("dvc.stage") in stages}
    spans = sorted((i.start_time, i.end_time) for i in runs.values())
    assert len(spans) == 3 and spans[1][0] < spans[0][1], spans  # the second started before the first ended
