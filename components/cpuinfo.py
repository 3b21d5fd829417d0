"""This machine's CPU as /proc/cpuinfo names it: what precision choices, benchmarks and archived
results key on. Standard library only, so that drivers that never load torch can use it."""

from __future__ import annotations

import functools
import platform

# the flags a CPU's training speed turns on: native bf16 matmuls, then vector width (the order archived labels use)
SPEED_FLAGS = ("avx512_bf16", "amx_bf16", "avx512f", "avx2")


@functools.cache
def cpu_flags_and_model() -> tuple[frozenset[str], str]:
    """(the first core's flags, its model name); empty where /proc/cpuinfo cannot be read (not Linux)."""
    flags, model = frozenset(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = frozenset(line.split(":", 1)[1].split())
                elif line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return flags, model


def cpu_model() -> str:
    """`Intel(R) Xeon(R) Processor`: the model name (`platform.processor()` where it is not listed)."""
    return cpu_flags_and_model()[1] or platform.processor() or "unknown"


def cpu_label() -> str:
    """`AMD EPYC (avx512_bf16, avx512f)`: the model name and the first two of SPEED_FLAGS it has."""
    flags = cpu_flags_and_model()[0]
    have = [f for f in SPEED_FLAGS if f in flags][:2]
    return f"{cpu_model()} ({', '.join(have) or 'no avx'})"
