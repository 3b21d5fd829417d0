"""Precision: `compute.precision` resolved for a device (`auto`, `bf16_if_native`, `bf16_if_faster`, bf16,
fp16, fp32) and the autocast context it implies. The Trainer runs its steps in it; embedding blocks and
evaluation use `autocast_for` outside the Trainer.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from components.cpuinfo import cpu_flags_and_model
from components.io import write_json_atomic

log = logging.getLogger(__name__)

# bf16_if_faster picks bf16 on a CPU only when its matmuls run at least this much faster than fp32's: a
# step is not all matmuls (bf16 gained 2.3x in training where its matmuls gained 2.2x, but 1.35x in
# inference: bench/README.md, "CPU precision"), and a tie is worth fp32's exactness.
BF16_MIN_SPEEDUP = 1.25
PRECISION_CACHE_ENV = "RR_PRECISION_CACHE"


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (x86 AVX512-BF16 or AMX-BF16, read from
    /proc/cpuinfo). Without them oneDNN emulates bf16, and autocast is 2-3x slower than fp32. With
    them bf16 is usually faster, not always: `cpu_bf16_speedup` measures it."""
    return bool(cpu_flags_and_model()[0] & {"avx512_bf16", "amx_bf16"})


def precision_cache_path() -> Path:
    """Where `bf16_if_faster` keeps its measurements, one per (CPU, torch, threads): $RR_PRECISION_CACHE,
    else $XDG_CACHE_HOME/retro-realm/precision.json (~/.cache/...). Delete it to measure again."""
    if os.environ.get(PRECISION_CACHE_ENV):
        return Path(os.environ[PRECISION_CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "retro-realm" / "precision.json"


def _machine_key() -> str:
    flags, model = cpu_flags_and_model()
    isa = ",".join(sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2"))))
    return f"{model or 'unknown cpu'} | {isa} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def measure_cpu_bf16_speedup(rounds: int = 5, rows: int = 1024, width: int = 768) -> float:
    """fp32 time / bf16-autocast time of a transformer FFN-shaped matmul, (rows, width) x (width, 4 width),
    on this CPU at torch's thread count: fp32 and bf16 interleaved, the median of `rounds` pairs. ~1 s."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, width, generator=gen), torch.randn(4 * width, width, generator=gen)

    def timed(dtype: torch.dtype | None) -> float:
        ctx = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
        with torch.inference_mode(), ctx:
            t0 = time.perf_counter()
            for _ in range(2):
                torch.nn.functional.linear(x, w)
            return time.perf_counter() - t0

    timed(None), timed(torch.bfloat16)  # warm-up: oneDNN builds its kernels on the first call
    ratios = [timed(None) / timed(torch.bfloat16) for _ in range(rounds)]
    return statistics.median(ratios)


@functools.cache  # once per process; across processes the file below holds it
def cpu_bf16_speedup() -> float:
    """This CPU's measured bf16 speed-up (`measure_cpu_bf16_speedup`), cached on disk per (CPU, torch,
    threads) so every stage of a run, and every later run, makes the same choice. Processes that start
    together (DDP ranks) wait on a file lock while the first one measures, so they do not measure each
    other's contention. A CPU without bf16 instructions is not measured: it emulates bf16 (0.0)."""
    if not cpu_has_native_bf16():
        return 0.0
    path, key = precision_cache_path(), _machine_key()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "w")
    except OSError as e:  # a read-only home: measure in this process, say where the cache would go
        log.warning("compute.precision=bf16_if_faster: cannot write %s (%s): measuring in this process only; "
                    "set $%s to a writable file", path, e, PRECISION_CACHE_ENV)
        return measure_cpu_bf16_speedup()
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
        cache = cache if isinstance(cache, dict) else {}
        if not isinstance(cache.get(key), (int, float)):
            cache[key] = round(measure_cpu_bf16_speedup(), 3)
            write_json_atomic(path, cache)
            log.info("compute.precision=bf16_if_faster: bf16 matmuls ran %.2fx fp32's on this CPU (%s); "
                     "saved in %s", cache[key], key, path)
    return float(cache[key])


def resolve_precision(precision: str, device: torch.device) -> str:
    """`compute.precision` -> fp32 | bf16 | fp16.
    auto: bf16 on a CUDA device that supports it, else fp32.
    bf16_if_native: bf16 wherever the hardware has bf16 instructions (that CUDA device, or a CPU with
    AVX512-BF16 / AMX), else fp32.
    bf16_if_faster: the same on CUDA; on a CPU, bf16 only where its matmuls measured at least
    BF16_MIN_SPEEDUP x fp32's (`cpu_bf16_speedup`), since some CPUs list the instructions and still run
    bf16 no faster (a Xeon whose hypervisor hides AMX: bench/README.md, "CPU precision")."""
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if precision == "auto":
        return "bf16" if cuda_bf16 else "fp32"
    if precision == "bf16_if_native":
        return "bf16" if cuda_bf16 or (device.type == "cpu" and cpu_has_native_bf16()) else "fp32"
    if precision == "bf16_if_faster":
        if device.type == "cpu":
            return "bf16" if cpu_bf16_speedup() >= BF16_MIN_SPEEDUP else "fp32"
        return "bf16" if cuda_bf16 else "fp32"
    if precision == "bf16" and device.type == "cuda" and not cuda_bf16:
        raise RuntimeError("compute.precision=bf16 but this GPU has no bf16 support; use fp16 or fp32")
    if precision == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        _warn_emulated_bf16()
    return precision


@functools.cache  # once per process: resolve_precision runs at every autocast_for
def _warn_emulated_bf16() -> None:
    log.warning("compute.precision=bf16 on a CPU without AVX512-BF16/AMX: oneDNN emulates bf16, 2-3x slower "
                "than fp32 here (bench/bench_precision.py); set compute.precision=bf16_if_faster or fp32")


AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # a resolved precision -> its autocast dtype (fp32: none)


def autocast_for(precision: str, device: torch.device | str):
    """The mixed-precision context of `compute.precision` on `device`, for forward passes outside
    the Trainer (embedding blocks, evaluation); a no-op for fp32. bf16 autocast runs on CPUs too:
    with AVX512-BF16 / AMX a BERT forward is ~2.5x faster than fp32."""
    device = torch.device(device)
    dtype = AMP_DTYPES.get(resolve_precision(precision, device))
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


__all__ = ["AMP_DTYPES", "BF16_MIN_SPEEDUP", "autocast_for", "cpu_bf16_speedup", "cpu_has_native_bf16",
           "measure_cpu_bf16_speedup", "precision_cache_path", "resolve_precision"]
