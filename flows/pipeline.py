"""The whole pipeline as one Prefect flow: apply param overrides, then `dvc repro`, stage by stage.

    python -m flows.pipeline                                   # the README's main job
    python -m flows.pipeline --set retromae.train.max_steps=200 --target pretrain_retromae
    prefect deployment run retro-realm/pipeline -p overrides='{"retromae.train.max_steps": 200}'
    prefect deployment run retro-realm/pipeline -p upto=pretrain_realm -p push=true
    prefect deployment run retro-realm/tokenize                # one stage (prefect.yaml)

DVC owns the DAG: each task runs `dvc repro --single-item <stage>`, so a stage whose params, code and
inputs are unchanged is skipped by DVC itself, and `dvc.lock` stays true. The flow opens the
MLflow parent run; every stage process opens its child run under it (RR_PARENT_RUN_ID). Without
PREFECT_API_URL, one local Prefect API is started for the whole run instead of one per stage.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from components.config import PARAMS_FILE, apply_overrides, load_params
from components.io import write_text_atomic
from components.tracking import ENV_PARENT, close_run, open_parent_run, tracking_uri
from flows._runtime import STAGES, local_prefect_api, prefect_tags


def dag_order() -> list[str]:
    """Stages in dvc.yaml order (dvc.yaml lists them topologically)."""
    stages = yaml.safe_load(Path("dvc.yaml").read_text())["stages"]
    return [s for s in stages]


def _paths(entries) -> set[str]:
    return {(list(e)[0] if isinstance(e, dict) else e).rstrip("/") for e in entries or []}


def _overlap(a: str, b: str) -> bool:
    """Same path, or one inside the other (a dep on `models/retromae/encoder` reads `models/retromae`)."""
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def _edges(order: list[str]) -> dict[str, set[str]]:
    """stage -> the stages whose outputs it reads (dvc.yaml deps vs outs)."""
    spec = yaml.safe_load(Path("dvc.yaml").read_text())["stages"]
    outs = {s: _paths(spec[s].get("outs")) for s in order}
    return {s: {u for u in order if u != s and any(_overlap(d, o) for d in _paths(spec[s].get("deps")) for o in outs[u])}
            for s in order}


def downstream_of(target: str, order: list[str]) -> list[str]:
    """`target` and every stage that (transitively) depends on its outputs."""
    edges, picked = _edges(order), {target}
    for s in order:  # topological order: one pass suffices
        if edges[s] & picked:
            picked.add(s)
    return [s for s in order if s in picked]


def upstream_of(stage: str, order: list[str]) -> list[str]:
    """`stage` and every stage it (transitively) depends on: what `dvc repro <stage>` would run."""
    edges, picked = _edges(order), {stage}
    for s in reversed(order):
        if s in picked:
            picked |= edges[s]
    return [s for s in order if s in picked]


def apply_param_overrides(overrides: dict | None, path: str = PARAMS_FILE) -> bool:
    """Write dotted overrides into params.yaml, as `dvc exp run -S` does. Validated before writing."""
    if not overrides:
        return False
    text = Path(path).read_text(encoding="utf-8")
    header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    raw = apply_overrides(yaml.safe_load(text), overrides)
    load_params(path, overrides=overrides)  # raises ParamsError naming the key if invalid
    write_text_atomic(path, header + yaml.safe_dump(raw, sort_keys=False, width=110))
    return True


def _dvc(*args: str) -> tuple[int, list[str]]:
    """Run `dvc ARGS` with this interpreter and stream its output into the Prefect log.

    A worker started as `.venv/bin/prefect worker start` need not have the venv on PATH: DVC runs
    as `sys.executable -m dvc`, and the venv's bin/ goes first on PATH so that each stage's
    `cmd: python -m flows.<stage>` runs with the same interpreter (and packages) as this flow.
    """
    logger = get_run_logger()
    env = os.environ.copy()
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    logger.info("$ dvc %s", " ".join(args))
    proc = subprocess.Popen([sys.executable, "-m", "dvc", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip())
        logger.info("%s", lines[-1])
    return proc.wait(), lines


@task(cache_policy=NO_CACHE, name="dvc-repro-stage")
def repro_stage(stage: str, force: bool = False) -> str:
    rc, lines = _dvc("repro", "--single-item", stage, *(["--force"] if force else []))
    if rc != 0:
        raise RuntimeError(f"stage {stage} failed (dvc repro exit {rc}); see the log above")
    return "skipped" if any("didn't change, skipping" in line for line in lines) else "ran"


@task(cache_policy=NO_CACHE, name="dvc-push", retries=2, retry_delay_seconds=[5, 30])
def dvc_push() -> None:
    """Every output recorded in dvc.lock to the default remote (objects already there are skipped)."""
    rc, _ = _dvc("push")
    if rc != 0:
        raise RuntimeError(f"dvc push failed (exit {rc}); check the default remote (`dvc remote list`, scripts/dvc_remote.sh)")


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


@flow(name="retro-realm", log_prints=True)
def pipeline(overrides: dict | None = None, target: str | None = None, only: str | None = None,
             push: bool = False, upto: str | None = None) -> dict[str, str]:
    """Run the DAG.

    overrides: dotted params written into params.yaml first (as `dvc exp run -S`).
    target:    force this stage and rerun everything downstream of it.
    only:      run just this stage (`dvc repro --single-item`): the per-stage deployments.
    push:      `dvc push` after a successful run (remote workers).
    upto:      run this stage and what it depends on, nothing downstream (as `dvc repro <upto>`);
               with `target`, the stages between the two.
    """
    order = dag_order()
    for name in (target, only, upto):
        if name and name not in order:
            raise ValueError(f"unknown stage {name!r}; stages: {order}")
    if only and (target or upto):
        raise ValueError("`only` runs one stage; it cannot be combined with `target` or `upto`")
    apply_param_overrides(overrides)
    params = load_params()
    picked = set(order)
    if target:
        picked &= set(downstream_of(target, order))
    if upto:
        picked &= set(upstream_of(upto, order))
    stages = [only] if only else [s for s in order if s in picked]
    if not stages:
        raise ValueError(f"no stage is both downstream of {target!r} and upstream of {upto!r}")
    parent = open_parent_run(params, tags={"rr.overrides": json.dumps(overrides or {}), "rr.target": target or "",
                                           "rr.only": only or "", "rr.upto": upto or "", "rr.push": str(push).lower(),
                                           **prefect_tags()})
    os.environ[ENV_PARENT] = parent
    status = "FAILED"
    result: dict[str, str] = {}
    try:
        for stage in stages:
            result[stage] = repro_stage(stage, force=(stage == target))
        if push:
            dvc_push()
        record_lineage(params, parent, result)
        status = "FINISHED"
        print(f"pipeline finished: {result} (MLflow parent run {parent})")
        return result
    finally:
        close_run(params, parent, status)
        os.environ.pop(ENV_PARENT, None)


def _parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        out[key] = yaml.safe_load(value)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="param override (repeatable), like dvc exp run -S")
    ap.add_argument("--target", choices=STAGES, help="rerun this stage and what depends on it")
    ap.add_argument("--only", choices=STAGES, help="run just this stage (if stale)")
    ap.add_argument("--upto", choices=STAGES, help="run this stage and what it depends on, nothing downstream")
    ap.add_argument("--push", action="store_true", help="dvc push after a successful run")
    args = ap.parse_args(argv)
    with local_prefect_api():
        pipeline(overrides=_parse_set(args.set) or None, target=args.target, only=args.only, push=args.push, upto=args.upto)


if __name__ == "__main__":
    sys.exit(main())
