"""Run the whole benchmark suite and write bench/README.md (ratio, goal, pass/fail).

    make bench                     # = .venv/bin/python -m bench.run_all
    .venv/bin/python -m bench.run_all --summary-only    # rebuild bench/README.md from bench/results/*.json

Each benchmark interleaves its contenders in one process and reports medians and ratios; absolute
times on a shared CPU machine are noise. GPU numbers come from `bash bench/gpu_check.sh` on a GPU box.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.io import write_text_atomic  # noqa: E402

RESULTS = ROOT / "bench/results"

SUITE = [
    ["bench/bench_step.py", "--shape", "tiny"],
    ["bench/bench_step.py", "--shape", "base", "--steps", "3"],
    ["bench/bench_step_parts.py"],
    ["bench/bench_index.py"],
    ["bench/bench_refresh.py"],
    ["bench/bench_orchestration.py", "--rounds", "2", "--api-starts", "2"],
    ["bench/bench_data.py"],
    ["bench/gpu_check.py"],  # reduced CPU form when no GPU is visible
]


def _load(name: str) -> dict:
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else {}


def _row(bench: str, what: str, value, goal: str, ok) -> str:
    v = f"{value:.3f}" if isinstance(value, float) else ("n/a" if value is None else str(value))
    verdict = "n/a" if ok is None else ("pass" if ok else "**fail**")
    return f"| {bench} | {what} | {v} | {goal} | {verdict} |"


def summary() -> str:
    rows = []
    step = _load("step")
    for key, r in sorted(step.items()):
        wall, flops = r.get("ratio_retromae_vs_mlm_hf"), r.get("flop_ratio_retromae_vs_mlm_hf")
        rows.append(_row("step", f"RetroMAE / BertForMaskedLM step, {key} (wall)", wall, "<= 1.10", None if wall is None else wall <= 1.10))
        rows.append(_row("step", f"RetroMAE / BertForMaskedLM step, {key} (FLOPs)", flops, "<= 1.10", None if flops is None else flops <= 1.10))
    for key, r in sorted(_load("step_parts").items()):
        realm, dpr = r.get("realm", {}), r.get("dpr", {})
        frac = realm.get("fraction", {})
        if frac:
            parts = ", ".join(f"{k} {frac[k]:.0%}" for k in ("retrieve", "score", "ka", "backward"))
            rows.append(_row("step", f"REALM step split, {key}", parts, "report", None))
        if dpr:
            rows.append(_row("step", f"DPR step with / without {dpr['hard_negatives']} hard negative(s), {key}",
                             dpr["ratio_with_over_without"], f"report (token ratio {dpr['token_ratio']:.2f})", None))
    ref = _load("refresh")
    for key, goal in (("embed_ratio", 0.90), ("async_over_none", 0.90)):
        v = _find(ref, key)
        rows.append(_row("refresh", key, v, f">= {goal}", None if v is None else v >= goal))
    for key in ("sync_over_none", "fraction_hidden"):
        rows.append(_row("refresh", key, _find(ref, key), "report", None))
    idx = _load("index").get("recommendation", {})
    rows.append(_row("index", "auto: flat up to N blocks (CPU)", idx.get("index_auto_flat_max"), "measured", None))
    orch = _load("orchestration").get("summary", {})
    fixed = orch.get("fixed_cost_s")  # <= 5% of a 60 s stage means <= 3 s
    rows.append(_row("orchestration", "fixed cost of a stage via deployment, worker pick-up excluded (s)", fixed,
                     "<= 3 (5% of a 60 s stage)", None if fixed is None else fixed <= 3))
    pickup = orch.get("worker_pickup_s")
    rows.append(_row("orchestration", "worker pick-up of a deployment run (s)", pickup, "report (poll interval)", None))
    noop = (orch.get("breakdown_s") or {}).get("no-op dvc repro (for reference)")
    rows.append(_row("orchestration", "no-op dvc repro (s)", noop, "<= 3", None if noop is None else noop <= 3))
    rows.append(_row("orchestration", "local Prefect API start-up (s)", orch.get("local_prefect_api_start_s"), "report (paid once per pipeline)", None))
    data = _load("data")
    rows.append(_row("data", "prepare_corpus docs/s (python docs prose)", data.get("prepare_docs_per_s"), "report", None))
    rows.append(_row("data", "tokenize tokens/s, num_proc 1 -> 2", json.dumps(data.get("tokenize_tokens_per_s")) if data else None, "report", None))
    gpu = _load("gpu_check").get("train", {})
    rows.append(_row("gpu", "RetroMAE BERT-base MFU (H200, bf16)", gpu.get("mfu"), ">= 0.40", None if gpu.get("mfu") is None else gpu["mfu"] >= 0.40))
    head = ["# Benchmarks", "", "Written by `python -m bench.run_all` on " + time.strftime("%Y-%m-%d") + ". Each benchmark runs its contenders",
            "interleaved in one process; see each script's docstring and `bench/results/*.json` for medians and spreads.",
            "Timings on the shared 2-core machine are noisy: some were taken while other jobs ran (load 5-11, see each",
            "result's `env.loadavg`); the FLOP ratios are load-independent. `n/a`: not measured on this machine (e.g. the GPU row without a GPU).", "",
            "| benchmark | measure | value | goal | verdict |", "|---|---|---:|---|---|"]
    return "\n".join(head + rows) + "\n"


# Studies (what the models learn, not how fast) are not benchmarks: experiments/ holds them.
STUDIES = """
## Studies

Scientific studies (run by hand, never by run_all) live in `experiments/`: [experiments/README.md](../experiments/README.md).
A study may import a helper from here (`workspace.py`); nothing here imports a study.
"""


def hand_run_sections(readme: Path) -> str:
    """The `## ... (... run by hand)` sections of the current bench/README.md other than Studies:
    benchmarks too long or too machine-bound for run_all, whose rows are written by hand."""
    if not readme.exists():
        return ""
    keep, cur = [], None
    for line in readme.read_text().splitlines(keepends=True):
        if line.startswith("## "):
            cur = [] if "run by hand" in line and not line.startswith("## Studies") else None
            if cur is not None:
                keep.append(cur)
        if cur is not None:
            cur.append(line)
    return "".join("\n" + "".join(sec).strip("\n") + "\n" for sec in keep)


def _find(d, key):
    if isinstance(d, dict):
        if key in d and isinstance(d[key], (int, float)):
            return float(d[key])
        for v in d.values():
            found = _find(v, key)
            if found is not None:
                return found
    return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summary-only", action="store_true")
    args = ap.parse_args(argv)
    if not args.summary_only:
        for cmd in SUITE:
            print("$", " ".join(cmd), flush=True)
            rc = subprocess.run([sys.executable, *cmd], cwd=ROOT).returncode
            if rc != 0:
                print(f"  (exit {rc}; its row stays n/a)", flush=True)
    text = summary() + STUDIES + hand_run_sections(ROOT / "bench/README.md")
    write_text_atomic(ROOT / "bench/README.md", text)
    print(text)


if __name__ == "__main__":
    main()
