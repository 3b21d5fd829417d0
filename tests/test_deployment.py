"""The Prefect deployment end to end, against the real servers (tests/servers.py):

    S3 (moto) <- MLflow server (sqlite backend, artifacts proxied to s3://retro-realm-mlflow)
              <- DVC remote (s3://retro-realm-dvc/<prefix>, scripts/dvc_remote.sh, .dvc/config.local)
    Prefect server + process worker <- `prefect deploy` from prefect.yaml (RR_WORKDIR, RR_PREFECT_POOL)

    .venv/bin/python -m pytest tests/test_deployment.py -q -m slow

1. `prefect deployment run retro-realm/pipeline -p upto=<UPTO> -p push=true` runs on the worker:
   MLflow has the parent run, one child per stage, REALM's `refresh_index` runs, their artifacts are
   objects in the S3 bucket; `dvc push` put every output in the S3 remote; after deleting the DVC
   cache and the outputs, `dvc pull` brings them back bit-identical and `dvc status` is clean.
2. An override through the deployment (`retromae.train.max_steps`) reruns exactly the stages that
   declare it and their dependents (new MLflow stage runs), never the upstream ones.
3. infra/prefect/prefect.remote.yaml deploys to a docker and a kubernetes pool (made from the job
   templates), and its stored pull steps (git clone, setup, dvc remote, dvc pull) rebuild the pushed
   outputs bit-identically in a fresh directory. Docker/Kubernetes themselves are not exercised.
Fast (not slow): stage selection (`upto`/`target`) against dvc.yaml, and prefect.yaml's structure.

Timing on 2 shared cores: 10.7 min in all at load 8-9 (the whole tiny DAG through the worker 6 min),
14.6 min at load 11 (8 min); RR_DEPLOY_UPTO=pretrain_realm trims it.

UPTO is the last stage whose whole upstream has a flow file in flows/: `evaluate`, i.e. the whole
DAG, now that every stage flow exists; RR_DEPLOY_UPTO=<stage> pins it.

Worker environment: the fixture's worker is started with a scrubbed environment (no MLflow, no AWS),
as a shared worker would be. The deployment hands each flow run what it needs through the job
variable `env` at deploy time: the MLflow URL, the S3 endpoint and the *path* of an AWS shared
credentials file, never a key (checked against the stored deployment).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from components import paths
from tests.conftest import ROOT, TINY, dvc_stages, make_workspace
from tests.servers import _SCRUB, MOTO_KEYS, _tool, http_json


VENV_BIN = str(Path(sys.executable).parent)
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
RUN_TIMEOUT = float(os.environ.get("RR_DEPLOY_RUN_TIMEOUT", 720))

# Artifacts each stage run must carry in MLflow (where the stage is part of the run).
STAGE_ARTIFACTS = {
    "prepare_corpus": {"data_card.json"},
    "tokenize": {"tokenizer", "tokenize_card.json"},
    "pretrain_retromae": {"encoder", "model_card.md", "pretrain_retromae.json"},
    "pretrain_realm@refreshed": {"retriever", "knowledge_augmented_encoder", "index_final", "pretrain_realm.json"},
    "pretrain_realm@stale": {"retriever", "knowledge_augmented_encoder", "index_final", "pretrain_realm_stale.json"},
    "finetune_retriever@retromae-all": {"finetune_retriever_retromae-all.json"},
    "finetune_reader@realm": {"finetune_reader_realm.json"},
    "evaluate": {"eval", "eval.json", "results.md"},
}
TIMINGS: dict[str, float] = {}


def _plan(**kw) -> list[str]:
    """DVC's order of the stages (flows.pipeline.plan): all of them, or those `dvc repro <upto>` visits."""
    from flows.pipeline import plan

    with contextlib.chdir(ROOT):
        return plan(**kw)


_DVC_SPEC = dvc_stages()  # foreach / matrix stages resolved: `<group>@<item>`
# Stages whose cmd is a stage flow (an MLflow stage run, a Prefect flow run, a deployment), and the
# always_changed ones DVC reruns every time (source_digest: a plain module, cheap).
FLOW_GROUPS = {s.partition("@")[0] for s, d in _DVC_SPEC.items() if d["cmd"].startswith("scripts/py -m flows.")}
ALWAYS = {s for s, d in _DVC_SPEC.items() if d.get("always_changed")}


def default_upto() -> str:
    """The last stage in DVC's order whose whole upstream has stage flows (one plan per stage tried:
    each costs ~0.3 s of every collection of this module)."""
    if os.environ.get("RR_DEPLOY_UPTO"):
        return os.environ["RR_DEPLOY_UPTO"]
    def has_flow(stage: str) -> bool:
        group = stage.partition("@")[0]
        return group not in FLOW_GROUPS or (ROOT / "flows" / f"{group}.py").exists()

    return next(s for s in reversed(_plan()) if all(map(has_flow, _plan(upto=s))))


def _in_workspace(stages: list[str]) -> list[str]:
    """`stages` as the deployed workspace has them: this checkout's params.yaml (which `_plan`
    expands the matrix with) may list other training sizes than TINY's, which the workspace fine-tunes
    (each start's items in TINY's order, where the checkout's first item of that start stood)."""
    out: list[str] = []
    for stage in stages:
        group, _, item = stage.partition("@")
        if group != "finetune_retriever":
            out.append(stage)
            continue
        start = paths.retriever_item(item)[0]
        out += [s for s in (f"{group}@{start}-{n}" for n in TINY["finetune.train_sizes"]) if s not in out]
    return out


UPTO = default_upto()
STAGES = _in_workspace(_plan(upto=UPTO))
TRACKED = [s for s in STAGES if s.partition("@")[0] in FLOW_GROUPS]  # the stages with an MLflow child run


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _env(extra: dict | None = None) -> dict[str, str]:
    """A CLI's environment: the developer's shell without server/cloud variables, the venv first."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB and not k.startswith("AWS_")}
    env["PATH"] = VENV_BIN + os.pathsep + env.get("PATH", "")
    return {**env, **(extra or {})}


def _sh(cmd: list[str], cwd: Path, env: dict, timeout: float = 300) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"$ {' '.join(cmd)} -> {out.returncode}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out.stdout + out.stderr


def md5_tree(paths: list[Path], base: Path) -> dict[str, str]:
    out = {}
    for p in paths:
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
        for f in files:
            out[str(f.relative_to(base))] = hashlib.md5(f.read_bytes()).hexdigest()
    return out


def cached_outs(ws: Path) -> dict[str, str]:
    """{out path: md5} of every DVC-cached output recorded in dvc.lock (metrics with cache: false excluded)."""
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    spec = dvc_stages(ws)
    uncached = {list(o)[0] for s in spec.values() for key in ("outs", "metrics", "plots")
                for o in s.get(key, []) if isinstance(o, dict) and not list(o.values())[0].get("cache", True)}
    return {o["path"]: o["md5"] for st in lock.values() for o in st.get("outs", []) if o["path"] not in uncached}


def s3_prefix(run) -> str:
    """Where the tracking server put a run's artifacts in its bucket (`mlflow-artifacts:/<exp>/<run>/artifacts`)."""
    uri = run.info.artifact_uri
    assert uri.startswith("mlflow-artifacts:/"), uri  # proxied: clients never see S3
    return uri[len("mlflow-artifacts:/"):].strip("/") + "/"


def flow_run_logs(api: str, flow_run_id: str, limit: int = 200) -> str:
    """The newest `limit` log lines of a flow run, oldest first (the API pages at most 200 at a time)."""
    logs: list[dict] = []
    while len(logs) < limit:
        page = http_json("POST", f"{api}/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}},
                                                         "sort": "TIMESTAMP_DESC", "offset": len(logs),
                                                         "limit": min(200, limit - len(logs))})
        logs += page
        if len(page) < 200:
            break
    return "\n".join(entry["message"] for entry in reversed(logs))


def deployment_run(dep: "Deployed", params: dict, timeout: float = RUN_TIMEOUT) -> dict:
    """`prefect deployment run retro-realm/pipeline -p ...`, then poll the API until it ends."""
    cmd = [_tool("prefect"), "deployment", "run", "retro-realm/pipeline"]
    for k, v in params.items():
        cmd += ["--param", f"{k}={json.dumps(v)}"]
    t0 = time.monotonic()
    out = _sh(cmd, dep.ws, dep.cli_env, timeout=120)
    m = re.search(r"UUID:\s*([0-9a-f-]{36})", out)
    assert m, out
    run_id = m.group(1)
    deadline = time.monotonic() + timeout
    while True:
        run = http_json("GET", f"{dep.api}/flow_runs/{run_id}")
        if run["state"]["type"] in TERMINAL:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"flow run {run_id} still {run['state']['type']} after {timeout:.0f}s\n"
                                 f"{flow_run_logs(dep.api, run_id)[-6000:]}\nworker:\n{dep.worker_log()}")
        time.sleep(1.0)
    run["wall_seconds"] = time.monotonic() - t0
    assert run["state"]["type"] == "COMPLETED", (
        f"flow run {run_id}: {run['state']['type']} {run['state'].get('message')}\n"
        f"{flow_run_logs(dep.api, run_id)[-8000:]}\nworker:\n{dep.worker_log()}")
    return run


class Deployed:
    """A workspace deployed to the test Prefect server, with its MLflow / S3 / DVC remote."""

    def __init__(self, ws, api, cli_env, job_env, mlflow, s3, dvc_prefix, experiment, worker):
        self.ws, self.api, self.cli_env, self.job_env = ws, api, cli_env, job_env
        self.mlflow, self.s3, self.dvc_prefix, self.experiment = mlflow, s3, dvc_prefix, experiment
        self._worker = worker

    def worker_log(self) -> str:
        return self._worker.log_tail(60)

    def client(self):
        return self.mlflow.client()

    def runs(self) -> list:
        client = self.client()
        exp = client.get_experiment_by_name(self.experiment)
        return client.search_runs([exp.experiment_id], max_results=1000) if exp else []

    def parent_of(self, flow_run_id: str):
        parents = [r for r in self.runs() if r.data.tags.get("rr.kind") == "pipeline"
                   and r.data.tags.get("prefect.flow_run_id") == flow_run_id]
        assert len(parents) == 1, f"{len(parents)} MLflow parent runs tagged with flow run {flow_run_id}"
        return parents[0]

    def stage_runs_by_stage(self) -> dict[str, list]:
        """Stage runs (direct children of a pipeline parent run), grouped by their `dvc.stage` tag."""
        runs = self.runs()
        parents = {r.info.run_id for r in runs if r.data.tags.get("rr.kind") == "pipeline"}
        out: dict[str, list] = {}
        for r in runs:
            if r.data.tags.get("mlflow.parentRunId") in parents:
                out.setdefault(r.data.tags["dvc.stage"], []).append(r)
        return out

    def dvc(self, *args: str, timeout: float = 300) -> str:
        return _sh([sys.executable, "-m", "dvc", *args], self.ws, self.cli_env | self.job_env, timeout=timeout)


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deployed(tmp_path_factory, s3_server, mlflow_server, prefect_server) -> Deployed:
    tag = uuid.uuid4().hex[:8]
    root = tmp_path_factory.mktemp("deployment")
    experiment = f"rr-deploy-{tag}"
    ws = make_workspace(root / "ws", overrides={"tracking.experiment": experiment})

    # Credentials for DVC's S3 access: a shared-credentials file (moto's dummies). Only its path
    # travels (job variables, subprocess env); no key is in params, tags or the deployment.
    creds = root / "aws" / "credentials"
    creds.parent.mkdir()
    creds.write_text("[default]\naws_access_key_id = {AWS_ACCESS_KEY_ID}\naws_secret_access_key = {AWS_SECRET_ACCESS_KEY}\n"
                     .format(**MOTO_KEYS))
    creds.chmod(0o600)
    job_env = {
        "MLFLOW_TRACKING_URI": mlflow_server.url,
        "MLFLOW_S3_ENDPOINT_URL": s3_server.url,  # not needed with proxied artifacts; for s3:// corpora
        "AWS_ENDPOINT_URL": s3_server.url,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_SHARED_CREDENTIALS_FILE": str(creds),
    }
    cli_env = _env({**prefect_server.env, "RR_WORKDIR": str(ws), "RR_PREFECT_POOL": prefect_server.pool})

    dvc_prefix = f"deploy-{tag}"
    out = _sh(["bash", "scripts/dvc_remote.sh", "--check"], ws, {
        **cli_env, **job_env, "DVC": str(Path(VENV_BIN) / "dvc"),
        "RR_DVC_REMOTE_URL": f"s3://{s3_server.buckets['dvc']}/{dvc_prefix}", "RR_S3_ENDPOINT_URL": s3_server.url})
    assert "answers" in out, out
    assert f"endpointurl = {s3_server.url}" in (ws / ".dvc" / "config.local").read_text()
    assert "testing" not in (ws / ".dvc" / "config.local").read_text()  # no key written

    # `pipeline` with the job variables: Prefect 3.9 ignores --job-variable together with --all, so
    # one deployment at a time (the per-stage ones are the same flow with `only`; checked statically).
    t0 = time.monotonic()
    _sh([_tool("prefect"), "--no-prompt", "deploy", "--name", "pipeline", "--job-variable", json.dumps({"env": job_env})],
        ws, cli_env, timeout=300)
    TIMINGS["deploy_pipeline_s"] = round(time.monotonic() - t0, 1)

    api = prefect_server.api_url
    dep = http_json("GET", f"{api}/deployments/name/retro-realm/pipeline")
    assert dep["work_pool_name"] == prefect_server.pool
    assert dep["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ws)}}]
    assert dep["job_variables"]["env"] == job_env
    assert dep["parameter_openapi_schema"]["properties"].keys() >= {"overrides", "target", "only", "upto", "push"}
    stored = json.dumps(http_json("POST", f"{api}/deployments/filter", {}))
    assert MOTO_KEYS["AWS_SECRET_ACCESS_KEY"] not in stored  # credentials never reach Prefect's DB

    return Deployed(ws, api, cli_env, job_env, mlflow_server, s3_server, dvc_prefix, experiment, prefect_server.worker)


@pytest.fixture(scope="module")
def first_run(deployed) -> dict:
    """The pipeline up to UPTO through the deployment, with `dvc push` (once per module)."""
    run = deployment_run(deployed, {"upto": UPTO, "push": True})
    TIMINGS["first_run_wall_s"] = round(run["wall_seconds"], 1)
    TIMINGS["first_run_total_run_time_s"] = round(run["total_run_time"], 1)
    ws = deployed.ws
    run["outs"] = cached_outs(ws)
    run["md5"] = md5_tree([ws / p for p in run["outs"]], ws)
    # What a user does after a run: commit dvc.lock (a remote clone pulls what it names).
    _sh(["git", "add", "dvc.lock"], ws, deployed.cli_env)
    _sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "dvc.lock after the first run"], ws, deployed.cli_env)
    return run


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
def test_stage_selection_follows_dvc_yaml():
    """`upto` = what `dvc repro <stage>` runs; `target` = the stage and its downstream (fast, no servers)."""
    from flows.pipeline import plan

    order = _plan()
    with contextlib.chdir(ROOT):
        assert plan(upto="pretrain_realm") == [*sorted(ALWAYS), "prepare_corpus", "tokenize", "pretrain_retromae",
                                               "pretrain_realm@refreshed", "pretrain_realm@stale"]
        assert plan(upto="prepare_corpus") == [*sorted(ALWAYS), "prepare_corpus"]
        assert plan(upto=order[-1]) == order  # evaluate reads every model
        mlm_ft = [s for s in order if s.startswith("finetune_retriever@mlm-")]
        assert mlm_ft and plan(target="pretrain_mlm") == ["pretrain_mlm", *mlm_ft, "evaluate"]
        assert set(plan(target="tokenize")) == set(order) - {"prepare_corpus"} - ALWAYS


def test_prefect_yaml_deploys_one_pipeline_flow_per_stage():
    """prefect.yaml (static): `pipeline` plus one deployment per dvc.yaml stage, all the same flow,
    on the templated process pool, working in RR_WORKDIR."""
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    order = _plan()
    deps = {d["name"]: d for d in spec["deployments"]}
    assert set(deps) == {"pipeline", *(FLOW_GROUPS & {s.partition("@")[0] for s in order})}  # a group: one deployment
    for name, d in deps.items():
        assert d["entrypoint"] == "flows/pipeline.py:pipeline" and d["concurrency_limit"] == 1
        assert d["work_pool"]["name"] == "{{ $RR_PREFECT_POOL }}"
        assert d["parameters"] == ({} if name == "pipeline" else {"only": name})
    assert spec["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $RR_WORKDIR }}"}}]
    # one workspace, one run at a time: every deployment on the queue the build step limits to 1
    assert {d["work_pool"]["work_queue_name"] for d in deps.values()} == {"retro-realm-workspace"}
    assert spec["build"] == [{"flows._runtime.workspace_queue": {"pool": "{{ $RR_PREFECT_POOL }}",
                                                                 "name": "retro-realm-workspace", "limit": 1}}]


# Logged models each stage run outputs (finetune's depend on its params: added at check time).
STAGE_MODELS = {"pretrain_retromae": {"retromae-encoder": "transformers", "init-encoder": "transformers"},
                "pretrain_mlm": {"mlm-encoder": "transformers"},
                "pretrain_realm@refreshed": {"realm-retriever": "sentence_transformers",
                                             "realm-knowledge-augmented-encoder": "transformers"},
                "pretrain_realm@stale": {"realm-stale-retriever": "sentence_transformers",
                                         "realm-stale-knowledge-augmented-encoder": "transformers"}}


def check_models_logs_and_artifacts(deployed: Deployed, parent, by_stage: dict, flow_run_id: str) -> None:
    """Issue 17 on a real run: logged models with flavors and the alias; eval metrics on models;
    system metrics; the index references of refresh runs; progress lines in the stage flow-run
    logs; the eval table and MLflow link as Prefect artifacts; progress artifacts."""
    import mlflow

    from components.config import load_params

    client = deployed.client()
    params = load_params(deployed.ws / "params.yaml")
    exp = client.get_experiment_by_name(deployed.experiment)
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"  # the UI's training view
    mlflow.set_tracking_uri(deployed.mlflow.url)

    wanted = {s: dict(m) for s, m in STAGE_MODELS.items() if s in by_stage}
    readers: list[str] = []
    ft = params.finetune
    top = ft.largest_size()
    for n in ft.retrieval_inits:  # the largest size's bi-encoder is the logged ft-<start>-retriever
        if f"finetune_retriever@{n}-{top}" in by_stage:
            wanted[f"finetune_retriever@{n}-{top}"] = {f"ft-{n}-retriever": "sentence_transformers"}
    for s in ft.qa_systems:  # the open-QA readers are pyfunc models (question + context -> span)
        if f"finetune_reader@{s}" in by_stage and (deployed.ws / paths.reader_out(s) / "reader").is_dir():
            readers.append(f"qa-{s}-reader")
            wanted[f"finetune_reader@{s}"] = {f"qa-{s}-reader": "python_function"}
    assert readers or not any(s.startswith("finetune_reader@") for s in by_stage), ft.qa_systems
    models = {m.name: m for m in client.search_logged_models([exp.experiment_id], max_results=1000)
              if m.tags.get("rr.pipeline_run") == parent.info.run_id}
    for stage, names in wanted.items():
        outputs = {o.model_id for o in client.get_run(by_stage[stage].info.run_id).outputs.model_outputs}
        for name, flavor in names.items():
            assert name in models, (name, sorted(models))
            assert models[name].source_run_id == by_stage[stage].info.run_id and models[name].model_id in outputs
            assert flavor in mlflow.models.get_model_info(f"models:/{models[name].model_id}").flavors, name
        assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(by_stage[stage].data.metrics)

    if f"finetune_retriever@{params.tracking.registry_start}-{top}" in by_stage:  # the alias follows this run's retriever
        t = params.tracking
        mv = client.get_model_version_by_alias(t.registry_name, t.registry_alias)
        ft_id = models[f"ft-{t.registry_start}-retriever"].model_id
        assert ft_id in (mv.model_id, mv.source.removeprefix("models:/")), (mv.source, ft_id)
        loaded = mlflow.sentence_transformers.load_model(f"models:/{t.registry_name}@{t.registry_alias}")
        from sentence_transformers import SentenceTransformer

        texts = ["who founded the city", "a river"]
        local = SentenceTransformer(str(deployed.ws / paths.retriever_out(t.registry_start, top)), device="cpu")
        assert abs(loaded.encode(texts) - local.encode(texts)).max() < 1e-5
        import pandas as pd

        context = "Aldmoor was founded by Kessa Varn on the north bank of the river."
        out = mlflow.pyfunc.load_model(f"models:/{models[readers[0]].model_id}").predict(
            pd.DataFrame({"question": ["who founded aldmoor?"], "context": [context]}))
        assert out.iloc[0]["answer"] == context[out.iloc[0]["start"]:out.iloc[0]["end"]] != "", out
    if "evaluate" in by_stage:
        ev_id = by_stage["evaluate"].info.run_id
        table = json.loads((deployed.ws / paths.METRICS / "eval.json").read_text())
        systems = {s for rows in table.values() if isinstance(rows, dict) for s in rows}
        measured = [r for r in readers if f"qa:{r.removeprefix('qa-').removesuffix('-reader')}" in systems]
        assert measured or not readers, (readers, sorted(systems))
        for name in ("retromae-encoder", f"ft-{params.tracking.registry_start}-retriever", *measured):
            metrics = client.get_logged_model(models[name].model_id).metrics
            assert any(m.run_id == ev_id for m in metrics), name  # beside its own training run's metrics
    if "pretrain_realm@refreshed" in by_stage:
        refreshes = [r for r in deployed.runs() if r.data.tags.get("mlflow.parentRunId") == by_stage["pretrain_realm@refreshed"].info.run_id
                     and r.data.tags.get("rr.kind") == "refresh_index"]
        with_refs = [r for r in refreshes if r.data.tags.get("rr.index.sha256")]
        assert refreshes and len(with_refs) == len(refreshes)  # every index version is referenced on its run
        for r in with_refs:
            assert {"rr.index.uri", "rr.index.bytes", "rr.index.blocks"} <= set(r.data.tags)

    # -- Prefect: every stage's flow run logs its progress lines; the artifacts -------------------
    api = deployed.api
    since = http_json("GET", f"{api}/flow_runs/{flow_run_id}")["start_time"]
    runs = http_json("POST", f"{api}/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 200})
    flows_ = {f["id"]: f["name"] for f in http_json("POST", f"{api}/flows/filter", {})}
    by_flow = {}  # the stage flow runs of this pipeline run (started after it), newest first
    for r in runs:
        if r["state"]["type"] == "COMPLETED" and (r["start_time"] or "") >= since:
            by_flow.setdefault(flows_[r["flow_id"]], r)
    for stage in ("pretrain_retromae", "pretrain_mlm", "pretrain_realm@refreshed", f"finetune_retriever@retromae-{top}"):
        if stage in by_stage:  # a group's stages share one flow name: its newest run
            logs = flow_run_logs(api, by_flow[stage.partition("@")[0]]["id"], limit=2000)
            assert re.search(r"step \d+/\d+ \(\d+%\) loss \S+ (tokens/s \d+ )?eta ", logs), (stage, logs[-3000:])
            arts = http_json("POST", f"{api}/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [by_flow[stage.partition("@")[0]]["id"]]}}})
            assert any(a["type"] == "progress" and float(a["data"]) == 100.0 for a in arts), (stage, arts)
    if "evaluate" in by_stage:  # on the pipeline's own flow run
        keys = {a["key"]: a for a in http_json("POST", f"{api}/artifacts/filter", {"artifacts": {
            "key": {"any_": ["eval-table", "eval-rows", "mlflow-pipeline-run"]}, "flow_run_id": {"any_": [flow_run_id]}}})}
        assert {"eval-table", "eval-rows", "mlflow-pipeline-run"} <= set(keys), sorted(keys)
        assert "|" in keys["eval-table"]["data"] and parent.info.run_id in keys["mlflow-pipeline-run"]["data"]


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.timeout(1800)  # carries the servers' start and the whole DAG's first run (~10 min at load 11)
def test_deployment_runs_pipeline_tracks_in_mlflow_s3_and_round_trips_dvc_remote(deployed, first_run):
    client, ws = deployed.client(), deployed.ws
    s3 = deployed.s3.client()

    # -- MLflow: parent run -> one child per stage -> REALM's refresh_index runs -------------------
    parent = deployed.parent_of(first_run["id"])
    assert parent.info.status == "FINISHED"
    assert json.loads(parent.data.tags["rr.stages"]) == {s: "ran" for s in STAGES}
    assert "lineage" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    lock = s3.get_object(Bucket=deployed.s3.buckets["mlflow"], Key=s3_prefix(parent) + "lineage/dvc.lock")["Body"].read()
    assert lock == (ws / "dvc.lock").read_bytes()  # the lock that names the pushed outputs, in S3 via MLflow
    children = [r for r in deployed.runs() if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    by_stage = {r.data.tags["dvc.stage"]: r for r in children}
    assert sorted(by_stage) == sorted(TRACKED) and len(children) == len(TRACKED), sorted(by_stage)
    for stage, run in by_stage.items():
        assert run.info.status == "FINISHED", (stage, run.info.status)
        assert run.data.tags.get("prefect.flow_run_id"), stage  # each stage is its own Prefect flow run
        arts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert STAGE_ARTIFACTS.get(stage, set()) <= arts and arts, (stage, arts)
    # the worker's pipeline run forks its stage processes from its stage server once that is up
    # (flows/stage_server.py): the last stage starts long after the server's imports are done
    processes = {stage: run.data.tags.get("rr.stage_process") for stage, run in by_stage.items()}
    assert set(processes.values()) <= {"forked", "cold"} and processes[TRACKED[-1]] == "forked", processes

    if "pretrain_realm@refreshed" in by_stage:
        realm = by_stage["pretrain_realm@refreshed"]
        refreshes = [r for r in deployed.runs() if r.data.tags.get("mlflow.parentRunId") == realm.info.run_id]
        assert len(refreshes) >= 2, "expected at least the initial and the final index refresh"
        reasons = {r.data.tags.get("rr.refresh_reason") for r in refreshes}
        assert {"initial", "final"} <= reasons, reasons
        for r in refreshes:
            assert r.data.tags.get("rr.kind") == "refresh_index" and r.info.status == "FINISHED"
            assert r.data.tags.get("rr.index_version") and r.data.tags.get("prefect.flow_run_id")
            assert {"refresh_seconds", "index_size"} <= set(r.data.metrics)

    check_models_logs_and_artifacts(deployed, parent, by_stage, first_run["id"])

    # -- MLflow artifacts are objects in the S3 bucket (proxied by the tracking server) -----------
    bucket = deployed.s3.buckets["mlflow"]
    for stage, run in by_stage.items():
        prefix = s3_prefix(run)
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])}
        assert keys, f"{stage}: no objects under s3://{bucket}/{prefix}"
        if stage == "tokenize":  # byte-identical to the output file it was logged from
            local = ws / paths.TOKENS / "tokenize_card.json"
            body = s3.get_object(Bucket=bucket, Key=prefix + "tokenize_card.json")["Body"].read()
            assert body == local.read_bytes()

    # -- dvc push: every cached output (each file and each .dir manifest) is in the S3 remote -----
    outs = cached_outs(ws)
    assert {str(paths.CORPUS), str(paths.TOKENS)} <= set(outs), outs
    remote = {o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=deployed.s3.buckets["dvc"], Prefix=deployed.dvc_prefix + "/") for o in page.get("Contents", [])}
    cache = ws / ".dvc" / "cache" / "files" / "md5"
    wanted = set()
    for md5 in outs.values():
        wanted.add(md5)
        if md5.endswith(".dir"):
            wanted |= {e["md5"] for e in json.loads((cache / md5[:2] / md5[2:]).read_text())}
    missing = {m for m in wanted if f"{deployed.dvc_prefix}/files/md5/{m[:2]}/{m[2:]}" not in remote}
    assert not missing, f"{len(missing)} of {len(wanted)} objects not pushed"
    assert "in sync" in deployed.dvc("status", "--cloud")

    # -- dvc pull after losing the cache and the outputs: bit-identical --------------------------
    out_paths = [ws / p for p in outs]
    before = md5_tree(out_paths, ws)
    assert before == first_run["md5"]
    shutil.rmtree(ws / ".dvc" / "cache")
    for p in out_paths:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    t0 = time.monotonic()
    deployed.dvc("pull", "--allow-missing")  # stages that never ran (finetune, ...) have nothing to pull
    TIMINGS["dvc_pull_s"] = round(time.monotonic() - t0, 1)
    after = md5_tree(out_paths, ws)
    assert after == before, sorted(set(before.items()) ^ set(after.items()))[:10]
    # the pulled outputs match dvc.lock (source_digest is "always changed" by design: it re-reads the corpus)
    assert "up to date" in deployed.dvc("status", *[s for s in STAGES if s != "source_digest"])
    print(f"\n[deployment] upto={UPTO} stages={STAGES} timings={TIMINGS}")


@pytest.mark.slow
@pytest.mark.servers
def test_override_through_deployment_reruns_only_dependent_stages(deployed, first_run):
    """`retromae.train.max_steps` is declared by pretrain_retromae (and pretrain_mlm); pretrain_realm
    reads models/retromae. prepare_corpus and tokenize must be skipped by DVC (no new MLflow run)."""
    key, upto = "retromae.train.max_steps", "pretrain_realm"
    from flows.pipeline import plan

    with contextlib.chdir(ROOT):
        needed = plan(upto=upto)  # a group: both REALM arms and what they need
        dependents = set(plan(target="pretrain_retromae")) & set(needed)
    upstream = set(needed) - dependents - ALWAYS
    assert dependents == {"pretrain_retromae", "pretrain_realm@refreshed", "pretrain_realm@stale"} and upstream == {"prepare_corpus", "tokenize"}

    old_value = yaml.safe_load((deployed.ws / "params.yaml").read_text())["retromae"]["train"]["max_steps"]
    lock_before = yaml.safe_load((deployed.ws / "dvc.lock").read_text())["stages"]
    counts_before = {s: len(r) for s, r in deployed.stage_runs_by_stage().items()}

    run = deployment_run(deployed, {"overrides": {key: old_value + 2}, "upto": upto})
    TIMINGS["override_run_wall_s"] = round(run["wall_seconds"], 1)

    assert yaml.safe_load((deployed.ws / "params.yaml").read_text())["retromae"]["train"]["max_steps"] == old_value + 2
    parent = deployed.parent_of(run["id"])
    assert json.loads(parent.data.tags["rr.overrides"]) == {key: old_value + 2}
    runs_after = deployed.stage_runs_by_stage()
    new = {s: len(runs_after.get(s, [])) - counts_before.get(s, 0) for s in set(runs_after) | set(counts_before)}
    assert {s for s, n in new.items() if n} == dependents and all(new[s] == 1 for s in dependents), new
    for s in dependents:
        latest = max(runs_after[s], key=lambda r: r.info.start_time)
        assert latest.data.tags["mlflow.parentRunId"] == parent.info.run_id
    retromae = max(runs_after["pretrain_retromae"], key=lambda r: r.info.start_time)
    assert retromae.data.params["retromae.train.max_steps"] == str(old_value + 2)

    lock_after = yaml.safe_load((deployed.ws / "dvc.lock").read_text())["stages"]
    for s in upstream:
        assert lock_after[s] == lock_before[s], s
    for s in dependents:
        assert lock_after[s] != lock_before[s], s
    # What `dvc repro --single-item` reported per stage (the flow's result, tagged on the parent run).
    assert json.loads(parent.data.tags["rr.stages"]) == {s: "skipped" if s in upstream else "ran" for s in needed}  # ALWAYS: ran
    print(f"\n[deployment] override {key}: new stage runs {new}; timings={TIMINGS}")


@pytest.mark.slow
@pytest.mark.servers
def test_remote_deployments_register_on_gpu_pools_and_their_pull_steps_restore_outputs(deployed, first_run, tmp_path):
    """infra/prefect/prefect.remote.yaml, short of a Docker engine or a cluster: it deploys to a docker
    and a kubernetes pool built from infra/prefect/*-job-template.*, with no secret in the stored
    deployments; then its pull steps, run as a flow run would run them (git_clone of the workspace,
    the setup/remote/pull shell step), give a clone whose outputs are bit-identical to the pushed ones."""
    api, ws, tag = deployed.api, deployed.ws, uuid.uuid4().hex[:6]
    templates = {"docker": json.loads((ws / "infra/prefect/docker-gpu-job-template.json").read_text()),
                 "kubernetes": yaml.safe_load((ws / "infra/prefect/k8s-gpu-job-template.yaml").read_text())}
    pools = {kind: f"rr-test-{kind}-{tag}" for kind in templates}
    for kind, tmpl in templates.items():
        http_json("POST", f"{api}/work_pools/", {"name": pools[kind], "type": kind, "base_job_template": tmpl})

    branch = _sh(["git", "rev-parse", "--abbrev-ref", "HEAD"], ws, deployed.cli_env).strip()
    deploy_env = {**deployed.cli_env, "RR_GIT_REPO": f"file://{ws}", "RR_GIT_BRANCH": branch,
                  "RR_DOCKER_POOL": pools["docker"], "RR_K8S_POOL": pools["kubernetes"], "RR_IMAGE": "retro-realm-gpu:test",
                  "RR_MLFLOW_URI": deployed.mlflow.url, "RR_S3_ENDPOINT_URL": deployed.s3.url,
                  "RR_DVC_REMOTE_URL": f"s3://{deployed.s3.buckets['dvc']}/{deployed.dvc_prefix}"}
    t0 = time.monotonic()
    _sh([_tool("prefect"), "--no-prompt", "deploy", "--prefect-file", "infra/prefect/prefect.remote.yaml", "--all"],
        ws, deploy_env, timeout=300)
    TIMINGS["deploy_remote_s"] = round(time.monotonic() - t0, 1)

    deps = {d["name"]: d for d in http_json("POST", f"{api}/deployments/filter", {})}
    remote_yaml = yaml.safe_load((ws / "infra/prefect/prefect.remote.yaml").read_text())
    for spec in remote_yaml["deployments"]:
        d = deps[spec["name"]]
        kind = "docker" if d["work_pool_name"] == pools["docker"] else "kubernetes"
        assert d["work_pool_name"] == pools[kind] and d["parameters"]["push"] is True
        assert set(d["job_variables"]) <= set(templates[kind]["variables"]["properties"]), d["job_variables"]
        assert d["job_variables"]["image"] == "retro-realm-gpu:test"
        assert d["job_variables"]["env"]["MLFLOW_TRACKING_URI"] == deployed.mlflow.url
        assert "{{ $" not in json.dumps(d["job_variables"]) + json.dumps(d["pull_steps"])  # every $VAR resolved at deploy
        assert not re.search(r"(?i)secret_access_key|aws_access_key_id|password|token\b", json.dumps(d["job_variables"]))
    assert deps["pipeline-gpu"]["job_variables"]["gpu_count"] == -1
    assert deps["pipeline-k8s"]["job_variables"]["secret_name"]

    # The pull steps of the stored deployment, in a fresh directory, with the job's env (the image's
    # venv being this venv, the k8s Secret being the credentials file).
    d = deps["pipeline-k8s"]
    runner = tmp_path / "flow-run"
    runner.mkdir()
    env = {**deployed.cli_env, **d["job_variables"]["env"], "RR_IMAGE_VENV": sys.prefix,
           "AWS_SHARED_CREDENTIALS_FILE": deployed.job_env["AWS_SHARED_CREDENTIALS_FILE"], "AWS_DEFAULT_REGION": "us-east-1"}
    code = ("import asyncio, json, sys\n"
            "from prefect.deployments.steps.core import run_steps\n"
            "out = asyncio.run(run_steps(json.loads(sys.argv[1])))\n"
            "print('DIRECTORY=' + out['directory'])\n")
    t0 = time.monotonic()
    out = _sh([sys.executable, "-c", code, json.dumps(d["pull_steps"])], runner, env, timeout=300)
    TIMINGS["remote_pull_steps_s"] = round(time.monotonic() - t0, 1)
    clone = runner / re.search(r"^DIRECTORY=(.+)$", out, re.M).group(1)  # relative to the flow run's cwd
    assert clone.parent == runner and (clone / ".venv").resolve() == Path(sys.prefix).resolve()
    assert "endpointurl" in (clone / ".dvc/config.local").read_text()
    assert md5_tree([clone / p for p in first_run["outs"]], clone) == first_run["md5"]
    print(f"\n[deployment] remote: {sorted(s['name'] for s in remote_yaml['deployments'])}; timings={TIMINGS}")


QUEUE_PROBE = '''
import time
from pathlib import Path

from prefect import flow


@flow(name="rr-queue-probe", persist_result=False)
def hold(release: str, timeout: float = 600.0) -> str:
    """Holds the queue's slot until the file `release` exists."""
    deadline = time.monotonic() + timeout
    while not Path(release).exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    return "released"
'''


def _states(api: str, flow_run_id: str) -> list[tuple[str, str]]:
    """A flow run's state history: (type, timestamp) oldest first."""
    states = http_json("GET", f"{api}/flow_run_states/?flow_run_id={flow_run_id}")
    return sorted(((st["type"], st["timestamp"]) for st in states), key=lambda t: t[1])


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.timeout(1200)
def test_a_second_run_waits_for_the_workspace_queue_slot(prefect_server, tmp_path):
    """prefect.yaml's build step makes the workspace queue (concurrency 1); two runs of a stub flow
    deployed on such a queue (the worker of tests/servers.py): while the first holds the slot, the
    second is never Running (it stays Scheduled: the worker is not handed it); it starts only once
    the first has finished. A stub instead of the pipeline: the queue is what is being tested."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows._runtime import workspace_queue

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    step = spec["build"][0]["flows._runtime.workspace_queue"]
    assert step["limit"] == 1 and spec["definitions"]["work_pool"]["work_queue_name"] == step["name"]
    api, pool = prefect_server.api_url, prefect_server.pool
    queue = f"{step['name']}-probe-{uuid.uuid4().hex[:6]}"  # the same config, its own queue (no other test's runs on it)
    with temporary_settings({PREFECT_API_URL: api}):
        assert workspace_queue(pool, queue, step["limit"]) == {"work_queue": queue}
    assert http_json("POST", f"{api}/work_pools/{pool}/queues/filter", {"work_queues": {"name": {"any_": [queue]}}}
                     )[0]["concurrency_limit"] == 1

    (tmp_path / "queue_probe.py").write_text(QUEUE_PROBE)
    flow_id = http_json("POST", f"{api}/flows/", {"name": "rr-queue-probe"})["id"]
    dep = http_json("POST", f"{api}/deployments/", {
        "name": f"probe-{queue}", "flow_id": flow_id, "work_pool_name": pool, "work_queue_name": queue,
        "entrypoint": "queue_probe.py:hold", "enforce_parameter_schema": False,
        "pull_steps": [{"prefect.deployments.steps.set_working_directory": {"directory": str(tmp_path)}}]})
    release = {i: tmp_path / f"release-{i}" for i in (0, 1)}
    runs = [http_json("POST", f"{api}/deployments/{dep['id']}/create_flow_run", {"parameters": {"release": str(release[i])}})["id"]
            for i in (0, 1)]

    def state(run_id: str) -> str:
        return http_json("GET", f"{api}/flow_runs/{run_id}")["state"]["type"]

    def wait(pred, what: str, timeout: float = RUN_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < deadline, f"{what}: {[state(r) for r in runs]}\nworker:\n{prefect_server.worker.log_tail(40)}"
            time.sleep(1.0)

    wait(lambda: "RUNNING" in [state(r) for r in runs], "no run started")
    first = next(r for r in runs if state(r) == "RUNNING")
    second = runs[1 - runs.index(first)]
    # two and a half worker polls while the first holds the slot: the second is not handed out
    t_end = time.monotonic() + 2.5 * (prefect_server.worker_query_seconds or 10.0)
    while time.monotonic() < t_end:
        assert state(second) in {"SCHEDULED", "PENDING"}, state(second)
        time.sleep(1.0)
    release[runs.index(first)].touch()
    wait(lambda: state(first) == "COMPLETED", "first run did not complete")
    release[runs.index(second)].touch()
    wait(lambda: state(second) in TERMINAL, "second run did not finish")
    assert state(second) == "COMPLETED"
    first_done = max(t for typ, t in _states(api, first) if typ == "COMPLETED")
    second_ran = min(t for typ, t in _states(api, second) if typ == "RUNNING")
    assert second_ran >= first_done, (_states(api, first), _states(api, second))
