"""The local S3 endpoint's snapshot and restore (infra/s3_state.py): one copying thread against
`COPY_THREADS`, on a real moto_server with objects shaped like the test suite's buckets after the
deployment test (many small MLflow / DVC objects, a few MB-sized model files).

    .venv/bin/python -m bench.bench_s3_snapshot                     # 600 objects, 3 interleaved rounds
    .venv/bin/python -m bench.bench_s3_snapshot --objects 200 --rounds 5

`infra/servers.sh down` / `up` and the test fixtures' `stop()` / `start()` run these two on every
restart of the endpoint, so their time is a restart's. Each round times both arms in alternating
order (load drift hits both); medians and the sequential / threaded ratio are printed and written
to bench/results/s3_snapshot.json (or --out).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.io import write_json_atomic  # noqa: E402
from tests.servers import S3Server, _load_s3_state  # noqa: E402


def fill(client, n: int, big_every: int, big_bytes: int) -> int:
    """n objects: every `big_every`-th one `big_bytes` long (a model file), the rest 20 kB; their total bytes."""
    total = 0
    for i in range(n):
        body = os.urandom(big_bytes if i % big_every == 0 else 20_000)
        client.put_object(Bucket="retro-realm-mlflow", Key=f"1/run{i // 10:03d}/artifacts/file{i:04d}.bin", Body=body)
        total += len(body)
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--objects", type=int, default=600)
    ap.add_argument("--big-every", type=int, default=50, help="every N-th object is --big-bytes long")
    ap.add_argument("--big-bytes", type=int, default=3_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/results/s3_snapshot.json"))
    a = ap.parse_args(argv)
    state = _load_s3_state()
    arms = {"sequential": 1, "threaded": state.COPY_THREADS}
    times: dict[str, dict[str, list[float]]] = {arm: {"snapshot": [], "restore": []} for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        server = S3Server(Path(tmp) / "s3").start()
        try:
            client = server.client()
            total = fill(client, a.objects, a.big_every, a.big_bytes)
            for r in range(a.rounds):
                for arm in (list(arms) if r % 2 == 0 else list(reversed(arms))):
                    folder = Path(tmp) / f"snap-{arm}"
                    t0 = time.perf_counter()
                    state.snapshot(client, folder, threads=arms[arm])
                    times[arm]["snapshot"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()  # restore over the same objects: every PUT replaces one
                    state.restore(client, folder, threads=arms[arm])
                    times[arm]["restore"].append(time.perf_counter() - t0)
        finally:
            server.kill()
    med = {arm: {op: round(statistics.median(v), 3) for op, v in ops.items()} for arm, ops in times.items()}
    ratio = {op: round(med["sequential"][op] / med["threaded"][op], 2) for op in ("snapshot", "restore")}
    out = {"objects": a.objects, "bytes": total, "rounds": a.rounds, "threads": arms, "median_s": med, "ratio": ratio,
           "samples_s": {arm: {op: [round(x, 3) for x in v] for op, v in ops.items()} for arm, ops in times.items()},
           "env": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "loadavg": os.getloadavg()}}
    write_json_atomic(a.out, out)
    print(f"{a.objects} objects, {total / 1e6:.0f} MB, medians of {a.rounds} rounds:")
    for op in ("snapshot", "restore"):
        print(f"  {op:8s} 1 thread {med['sequential'][op]:.2f} s   {arms['threaded']} threads {med['threaded'][op]:.2f} s"
              f"   ratio {ratio[op]:.2f}x")
    print(f"-> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
