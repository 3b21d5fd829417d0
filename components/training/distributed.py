"""Process-group plumbing for the shared trainer: torchrun env vars in, (rank, world, device) out.

The trainer calls `init_distributed` itself, so a stage script is the same file with 1 or N
processes. Launching N processes is the caller's job (the Prefect flow):

    cmd = torchrun_command("components.stages.retromae", ["--params", "params.yaml"], nproc=2)
    rc = run_streaming(cmd, env={"OMP_NUM_THREADS": "1"}, log=logger.info)

which runs `python -m torch.distributed.run --standalone --nproc_per_node=2 -m components.stages.retromae ...`.
On several nodes every node runs the same command with the same rendezvous (c10d: the store lives
on `rdzv_endpoint`'s host, and the launchers agree on ranks there):

    torchrun_command(module, [], nproc=8, nnodes=2, rdzv_endpoint="node0:29400", rdzv_id="run-42")
    # -> ... --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=node0:29400 --rdzv-id=run-42 ...

Collectives here never pickle: only tensors travel between ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from components.config_shared import ComputeParams


class DistInfo(NamedTuple):
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """`compute.device` -> torch.device; "auto" is cuda when available, else cpu."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("compute.device=cuda but torch sees no CUDA device (use compute.device=auto or cpu)")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def init_distributed(compute: ComputeParams) -> DistInfo:
    """Read torchrun's RANK/WORLD_SIZE/LOCAL_RANK, init the process group once, pick the device.

    Idempotent: a second call returns the same answer without re-initialising. Without torchrun
    env vars this is a single process (rank 0 of 1) and no process group is created.
    """
    if compute.num_threads > 0:
        torch.set_num_threads(compute.num_threads)
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    device = resolve_device(compute.device, local_rank)
    if world_size == 1 and compute.nproc > 1:
        warnings.warn(
            f"compute.nproc={compute.nproc} but this process was not launched by torchrun; "
            "training with 1 process (launch with distributed.torchrun_command)",
            stacklevel=2,
        )
    if world_size > 1 and not dist.is_initialized():
        backend = compute.ddp_backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl" and device.type != "cuda":
            raise RuntimeError("compute.ddp_backend=nccl needs compute.device=cuda; use gloo on CPU")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend)
    return DistInfo(rank, world_size, local_rank, device)


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def is_rank0() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if not is_dist():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def cleanup() -> None:
    """Destroy the process group (call once at process exit; the trainer does not)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (sum or max); a no-op with one process."""
    if is_dist():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def broadcast_int(value: int, device: torch.device, src: int = 0) -> int:
    """Rank `src`'s int, on every rank (as a tensor: no pickled objects between ranks)."""
    if not is_dist():
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.broadcast(t, src=src)
    return int(t.item())


# ----------------------------------------------------------------------------------------------
# launching
# ----------------------------------------------------------------------------------------------
def torchrun_command(
    module_or_script: str, args: Sequence[str] = (), nproc: int = 1, python: str | None = None, *,
    nnodes: int = 1, rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
) -> list[str]:
    """`python -m torch.distributed.run <rendezvous> --nproc_per_node=N (-m module | script.py) args...`.

    One node without an endpoint: `--standalone`. Else `--nnodes=M` and a c10d rendezvous at
    `rdzv_endpoint` (host:port) under `rdzv_id`, which every node's launcher must share (and no
    other run may use at the same time on that endpoint).
    A path (ends in .py or contains a path separator) is run as a script, anything else as a module.
    torchrun's argparse scans the script's args too: an option that abbreviates two or more of
    torchrun's own (`--log`, `--max`) makes it exit with "ambiguous option", so that is refused here.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1 (got {nproc})")
    if nnodes < 1:
        raise ValueError(f"nnodes must be >= 1 (got {nnodes})")
    _check_script_args(args)
    if nnodes == 1 and not rdzv_endpoint:
        rendezvous = ["--standalone"]
    else:
        if not rdzv_endpoint or not rdzv_id:
            raise ValueError(f"nnodes={nnodes} needs compute.rdzv_endpoint (host:port) and a rendezvous id")
        rendezvous = [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    is_script = module_or_script.endswith(".py") or os.sep in module_or_script or "/" in module_or_script
    target = [module_or_script] if is_script else ["-m", module_or_script]
    return [
        python or sys.executable, "-m", "torch.distributed.run",
        *rendezvous, f"--nproc_per_node={nproc}",
        *target, *map(str, args),
    ]  # fmt: skip


ENV_RDZV_ENDPOINT, ENV_RDZV_ID = "RR_RDZV_ENDPOINT", "RR_RDZV_ID"


def launch_command(compute: ComputeParams, module: str, args: Sequence[str] = (), run_id: str | None = None) -> list[str]:
    """`torchrun_command` from `compute`: nproc per node, nnodes, and for nnodes > 1 the rendezvous.

    Where the rendezvous lives is the cluster's business, not the experiment's (a pod's DNS name,
    a job id), so $RR_RDZV_ENDPOINT / $RR_RDZV_ID (set by infra/prefect/k8s-gpu-multinode-job-
    template.yaml on every pod) take precedence over `compute.rdzv_endpoint` / `compute.rdzv_id`;
    the id falls back to `run_id` (the stage's MLflow run on the launching node)."""
    endpoint = os.environ.get(ENV_RDZV_ENDPOINT) or compute.rdzv_endpoint
    rdzv_id = os.environ.get(ENV_RDZV_ID) or compute.rdzv_id or run_id
    return torchrun_command(module, args, compute.nproc, nnodes=compute.nnodes,
                            rdzv_endpoint=endpoint if compute.nnodes > 1 else None, rdzv_id=rdzv_id)


def _check_script_args(args: Sequence[str]) -> None:
    from torch.distributed.run import get_args_parser

    ours = [o for a in get_args_parser()._actions for o in a.option_strings if o.startswith("--")]
    for arg in map(str, args):
        name = arg.split("=", 1)[0]
        if not name.startswith("--") or name in ours:
            continue
        clash = [o for o in ours if o.startswith(name)]
        if len(clash) > 1:
            raise ValueError(
                f"script option {name!r} abbreviates torchrun options {clash}; torchrun would reject it "
                "as ambiguous. Rename the script option (e.g. a longer, unique name)."
            )


def run_streaming(
    cmd: Sequence[str],
    env: Mapping[str, str] | None = None,
    log: Callable[[str], object] = print,
    cwd: str | os.PathLike | None = None,
) -> int:
    """Run `cmd`, hand each output line (stdout and stderr merged) to `log` as it arrives.

    `env` is merged over the current environment. Returns the exit code; if the caller is
    interrupted, the child is terminated first so no orphan keeps a GPU.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        list(cmd), env=full_env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, errors="replace", bufsize=1,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            log(line.rstrip("\n"))
        return proc.wait()
    except BaseException:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
