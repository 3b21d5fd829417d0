"""Precision: `compute.precision` resolved for a device (`auto`, `bf16_if_native`, bf16, fp16, fp32)
and the autocast context it implies. The Trainer runs its steps in it; embedding blocks and evaluation
use `autocast_for` outside the Trainer.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

log = logging.getLogger(__name__)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (x86 AVX512-BF16 or AMX-BF16, read from
    /proc/cpuinfo). Without them oneDNN emulates bf16, and autocast is 2-3x slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_precision(precision: str, device: torch.device) -> str:
    """`compute.precision` -> fp32 | bf16 | fp16.
    auto: bf16 on a CUDA device that supports it, else fp32.
    bf16_if_native: bf16 wherever the hardware runs it natively (that CUDA device, or a CPU with
    AVX512-BF16 / AMX), else fp32."""
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if precision == "auto":
        return "bf16" if cuda_bf16 else "fp32"
    if precision == "bf16_if_native":
        return "bf16" if cuda_bf16 or (device.type == "cpu" and cpu_has_native_bf16()) else "fp32"
    if precision == "bf16" and device.type == "cuda" and not cuda_bf16:
        raise RuntimeError("compute.precision=bf16 but this GPU has no bf16 support; use fp16 or fp32")
    if precision == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        _warn_emulated_bf16()
    return precision


@functools.cache  # once per process: resolve_precision runs at every autocast_for
def _warn_emulated_bf16() -> None:
    log.warning("compute.precision=bf16 on a CPU without AVX512-BF16/AMX: oneDNN emulates bf16, 2-3x slower "
                "than fp32 here (bench/bench_precision.py); set compute.precision=bf16_if_native or fp32")


AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # a resolved precision -> its autocast dtype (fp32: none)


def autocast_for(precision: str, device: torch.device | str):
    """The mixed-precision context of `compute.precision` on `device`, for forward passes outside
    the Trainer (embedding blocks, evaluation); a no-op for fp32. bf16 autocast runs on CPUs too:
    with AVX512-BF16 / AMX a BERT forward is ~2.5x faster than fp32."""
    device = torch.device(device)
    dtype = AMP_DTYPES.get(resolve_precision(precision, device))
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


__all__ = ["AMP_DTYPES", "autocast_for", "cpu_has_native_bf16", "resolve_precision"]
