"""Progress lines every layer logs the same way: training steps, probes, block embedding.

Kept at the bottom of the import order so the index layer and the trainer share one formatter.
"""

from __future__ import annotations

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
