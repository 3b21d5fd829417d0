"""Step metrics that never block a training step: `MetricBuffer` sends them from a background thread
in batches, keeps them while the tracking server is down, and writes what it could not send to a
local JSONL file; `replay_unsent` (`python -m components.tracking replay FILE`) sends that file, and
the run's end status, once the server is back.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import Callable

from components.tracking_server import mlflow_client, tracking_uri

log = logging.getLogger(__name__)

# MLflow refuses a metric name with any other character; a row name such as `ft:retromae@32` (a
# point of the label-efficiency curve) becomes `ft:retromae_at_32`, anything else not allowed `_`.
_NOT_IN_METRIC_NAME = re.compile(r"[^A-Za-z0-9_\-. :/]")


def metric_key(key: str) -> str:
    """`key` as a name MLflow accepts (alphanumerics, `_ - . : /` and spaces)."""
    return _NOT_IN_METRIC_NAME.sub("_", key.replace("@", "_at_"))


class MetricBuffer:
    """Queue step metrics and send them from a background thread in batches.

    If the server is unreachable the batch is kept and retried with backoff; training never waits.
    `close()` makes a last attempt and returns how many metrics could not be sent; those are
    written to `fallback_path` (JSONL) so nothing is lost.

    `probe()` (optional) is asked before each send; False skips the attempt at once, so a dead
    server costs a failed health check, not MLflow's minutes of retries. One sender at a time
    (the flusher thread or `close()`): a batch is never sent twice nor dropped by a race.
    """

    def __init__(self, client, run_id: str, flush_every: float = 2.0, fallback_path: str | os.PathLike | None = None,
                 probe: Callable[[], bool] | None = None):
        self.client, self.run_id, self.flush_every = client, run_id, flush_every
        self.fallback_path = Path(fallback_path) if fallback_path else None
        self.probe = probe
        self._q: queue.Queue = queue.Queue()
        self._pending: list = []
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self.failures = 0
        self.sent = 0
        self._thread = threading.Thread(target=self._loop, name="mlflow-metrics", daemon=True)
        self._thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        for k, v in metrics.items():
            self._q.put(Metric(key=metric_key(k), value=float(v), timestamp=ts, step=int(step)))

    def _drain(self) -> None:
        while True:
            try:
                self._pending.append(self._q.get_nowait())
            except queue.Empty:
                return

    def _failed(self, why: str) -> bool:
        self.failures += 1
        if self.failures in (1, 10) or self.failures % 100 == 0:
            log.warning("MLflow unreachable (%s); %d metrics buffered, will retry", why, len(self._pending))
        return False

    def _flush(self) -> bool:
        with self._send_lock:
            return self._flush_locked()

    def _flush_locked(self) -> bool:
        self._drain()
        if self._pending and self.probe is not None and not self.probe():
            return self._failed("health check failed")
        while self._pending:
            batch = self._pending[:1000]  # MLflow's log_batch limit
            try:
                self.client.log_batch(self.run_id, metrics=batch, synchronous=True)
            except Exception as e:  # noqa: BLE001 - any transport error: keep the batch, retry later
                return self._failed(type(e).__name__)
            del self._pending[: len(batch)]
            self.sent += len(batch)
        return True

    def _loop(self) -> None:
        backoff = self.flush_every
        while not self._stop.wait(backoff):
            backoff = self.flush_every if self._flush() else min(backoff * 2, 30.0)

    def close(self, timeout: float = 10.0) -> int:
        """Stop the flusher and try to send what is left for up to `timeout` seconds in all.

        Returns how many metrics could not be sent (saved to `fallback_path` when given).
        """
        deadline = time.monotonic() + timeout
        self._stop.set()
        self._thread.join(timeout=timeout)
        while True:
            # The flusher may still be inside a send (a server that died mid-call): wait for it
            # until the deadline instead of sending the same batch concurrently.
            if not self._send_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break
            try:
                ok = self._flush_locked()
            finally:
                self._send_lock.release()
            if ok or time.monotonic() >= deadline:
                break
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        locked = self._send_lock.acquire(timeout=0.1)
        try:
            self._drain()
            unsent = list(self._pending)  # a batch still in flight may also arrive: at least once, never lost
            self._pending.clear()
        finally:
            if locked:
                self._send_lock.release()
        if unsent and self.fallback_path:
            self.fallback_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.fallback_path, "a", encoding="utf-8") as f:
                for m in unsent:
                    f.write(json.dumps({"run_id": self.run_id, "key": m.key, "value": m.value, "step": m.step,
                                        "timestamp": m.timestamp}) + "\n")
            log.error("%d metrics could not reach MLflow; saved to %s (send them later with "
                      "`python -m components.tracking replay %s`)", len(unsent), self.fallback_path, self.fallback_path)
        return len(unsent)


def replay_unsent(path: str | os.PathLike, uri: str | None = None, delete: bool = True) -> int:
    """Send a `.mlflow-unsent-<run_id>.jsonl` file (metrics, and the run's end status when the
    server was down at its end) to MLflow, tag the run `rr.metrics_replayed`, delete the file.
    Returns the number of metrics sent. Run it once: a second replay would log the metrics twice.

        python -m components.tracking replay .mlflow-unsent-<run_id>.jsonl [--uri URI]
    """
    from mlflow.entities import Metric

    path = Path(path)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    default_id = path.name.removeprefix(".mlflow-unsent-").removesuffix(".jsonl")
    client = mlflow_client(uri or tracking_uri())
    by_run: dict[str, list] = {}
    ends: dict[str, str] = {}
    for r in rows:
        run_id = r.get("run_id") or default_id
        if "key" in r:
            by_run.setdefault(run_id, []).append(Metric(r["key"], float(r["value"]), int(r["timestamp"]), int(r["step"])))
        elif "status" in r:
            ends[run_id] = r["status"]
    sent = 0
    for run_id, metrics in by_run.items():
        for i in range(0, len(metrics), 1000):
            client.log_batch(run_id, metrics=metrics[i : i + 1000], synchronous=True)
        client.set_tag(run_id, "rr.metrics_replayed", str(len(metrics)))
        sent += len(metrics)
    for run_id, status in ends.items():
        client.set_terminated(run_id, status=status)
    if delete:
        path.unlink()
    return sent
