"""What orchestration costs: one stage through the Prefect deployment vs the same stage body called
directly, on the tiny preset, against the real local servers (tests/servers.py).

    .venv/bin/python bench/bench_orchestration.py              # n=3 interleaved rounds, ~5-7 min on 2 cores
    .venv/bin/python bench/bench_orchestration.py -n 5 --stage-only

Layers, each timed in every round, in interleaved order (A, B, C, D, E, then again), medians:
  A  deployment   `prefect deployment run retro-realm/pipeline -p target=tokenize -p upto=tokenize`
                  (forced, so DVC does not skip it): the flow run's start -> end from the Prefect API
                  (`flow_run`), and the client's create -> terminal (`client`, + worker pick-up)
  B  body         `components.data.tokenize.tokenize_corpus(...)` in this (warm) process
  C  stage flow   `python -m flows.tokenize` (a new process: imports, Prefect flow run, MLflow run)
  D  dvc repro    `dvc repro --force --single-item tokenize` (C plus DVC hashing/lock/cache)
  E  no-op repro  `dvc repro tokenize` with nothing changed
  F  imports      `python -c "import flows.tokenize"` (a new process: torch, transformers, mlflow, prefect)
plus, once: the local Prefect API start-up (`flows._runtime.local_prefect_api`, what
`python -m flows.pipeline` pays without PREFECT_API_URL), the server starts, `prefect deploy`.

fixed cost = median(A.flow_run) - median(B); ratio = median(A.flow_run) / median(B). The breakdown
uses the median of per-round differences (paired: the rounds are interleaved, so load drift cancels).
Writes bench/results/orchestration.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import make_workspace  # noqa: E402  (also sets OMP/TOKENIZERS/HF offline defaults)
from tests.servers import _SCRUB, MLflowServer, PrefectServer, S3Server, _tool, http_json  # noqa: E402
from components.io import write_text_atomic  # noqa: E402

VENV_BIN = str(Path(sys.executable).parent)
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _ts(s: str | None) -> float | None:
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp() if s else None


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB and not k.startswith("AWS_")}
    env["PATH"] = VENV_BIN + os.pathsep + env.get("PATH", "")
    return {**env, **extra}


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float = 600) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    dt = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"$ {' '.join(cmd)} -> {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return dt, out.stdout + out.stderr


def deployment_run(api: str, deployment_id: str, params: dict, timeout: float = 600) -> dict:
    """Create a flow run of the deployment and poll until it ends (as `prefect deployment run`)."""
    t0 = time.perf_counter()
    run = http_json("POST", f"{api}/deployments/{deployment_id}/create_flow_run", {"parameters": params})
    while True:
        fr = http_json("GET", f"{api}/flow_runs/{run['id']}")
        if fr["state"]["type"] in TERMINAL:
            break
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"flow run {run['id']} not done after {timeout}s")
        time.sleep(0.2)
    client = time.perf_counter() - t0
    if fr["state"]["type"] != "COMPLETED":
        raise RuntimeError(f"flow run {run['id']} {fr['state']['type']}: {fr['state'].get('message')}")
    start, end, expected = _ts(fr["start_time"]), _ts(fr["end_time"]), _ts(fr["expected_start_time"])
    return {"client": client, "flow_run": end - start, "pickup": start - expected, "id": run["id"]}


def stage_run_seconds(mlflow_client, experiment: str, flow_run_id: str, stage: str) -> float:
    """Duration of the stage's MLflow run under the pipeline parent run of `flow_run_id`."""
    exp = mlflow_client.get_experiment_by_name(experiment)
    parent = mlflow_client.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}' and tags.`rr.kind` = 'pipeline'")[0]
    child = mlflow_client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' and tags.`dvc.stage` = '{stage}'")[0]
    return (child.info.end_time - child.info.start_time) / 1000


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--rounds", type=int, default=3)
    ap.add_argument("--stage-only", action="store_true", help="only A and B (skip C, D, E)")
    ap.add_argument("--api-starts", type=int, default=3, help="local Prefect API start-ups to time")
    ap.add_argument("--out", default=str(ROOT / "bench/results/orchestration.json"))
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="rr-bench-orch-"))
    res: dict = {"args": vars(args), "env": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                                             "loadavg_start": os.getloadavg(), "omp_threads": os.environ.get("OMP_NUM_THREADS")},
                 "once": {}, "samples": {k: [] for k in ("A_flow_run", "A_client", "A_pickup", "A_stage_mlflow_run",
                                                          "B_body", "C_stage_flow", "D_dvc_repro_force", "E_dvc_repro_noop",
                                                          "F_imports")}}
    once, samples = res["once"], res["samples"]

    # -- the local Prefect API that `python -m flows.pipeline` starts without PREFECT_API_URL ---------
    from flows._runtime import local_prefect_api

    saved = os.environ.pop("PREFECT_API_URL", None)
    starts = []
    for i in range(args.api_starts):
        t0 = time.perf_counter()
        with local_prefect_api(home=tmp / f"local-api-{i}"):
            starts.append(time.perf_counter() - t0)
    if saved:
        os.environ["PREFECT_API_URL"] = saved
    once["local_prefect_api_start_s"] = [round(x, 2) for x in starts]

    s3 = S3Server(tmp / "s3").start()
    mlflow = MLflowServer(tmp / "mlflow", s3=s3).start()
    prefect = PrefectServer(tmp / "prefect").start()
    try:
        once["server_start_s"] = {"s3": s3.start_seconds[0], "mlflow": mlflow.start_seconds[0], "prefect+worker": prefect.start_seconds[0]}
        experiment = "bench-orchestration"
        ws = make_workspace(tmp / "ws", overrides={"tracking.experiment": experiment})
        job_env = {"MLFLOW_TRACKING_URI": mlflow.url}
        cli_env = _env({**prefect.env, "RR_WORKDIR": str(ws), "RR_PREFECT_POOL": prefect.pool})
        stage_env = _env({**prefect.env, **job_env, "RR_PARENT_RUN_ID": ""})

        dt, _ = _run([_tool("prefect"), "--no-prompt", "deploy", "--name", "pipeline", "--job-variable",
                      json.dumps({"env": job_env})], ws, cli_env)
        once["prefect_deploy_s"] = round(dt, 2)
        api = prefect.api_url
        dep_id = http_json("GET", f"{api}/deployments/name/retro-realm/pipeline")["id"]

        first = deployment_run(api, dep_id, {"upto": "tokenize"})  # prepare_corpus + tokenize, untimed warm-up
        once["first_run_prepare_and_tokenize_s"] = round(first["flow_run"], 2)

        from components.config import load_params
        from components.data.tokenize import tokenize_corpus

        params = load_params(ws / "params.yaml")
        tokenize_corpus(params.tokenize, ws / "data/corpus", tmp / "warm")  # imports, first-call costs

        mlf = mlflow.client()
        for i in range(args.rounds):
            a = deployment_run(api, dep_id, {"target": "tokenize", "upto": "tokenize"})
            samples["A_flow_run"].append(a["flow_run"])
            samples["A_client"].append(a["client"])
            samples["A_pickup"].append(a["pickup"])
            samples["A_stage_mlflow_run"].append(stage_run_seconds(mlf, experiment, a["id"], "tokenize"))

            t0 = time.perf_counter()
            tokenize_corpus(params.tokenize, ws / "data/corpus", tmp / f"direct-{i}")
            samples["B_body"].append(time.perf_counter() - t0)

            if not args.stage_only:
                samples["C_stage_flow"].append(_run([sys.executable, "-m", "flows.tokenize"], ws, stage_env)[0])
                samples["D_dvc_repro_force"].append(
                    _run([sys.executable, "-m", "dvc", "repro", "--force", "--single-item", "tokenize"], ws, stage_env)[0])
                dt, out = _run([sys.executable, "-m", "dvc", "repro", "tokenize"], ws, stage_env)
                assert "didn't change" in out or "up to date" in out, out[-500:]
                samples["E_dvc_repro_noop"].append(dt)
                samples["F_imports"].append(_run([sys.executable, "-c", "import flows.tokenize"], ws, stage_env)[0])
            print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{k}={v[-1]:.2f}" for k, v in samples.items() if v), flush=True)
    finally:
        prefect.stop()
        mlflow.stop()
        s3.persist = False
        s3.stop()

    medians = {k: med(v) for k, v in samples.items() if v}
    body, a = medians["B_body"], medians["A_flow_run"]
    res["samples"] = {k: [round(x, 3) for x in v] for k, v in samples.items() if v}
    res["median_s"] = medians
    res["summary"] = {
        "stage_body_s": body,
        "deployment_flow_run_s": a,
        "fixed_cost_s": round(a - body, 2),
        "ratio": round(a / body, 2),
        "client_fixed_cost_s": round(medians["A_client"] - body, 2),
        "worker_pickup_s": medians["A_pickup"],
        "local_prefect_api_start_s": med(starts),
    }
    if "C_stage_flow" in medians:
        def paired(x: str, y: str) -> float:
            return med([a - b for a, b in zip(samples[x], samples[y])])

        res["summary"]["breakdown_s"] = {
            "worker pick-up (poll interval + process start + pull step)": medians["A_pickup"],
            "pipeline flow on the worker, around dvc repro (engine, parent run, lineage)": paired("A_flow_run", "D_dvc_repro_force"),
            "dvc repro around the stage process (hashing, lock, cache)": paired("D_dvc_repro_force", "C_stage_flow"),
            "stage process: Python imports": medians["F_imports"],
            "stage process: Prefect flow run + MLflow run + logging, beyond imports and body": round(
                statistics.median(c - f - b for c, f, b in zip(samples["C_stage_flow"], samples["F_imports"], samples["B_body"])), 3),
            "  of which the stage's MLflow run (open -> close, in A)": medians["A_stage_mlflow_run"],
            "stage body": body,
            "no-op dvc repro (for reference)": medians["E_dvc_repro_noop"],
        }
    res["env"]["loadavg_end"] = os.getloadavg()
    write_text_atomic(args.out, json.dumps(res, indent=2) + "\n")
    print(json.dumps(res["summary"], indent=2))
    return res


if __name__ == "__main__":
    main()
