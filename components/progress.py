"""Progress lines every layer logs the same way: training steps, probes, block embedding, open-QA.

Kept at the bottom of the import order so the index layer, the eval layer and the trainer share
one formatter and one rule for when a long loop speaks.
"""

from __future__ import annotations

import time
from typing import Mapping

PROGRESS_EVERY_S = 60.0  # a long loop logs at least once a minute, whatever its step cadence says, also without a TTY


def format_duration(seconds: float) -> str:
    """4s, 3m05s, 2h07m: an ETA that reads at a glance."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(prefix: str, step: int, max_steps: int, metrics: Mapping[str, float], eta_s: float) -> str:
    """`realm.train step 50/200 (25%) loss 3.2104 tokens/s 1234 eta 1m20s`: what the progress log says."""
    loss = metrics.get("loss")
    parts = [f"{prefix} step {step}/{max_steps} ({100 * step // max(1, max_steps)}%)",
             f"loss {loss:.4f}" if loss is not None else "loss n/a"]
    if "tokens_per_s" in metrics:
        parts.append(f"tokens/s {metrics['tokens_per_s']:.0f}")
    parts.append(f"eta {format_duration(eta_s)}")
    return " ".join(parts)


def count_line(desc: str, done: int, total: int | None, elapsed_s: float, unit: str = "blocks") -> str:
    """`embed blocks 12800/650000 (1%) blocks/s 840 eta 12m51s`: a loop over items, not steps."""
    rate = done / max(elapsed_s, 1e-9)
    if total:
        left = max(0.0, (total - done) / max(rate, 1e-9))
        return f"{desc} {done}/{total} ({100 * done // total}%) {unit}/s {rate:.0f} eta {format_duration(left)}"
    return f"{desc} {done} {unit}/s {rate:.0f}"


class ProgressClock:
    """When a loop logs its next line: each time `done` passes another `every` units (0: never by
    count), and whenever `every_s` seconds (None: PROGRESS_EVERY_S, read when the clock starts)
    passed since the last line, so a loop of slow items is never silent for long.

        clock = ProgressClock(every=1000)
        for ...:
            done += len(batch)
            if clock.due(done, final=done == total):
                log.info("%s", count_line("embed blocks", done, total, clock.elapsed()))
    """

    def __init__(self, every: int = 0, every_s: float | None = None):
        if every < 0:
            raise ValueError(f"every must be >= 0, got {every}")
        self.every = every
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self.t0 = self.last = time.perf_counter()
        self.lines = 0
        self._next = every if every else None

    def due(self, done: int, final: bool = False) -> bool:
        """True when a line is due at `done` units, and then counts it as logged. `final`: the
        loop's last unit, due when an earlier line was logged, so a loop that spoke also ends."""
        now = time.perf_counter()
        by_count = self._next is not None and done >= self._next
        if not (by_count or now - self.last >= self.every_s or (final and self.lines)):
            return False
        self.last, self.lines = now, self.lines + 1
        while self._next is not None and self._next <= done:
            self._next += self.every
        return True

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def eta(self, done: int, total: int) -> float:
        """Seconds left at the mean rate so far."""
        return self.elapsed() / max(done, 1) * max(0, total - done)
