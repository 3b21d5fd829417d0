"""The whole pipeline as one Prefect flow: apply param overrides, then `dvc repro`, stage by stage.

    python -m flows.pipeline                                   # the README's main job
    python -m flows.pipeline --set retromae.train.max_steps=200 --target pretrain_retromae
    prefect deployment run retro-realm/pipeline -p overrides='{"retromae.train.max_steps": 200}'
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
from components.tracking import ENV_PARENT, close_run, open_parent_run
from flows._runtime import STAGES, local_prefect_api, prefect_tags


def dag_order() -> list[str]:
    """Stages in dvc.yaml order (dvc.yaml lists them topologically)."""
    stages = yaml.safe_load(Path("dvc.yaml").read_text())["stages"]
    return [s for s in stages]


def downstream_of(target: str, order: list[str]) -> list[str]:
    """`target` and every stage that (transitively) depends on its outputs."""
    spec = yaml.safe_load(Path("dvc.yaml").read_text())["stages"]
    outs = {s: {list(o)[0] if isinstance(o, dict) else o for o in spec[s].get("outs", [])} for s in order}
    picked = {target}
    for s in order:
        deps = set(spec[s].get("deps", []))
        if any(d in outs[p] for p in picked for d in deps):
            picked.add(s)
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


@task(cache_policy=NO_CACHE, name="dvc-repro-stage")
def repro_stage(stage: str, force: bool = False) -> str:
    logger = get_run_logger()
    cmd = ["dvc", "repro", "--single-item", stage] + (["--force"] if force else [])
    logger.info("$ %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=os.environ.copy())
    skipped = False
    for line in proc.stdout:
        line = line.rstrip()
        if "didn't change, skipping" in line:
            skipped = True
        logger.info("%s", line)
    if proc.wait() != 0:
        raise RuntimeError(f"stage {stage} failed (dvc repro exit {proc.returncode}); see the log above")
    return "skipped" if skipped else "ran"


@task(cache_policy=NO_CACHE, name="dvc-push")
def dvc_push() -> None:
    subprocess.run(["dvc", "push"], check=True)


@flow(name="retro-realm", log_prints=True)
def pipeline(overrides: dict | None = None, target: str | None = None, only: str | None = None,
             push: bool = False) -> dict[str, str]:
    """Run the DAG.

    overrides: dotted params written into params.yaml first (as `dvc exp run -S`).
    target:    force this stage and rerun everything downstream of it.
    only:      run just this stage (`dvc repro --single-item`): the per-stage deployments.
    push:      `dvc push` after a successful run (remote workers).
    """
    apply_param_overrides(overrides)
    params = load_params()
    order = dag_order()
    for name in (target, only):
        if name and name not in order:
            raise ValueError(f"unknown stage {name!r}; stages: {order}")
    stages = [only] if only else (downstream_of(target, order) if target else order)
    parent = open_parent_run(params, tags={"rr.overrides": json.dumps(overrides or {}), "rr.target": target or "", **prefect_tags()})
    os.environ[ENV_PARENT] = parent
    status = "FAILED"
    result: dict[str, str] = {}
    try:
        for stage in stages:
            result[stage] = repro_stage(stage, force=(stage == target))
        if push:
            dvc_push()
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
    ap.add_argument("--push", action="store_true", help="dvc push after a successful run")
    args = ap.parse_args(argv)
    with local_prefect_api():
        pipeline(overrides=_parse_set(args.set) or None, target=args.target, only=args.only, push=args.push)


if __name__ == "__main__":
    sys.exit(main())
