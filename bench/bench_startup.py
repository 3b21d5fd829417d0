"""What it costs to start one stage: a baseline commit against this checkout, side by side, on the
tiny preset against real local servers (tests/servers.py: MLflow + S3, a Prefect API).

    .venv/bin/python bench/bench_startup.py                     # baseline: merge-base with main, 5 rounds, ~10 min
    .venv/bin/python bench/bench_startup.py --baseline b5c8f8b -n 7 --stage prepare_corpus

Two workspaces, each made by its own commit's `tests.conftest.make_workspace` (baseline: a clone of
`--baseline`, by default the commit this branch left main at; candidate: a clone of this checkout's HEAD), both run up to the stage once (untimed).
Then, in every round, both workspaces in alternating order (A B, B A, ...), each a new process:

  stage     `scripts/py -m flows.<stage>`: scripts/py, imports, Prefect flow run, MLflow run, body, exit
  repro     `dvc repro --force --single-item <stage>`: the stage as DVC runs it (+ hashing, lock)
  noop      `dvc repro <stage>` with nothing changed
  import    `python -c "import flows.<stage>"`

`--warm` adds a third arm, `warm`: the candidate workspace with a stage server running in it
(flows/stage_server.py, as `flows.pipeline` starts one), so `stage` and `repro` fork from a process
that has the libraries imported (`noop` and `import` do not start a stage: the same as cold).

Wall seconds and CPU seconds (user + sys of the child processes, less sensitive to other jobs on
the machine) per measure; medians, the spread (min-max), and the candidate / baseline ratio of
medians plus the median of per-round paired ratios (the pairs share the machine's load).
Per-stage fixed cost = median(repro) - body, the body timed warm in this process (its imports paid
once first), as bench_orchestration.py does. Writes bench/results/startup.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.workspace import fresh_clone  # noqa: E402
from tests.servers import _SCRUB, MLflowServer, PrefectServer, S3Server  # noqa: E402
from components.io import write_text_atomic  # noqa: E402

MEASURES = ("stage", "repro", "noop", "import")


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB and not k.startswith("AWS_")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def timed(cmd: list[str], cwd: Path, env: dict, timeout: float = 900) -> tuple[float, float, str]:
    """(wall s, child CPU s, output) of one command; raises on a non-zero exit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError(f"$ {' '.join(cmd)} (in {cwd}) -> {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, out.stdout + out.stderr


def workspace(tmp: Path, name: str, ref: str | None, stage: str, env: dict) -> Path:
    """A clone of `ref` (None: HEAD), and in it a tiny-preset workspace run up to `stage`."""
    clone = fresh_clone(tmp / f"{name}-clone")
    if ref is not None:
        subprocess.run(["git", "checkout", "-q", ref], cwd=clone, check=True)
    ws = tmp / f"{name}-ws"
    ws.mkdir()
    code = f"from pathlib import Path; from tests.conftest import make_workspace; make_workspace(Path({str(ws)!r}))"
    subprocess.run([sys.executable, "-c", code], cwd=clone, env=env, check=True)
    os.symlink(ROOT / ".venv", ws / ".venv")
    timed([sys.executable, "-m", "flows.pipeline", "--upto", stage], ws, env)
    return ws


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default=None, help="git ref to compare this checkout's HEAD with "
                    "(default: where HEAD left main, `git merge-base HEAD main`)")
    ap.add_argument("--stage", default="tokenize", choices=["prepare_corpus", "tokenize"])
    ap.add_argument("-n", "--rounds", type=int, default=5)
    ap.add_argument("--warm", action="store_true", help="also time the candidate with a stage server (arm `warm`)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/startup.json"))
    args = ap.parse_args(argv)

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    git = ["merge-base", "HEAD", "main"] if args.baseline is None else ["rev-parse", args.baseline]
    base = subprocess.run(["git", *git], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()[:12]
    tmp = Path(tempfile.mkdtemp(prefix="rr-bench-startup-"))
    res: dict = {"args": vars(args), "commits": {"baseline": base, "candidate": head},
                 "env": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "loadavg_start": os.getloadavg()}}
    arms = ("baseline", "candidate", *(("warm",) if args.warm else ()))
    samples = {v: {f"{m}_{k}": [] for m in MEASURES for k in ("wall", "cpu")} for v in arms}

    s3 = S3Server(tmp / "s3").start()
    mlflow = MLflowServer(tmp / "mlflow", s3=s3).start()
    prefect = PrefectServer(tmp / "prefect", worker=False).start()
    try:
        env = _env({**prefect.env, **mlflow.env, "MLFLOW_TRACKING_URI": mlflow.url, "RR_PARENT_RUN_ID": ""})
        spaces = {"baseline": workspace(tmp, "baseline", base, args.stage, env),
                  "candidate": workspace(tmp, "candidate", None, args.stage, env)}
        envs = {"baseline": env, "candidate": env}
        if args.warm:
            from flows.stage_server import stage_server

            spaces["warm"] = spaces["candidate"]
            cwd = os.getcwd()
            os.chdir(spaces["warm"])  # the server runs in the workspace, as the pipeline's does
            server = stage_server(env)
            envs["warm"] = {**env, "RR_STAGE_SERVER": server.__enter__()}
            os.chdir(cwd)
            while not Path(envs["warm"]["RR_STAGE_SERVER"]).exists():  # its imports, once per pipeline run
                time.sleep(0.2)

        from components.config import load_params
        from components.data.prepare import prepare_corpus
        from components.data.tokenize import tokenize_corpus

        ws = spaces["candidate"]
        params = load_params(ws / "params.yaml")
        body = {"tokenize": lambda out: tokenize_corpus(params.tokenize, ws / "data/corpus", out),
                "prepare_corpus": lambda out: prepare_corpus(params.data, out)}[args.stage]
        body(tmp / "warm")  # imports and first-call costs, paid once
        bodies = []

        commands = {"stage": ["scripts/py", "-m", f"flows.{args.stage}"],
                    "repro": [sys.executable, "-m", "dvc", "repro", "--force", "--single-item", args.stage],
                    "noop": [sys.executable, "-m", "dvc", "repro", args.stage],
                    "import": [sys.executable, "-c", f"import flows.{args.stage}"]}
        for i in range(args.rounds):
            order = list(arms) if i % 2 == 0 else list(reversed(arms))
            for m, cmd in commands.items():
                for v in order:
                    wall, cpu, out = timed(cmd, spaces[v], envs[v])
                    if m == "noop":
                        assert "didn't change" in out or "up to date" in out, out[-500:]
                    samples[v][f"{m}_wall"].append(wall)
                    samples[v][f"{m}_cpu"].append(cpu)
            t0 = time.perf_counter()
            body(tmp / f"body-{i}")
            bodies.append(time.perf_counter() - t0)
            print(f"round {i + 1}/{args.rounds} ({' then '.join(order)}): " + "  ".join(
                f"{m} " + "/".join(f"{samples[v][m + '_wall'][-1]:.2f}" for v in arms) for m in MEASURES)
                  + f"  body {bodies[-1]:.3f}", flush=True)
    finally:
        if args.warm:
            server.__exit__(None, None, None)
        prefect.stop()
        mlflow.stop()
        s3.persist = False
        s3.stop()

    body_s = med(bodies)
    medians = {v: {k: med(xs) for k, xs in s.items()} for v, s in samples.items()}
    table = {}
    for k in samples["baseline"]:
        b, c = samples["baseline"][k], samples["candidate"][k]
        table[k] = {"baseline": medians["baseline"][k], "candidate": medians["candidate"][k],
                    "ratio": round(medians["candidate"][k] / medians["baseline"][k], 3),
                    "paired_ratio": round(statistics.median(y / x for x, y in zip(b, c)), 3),
                    "baseline_range": [round(min(b), 2), round(max(b), 2)],
                    "candidate_range": [round(min(c), 2), round(max(c), 2)]}
        if args.warm:  # warm against the same checkout started cold
            w = samples["warm"][k]
            table[k].update({"warm": medians["warm"][k], "warm_ratio": round(medians["warm"][k] / medians["candidate"][k], 3),
                             "warm_paired_ratio": round(statistics.median(y / x for x, y in zip(c, w)), 3),
                             "warm_range": [round(min(w), 2), round(max(w), 2)]})
    res["samples"] = {v: {k: [round(x, 3) for x in xs] for k, xs in s.items()} for v, s in samples.items()}
    res["body_s"] = body_s
    res["table"] = table
    res["fixed_cost_s"] = {v: {"stage process": round(medians[v]["stage_wall"] - body_s, 2),
                               "dvc repro": round(medians[v]["repro_wall"] - body_s, 2)} for v in samples}
    res["env"]["loadavg_end"] = os.getloadavg()
    write_text_atomic(args.out, json.dumps(res, indent=2) + "\n")

    print(f"\n{args.stage}, {args.rounds} rounds, baseline {base} vs candidate {head}; body (warm) {body_s:.3f} s; "
          f"load {res['env']['loadavg_start'][0]:.1f} -> {res['env']['loadavg_end'][0]:.1f}")
    print(f"{'measure':<14}{'baseline':>10}{'candidate':>11}{'ratio':>8}{'paired':>8}   ranges (min-max)")
    for k, row in table.items():
        print(f"{k:<14}{row['baseline']:>10.2f}{row['candidate']:>11.2f}{row['ratio']:>8.2f}{row['paired_ratio']:>8.2f}"
              f"   {row['baseline_range']} / {row['candidate_range']}")
    if args.warm:
        print(f"\n{'measure':<14}{'cold':>10}{'warm':>11}{'ratio':>8}{'paired':>8}   warm range")
        for k, row in table.items():
            print(f"{k:<14}{row['candidate']:>10.2f}{row['warm']:>11.2f}{row['warm_ratio']:>8.2f}"
                  f"{row['warm_paired_ratio']:>8.2f}   {row['warm_range']}")
    print("fixed cost per stage (median - body), s:", json.dumps(res["fixed_cost_s"]))
    return res


if __name__ == "__main__":
    main()
