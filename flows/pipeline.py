"""The whole pipeline as one Prefect flow: set params the way `dvc exp run -S` does, then `dvc repro`,
stage by stage, then `dvc exp save` when params were set.

    python -m flows.pipeline                                   # the README's main job (`make run`)
    python -m flows.pipeline --preset paper                    # params/paper.yaml written into params.yaml (or tiny, small)
    python -m flows.pipeline --set retromae.train.max_steps=200 --name steps200
    prefect deployment run retro-realm/pipeline -p overrides='{"retromae.train.max_steps": 200}'
    prefect deployment run retro-realm/pipeline -p upto=pretrain_realm -p push=true
    prefect deployment run retro-realm/tokenize                # one stage (prefect.yaml)

DVC owns the DAG and the experiments. Overrides and presets are written into params.yaml by DVC's
own `-S` code (flows/set_params.py: comments and layout stay), so `dvc status` and `dvc.lock` see
every value a stage runs with. DVC's planner picks the stages (`plan`), each task runs
`dvc repro --single-item <stage>` (an unchanged stage is skipped by DVC itself), and `dvc exp save`
records the run as an experiment for `dvc exp show` / `dvc metrics diff`. The same run from the shell:
`dvc exp run -S retromae.train.max_steps=200` (no Prefect tasks, no MLflow parent run).
The flow opens the MLflow parent run; every stage process opens its child run under it
(RR_PARENT_RUN_ID). Without PREFECT_API_URL, one local Prefect API is started for the whole run.
When the run includes `evaluate`, its flow run carries the eval table as the Prefect artifacts
`eval-table` / `eval-rows` and the link `mlflow-pipeline-run` to the MLflow parent run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from components.config import load_params
from components.config_file import PARAMS_FILE, parse_overrides
from components.paths import METRICS
from components.tracking import ENV_PARENT, close_run, open_parent_run, prepare_store
from components.tracking_server import tracking_uri
from flows import run_main
from flows._runtime import STAGES, local_prefect_api, prefect_tags
from flows._stage import eval_rows, mlflow_run_url, publish_eval_artifacts
from flows.set_params import apply_param_overrides, preset_overrides, preset_switch
from flows.stage_server import stage_server, stage_server_enabled, stage_server_running


def plan(target: str | None = None, upto: str | None = None, only: str | None = None) -> list[str]:
    """The stages to visit, in the order `dvc repro` visits them (DVC's own planner on dvc.yaml).

    target: it and what follows it (`dvc repro --downstream`); upto: it and what it needs
    (`dvc repro upto`); both: the stages between; only: that stage (`dvc repro --single-item`).
    Each may name one stage (`finetune_retriever@retromae-32`) or a foreach / matrix group
    (`finetune_retriever`: every `finetune_retriever@*`), as `dvc repro` takes either.
    """
    from dvc.repo import Repo
    from dvc.repo.reproduce import plan_repro

    with Repo() as repo:
        graph = repo.index.graph
        stages = repo.index.stages

        def members(name: str) -> list:
            found = [s for s in stages if s.addressing == name or s.addressing.startswith(name + "@")]
            if not found:
                raise ValueError(f"unknown stage {name!r}; stages: {sorted(s.addressing for s in stages)}")
            return found

        picked_only = members(only) if only else None
        for name in (target, upto):
            if name:
                members(name)
        if only and (target or upto):
            raise ValueError("`only` runs one stage; it cannot be combined with `target` or `upto`")
        order = [s.addressing for s in plan_repro(graph)]
        if picked_only is not None:
            return [s for s in order if s in {m.addressing for m in picked_only}]
        picked = set(order)
        if target:
            picked &= {s.addressing for s in plan_repro(graph, members(target), downstream=True)}
        if upto:
            picked &= {s.addressing for s in plan_repro(graph, members(upto))}
    out = [s for s in order if s in picked]
    if not out:
        raise ValueError(f"no stage is both downstream of {target!r} and upstream of {upto!r}")
    return out


def upstream_in(stages: list[str]) -> dict[str, set[str]]:
    """For each of `stages`: the stages among them it needs (DVC's graph, transitively, so a stage
    left out of the plan does not hide an ordering), what `run_concurrently` waits for."""
    import networkx as nx
    from dvc.repo import Repo

    with Repo() as repo:
        graph = repo.index.graph  # edges point from a stage to the stages it depends on
        by_name = {s.addressing: s for s in repo.index.stages}
        wanted = set(stages)
        return {s: {d.addressing for d in nx.descendants(graph, by_name[s])} & wanted for s in stages}


def dvc_env() -> dict[str, str]:
    """The environment of this flow's `dvc` processes: the stages run with this flow's interpreter.

    A worker started as `.venv/bin/prefect worker start` need not have the venv on PATH or
    activated. Each stage's `cmd: scripts/py -m <module>` runs `$RR_PYTHON` first (scripts/py), so
    RR_PYTHON is set to this interpreter unless the user set it; the interpreter's bin/ also goes
    first on PATH, for any tool a stage calls by name.
    """
    env = {"RR_PYTHON": sys.executable, **os.environ}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def _dvc(*args: str) -> tuple[int, list[str]]:
    """Run `dvc ARGS` as `sys.executable -m dvc` (this interpreter's DVC, whatever PATH holds; see
    `dvc_env` for the stages') and stream its output into the Prefect log."""
    logger = get_run_logger()
    logger.info("$ dvc %s", " ".join(args))
    proc = subprocess.Popen([sys.executable, "-m", "dvc", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, env=dvc_env())
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip())
        logger.info("%s", lines[-1])
    return proc.wait(), lines


@task(cache_policy=NO_CACHE, name="dvc-repro-stage", task_run_name="{stage}")
def repro_stage(stage: str, force: bool = False) -> str:
    rc, lines = _dvc("repro", "--single-item", stage, *(["--force"] if force else []))
    if rc != 0:
        raise RuntimeError(f"stage {stage} failed (dvc repro exit {rc}); see the log above")
    return "skipped" if any("didn't change, skipping" in line for line in lines) else "ran"


# DVC takes a repo lock for `repro`, `status` and `commit`: the concurrent path runs the stage
# commands side by side and keeps its own DVC calls one at a time.
_DVC_LOCK = threading.Lock()


@task(cache_policy=NO_CACHE, name="dvc-stage-concurrent", task_run_name="{stage}")
def run_stage_concurrently(stage: str, force: bool = False) -> str:
    """One stage beside others: `dvc status` says whether it is stale, its `cmd` runs outside DVC's
    lock, then `dvc commit` records it in dvc.lock, as `dvc repro --single-item` would."""
    with _DVC_LOCK:
        rc, lines = _dvc("status", "--json", stage)
        stale = force or rc != 0 or stage in json.loads("\n".join(lines) or "{}")
        cmd = _stage_cmd(stage)
    if not stale:
        return "skipped"
    logger = get_run_logger()
    logger.info("$ %s", cmd)
    proc = subprocess.Popen(cmd, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=dvc_env())
    for line in proc.stdout:
        logger.info("%s", line.rstrip())
    if proc.wait() != 0:
        raise RuntimeError(f"stage {stage} failed (exit {proc.returncode}); see the log above")
    with _DVC_LOCK:
        rc, _ = _dvc("commit", "--force", stage)
    if rc != 0:
        raise RuntimeError(f"stage {stage} ran, but `dvc commit {stage}` failed (exit {rc}); run it by hand")
    return "ran"


def _stage_cmd(stage: str) -> str:
    from dvc.repo import Repo

    with Repo() as repo:
        (found,) = [s for s in repo.index.stages if s.addressing == stage]
        return found.cmd


def run_concurrently(stages: list[str], concurrency: int, force: set[str]) -> dict[str, str]:
    """Submit each stage as a Prefect task once every stage it needs has finished, at most
    `concurrency` at a time: independent stages (the fine-tunes, the two REALM arms) run side by
    side. The first failure stops new submissions and is raised when the running ones end."""
    needs = upstream_in(stages)
    result: dict[str, str] = {}
    running: dict[str, Any] = {}
    pending = list(stages)
    failed: BaseException | None = None
    while (pending and failed is None) or running:
        ready = [s for s in pending if needs[s] <= set(result)] if failed is None else []
        for stage in ready[: concurrency - len(running)]:
            pending.remove(stage)
            running[stage] = run_stage_concurrently.submit(stage, force=stage in force)
        done = [s for s, f in running.items() if f.wrapped_future.done()]  # local; `state` asks the API, which lags
        for stage in done:
            future = running.pop(stage)
            try:
                result[stage] = future.result()
            except BaseException as e:  # noqa: BLE001 - let the running stages end first
                failed = failed or e
        if not done:
            time.sleep(0.2)
    if failed is not None:
        raise failed
    return result


@task(cache_policy=NO_CACHE, name="dvc-push", retries=2, retry_delay_seconds=[5, 30])
def dvc_push() -> None:
    """Every output recorded in dvc.lock to the default remote (objects already there are skipped)."""
    rc, _ = _dvc("push")
    if rc != 0:
        raise RuntimeError(f"dvc push failed (exit {rc}); check the default remote (`dvc remote list`, scripts/dvc_remote.sh)")


def missing_outputs() -> dict[str, list[str]]:
    """The outputs (`outs`, `metrics`, `plots`) that dvc.yaml declares and the workspace lacks, by
    stage, as DVC's own index lists them. `dvc exp save` refuses to save while any is missing, which
    is the normal state after a partial run (`upto` / `only`) in a workspace where the other stages
    never ran."""
    from dvc.repo import Repo

    with Repo() as repo:
        missing = {s.addressing: [str(o.def_path) for o in s.outs if not o.exists] for s in repo.index.stages}
    return {stage: gone for stage, gone in missing.items() if gone}


@task(cache_policy=NO_CACHE, name="dvc-exp-save")
def exp_save(name: str | None = None) -> str:
    """Record the workspace (params.yaml, dvc.lock, metrics, plots) as a DVC experiment.

    `-I` adds the committed results even before their first git commit (a fresh clone has none).
    """
    committed = [f for f in ("dvc.lock", "metrics", "plots") if Path(f).exists()]
    rc, lines = _dvc("exp", "save", *(["--name", name, "--force"] if name else []),
                     *(arg for f in committed for arg in ("--include-untracked", f)))
    if rc != 0:
        raise RuntimeError(f"dvc exp save failed (exit {rc}); the stages ran and dvc.lock is written")
    return lines[-1] if lines else ""


def record_lineage(params, parent: str, result: dict[str, str]) -> None:
    """dvc.lock and params.yaml as artifacts of the parent run, the per-stage outcome as a tag.

    A remote run works in a throwaway clone: with `push`, its outputs are on the DVC remote, and
    this dvc.lock is what names them (`mlflow artifacts download -r <parent> -a dvc.lock`, then
    `dvc pull`). Best effort: the stages already succeeded and are tracked.
    """
    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri(params))
        client.set_tag(parent, "rr.stages", json.dumps(result))
        for f in ("dvc.lock", PARAMS_FILE):
            if Path(f).is_file():
                client.log_artifact(parent, f, "lineage")
    except Exception as e:  # noqa: BLE001
        get_run_logger().warning("could not log dvc.lock/params to MLflow run %s: %s", parent, e)


def publish_eval(params, parent: str) -> None:
    """The evaluate stage's table (metrics/eval.json, metrics/eval/results.md), whether DVC ran it
    or found it up to date, as this flow run's Prefect artifacts, linked to the MLflow parent run."""
    table_file, report_file = METRICS / "eval.json", METRICS / "eval" / "results.md"
    if not table_file.is_file():
        return
    try:
        from mlflow import MlflowClient

        uri = tracking_uri(params)
        exp = MlflowClient(uri).get_run(parent).info.experiment_id
        rows = eval_rows(json.loads(table_file.read_text(encoding="utf-8")))
        report = report_file.read_text(encoding="utf-8") if report_file.is_file() else ""
        publish_eval_artifacts(report, rows, mlflow_run_url(uri, exp, parent), "MLflow pipeline run", f"MLflow run {parent} ({uri})")
    except Exception as e:  # noqa: BLE001 - the stages succeeded; their outputs and MLflow runs are there
        get_run_logger().warning("could not publish the eval table as Prefect artifacts: %s: %s", type(e).__name__, e)


@flow(name="retro-realm", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=8))
def pipeline(overrides: dict | None = None, target: str | None = None, only: str | None = None,
             push: bool = False, upto: str | None = None, preset: str | None = None,
             name: str | None = None, concurrency: int = 1, warm_stages: bool = True) -> dict[str, str]:
    """Run the DAG.

    preset:    a params/ preset (`tiny`, `small`, `paper`) written into params.yaml first, as `-S` overrides.
    overrides: dotted params written into params.yaml after it (as `dvc exp run -S`).
    name:      the experiment's name for `dvc exp save` (saved whenever params were set, or named).
    target:    force this stage and rerun everything downstream of it.
    only:      run just this stage (`dvc repro --single-item`): the per-stage deployments.
    push:      `dvc push` after a successful run (remote workers).
    upto:      run this stage and what it depends on, nothing downstream (as `dvc repro <upto>`);
               with `target`, the stages between the two.
    concurrency: stages run at once (1: one `dvc repro --single-item` after another, the laptop
               default); more: stages whose inputs are ready run side by side (`run_concurrently`).
    warm_stages: fork each stage process from one warm process that has the stages' libraries
               imported (flows/stage_server.py; Linux, more than one stage, RR_STAGE_SERVER not off).
    """
    if concurrency < 1 or concurrency > 8:
        raise ValueError(f"concurrency={concurrency}: 1 (one stage at a time) to 8")
    changes = {**(preset_switch(preset) if preset else {}), **(overrides or {})}
    apply_param_overrides(changes)
    # planned after the write: a matrix stage's items come from params.yaml (finetune.train_sizes), so
    # a plan of the file as it was would run the previous preset's curve points
    stages = plan(target=target, upto=upto, only=only)
    params = load_params()
    # prefect_tags() exports the flow run's id, which the stages inherit: before the server copies the environment
    tags = {"rr.overrides": json.dumps(overrides or {}), "rr.preset": preset or "", "rr.target": target or "",
            "rr.only": only or "", "rr.upto": upto or "", "rr.push": str(push).lower(), **prefect_tags()}
    server = contextlib.ExitStack()  # the stage server, closed once the stages are done
    try:
        if warm_stages and len(stages) > 1 and stage_server_enabled() and not stage_server_running():
            # started before the parent run: its ~10 s of imports overlap the run's creation, not the first stages
            server.enter_context(stage_server(dvc_env()))
        parent = open_parent_run(params, tags=tags)
    except BaseException:
        server.close()
        raise
    os.environ[ENV_PARENT] = parent
    status = "FAILED"
    result: dict[str, str] = {}
    try:
        forced = {s for s in stages if target and (s == target or s.startswith(f"{target}@"))}
        with server:
            if concurrency == 1:
                for stage in stages:
                    result[stage] = repro_stage(stage, force=stage in forced)
            else:
                result = run_concurrently(stages, concurrency, forced)
        if changes or name:
            if missing := missing_outputs():
                get_run_logger().warning(
                    "not saved as a DVC experiment: `dvc exp save` needs every output of dvc.yaml, and the "
                    "stages this run did not reach have none yet (%s). The stages ran and dvc.lock records them; "
                    "run the rest of the DAG (or `dvc exp save` once the outputs exist) to save it.",
                    "; ".join(f"{st}: {', '.join(paths)}" for st, paths in missing.items()))
            else:
                exp_save(name)
        if push:
            dvc_push()
        record_lineage(params, parent, result)
        if "evaluate" in result:
            publish_eval(params, parent)
        status = "FINISHED"
        print(f"pipeline finished: {result} (MLflow parent run {parent})")
        return result
    finally:
        close_run(params, parent, status)
        os.environ.pop(ENV_PARENT, None)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="param override (repeatable), like dvc exp run -S")
    ap.add_argument("--preset", help="a params/ preset written into params.yaml first: tiny, small, paper, or a path; default: back to params.yaml as committed")
    ap.add_argument("--name", help="experiment name for dvc exp save (saved whenever params are set)")
    groups = ", ".join(STAGES)
    ap.add_argument("--target", help=f"rerun this stage and what depends on it ({groups}, or one <group>@<item>)")
    ap.add_argument("--only", help="run just this stage, or every stage of a group (if stale)")
    ap.add_argument("--upto", help="run this stage and what it depends on, nothing downstream")
    ap.add_argument("--push", action="store_true", help="dvc push after a successful run")
    ap.add_argument("--concurrency", type=int, default=1, help="stages run at once when their inputs are ready (default 1)")
    ap.add_argument("--no-warm-stages", dest="warm_stages", action="store_false",
                    help="start every stage process cold, not forked from the stage server (flows/stage_server.py)")
    args = ap.parse_args(argv)
    overrides = parse_overrides(args.set) or None
    with contextlib.ExitStack() as early:
        def meanwhile() -> None:  # while the local Prefect API starts (`local_prefect_api`)
            if args.warm_stages and args.only is None and stage_server_enabled():
                early.enter_context(stage_server(dvc_env()))  # its imports; the flow then uses it
            _prepare_tracking(args.preset, overrides)

        with local_prefect_api(meanwhile=meanwhile):
            pipeline(overrides=overrides, target=args.target, only=args.only, push=args.push, upto=args.upto,
                     preset=args.preset, name=args.name, concurrency=args.concurrency, warm_stages=args.warm_stages)


def _prepare_tracking(preset: str | None, overrides: dict | None) -> None:
    """Create the embedded tracking store's schema and experiment ahead of the parent run, unless the
    run's preset or overrides set `tracking.*` (then the parent run does it, with those params). A
    failure here is left to the parent run, which reports it."""
    try:
        keys = {*(overrides or {}), *(preset_overrides(preset) if preset and preset != "default" else {})}
        if not any(k.startswith("tracking.") for k in keys):
            prepare_store(load_params())
    except Exception as e:  # noqa: BLE001 - an early start only
        print(f"tracking store not prepared early ({type(e).__name__}: {e}); the parent run opens it", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)  # without the interpreter's teardown once the run is done (flows.run_main)
