"""Start and join the processes of a multi-process training run (torchrun + DDP).

Contract: `eyrie train` with more than one process, started outside torchrun, re-executes itself
under `python -m torch.distributed.run` (`launch_command`, a pure function of the arguments and
the environment: `--standalone` on one node, one torchrun per node through `srun` inside a SLURM
allocation otherwise) and returns torchrun's exit status. Each worker finds its place from
torchrun's environment (`Dist.from_env`) and joins the process group (`Dist.start`: nccl on
CUDA, gloo on CPU). Launching: docs/training.md.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping

from eyrie.core.errors import EyrieError

log = logging.getLogger(__name__)


DEFAULT_RDZV_PORT = 29400  # c10d's own default; offset by the SLURM job id (see rdzv_port)


# Waits on one rank's file work (the shard scan, a checkpoint, the outputs) may outlast NCCL's
# 10-minute collective timeout; a rank that dies is caught by torchrun, not by this timeout.
IO_TIMEOUT = timedelta(hours=24)


def under_torchrun(env: Mapping[str, str]) -> bool:
    """torchrun sets LOCAL_RANK in every worker; a worker never launches again."""
    return "LOCAL_RANK" in env


def rdzv_port(env: Mapping[str, str]) -> int:
    """MASTER_PORT when set, else 29400 + (SLURM job id mod 1000): two multi-node jobs that share
    a first host rarely collide, and a job's nodes agree without talking."""
    if env.get("MASTER_PORT"):
        return int(env["MASTER_PORT"])
    return DEFAULT_RDZV_PORT + int(env.get("SLURM_JOB_ID", "0")) % 1000


@dataclass(frozen=True)
class Workers:
    """The processes of a run: `nproc` per node (one per GPU) on `nnodes` nodes."""

    nproc: int
    nnodes: int

    def __post_init__(self) -> None:
        if self.nproc < 1 or self.nnodes < 1:
            raise EyrieError(
                f"--nproc-per-node {self.nproc} --nnodes {self.nnodes}: both must be >= 1 "
                "(processes per node = GPUs per node; 1 for a CPU run)"
            )


def launch_command(
    worker_args: list[str],
    workers: Workers,
    env: Mapping[str, str],
    python: str,
    first_host: str | None = None,
) -> list[str]:
    """The argv that runs `python -m eyrie <worker_args>` as nproc*nnodes torchrun workers.

    One node: `python -m torch.distributed.run --standalone --nproc-per-node N --module eyrie ...`.
    Several nodes (inside a SLURM allocation only): `srun --nodes M --ntasks-per-node 1 python -m
    torch.distributed.run --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-id $SLURM_JOB_ID
    --rdzv-endpoint <first_host>:<port> --module eyrie ...`; `first_host` is the allocation's first
    host (`first_slurm_host`).
    """
    nproc, nnodes = workers.nproc, workers.nnodes
    torchrun = [python, "-m", "torch.distributed.run"]
    tail = ["--module", "eyrie", *worker_args]
    if nnodes == 1:
        return [*torchrun, "--standalone", "--nproc-per-node", str(nproc), *tail]
    job = _slurm_job(nnodes, env, first_host)
    # --kill-on-bad-exit: a node whose torchrun fails ends the step instead of leaving the
    # others waiting at the rendezvous until the time limit.
    return [
        *("srun", "--nodes", str(nnodes), "--ntasks-per-node", "1", "--kill-on-bad-exit=1"),
        *torchrun,
        *("--nnodes", str(nnodes), "--nproc-per-node", str(nproc)),
        *("--rdzv-backend", "c10d", "--rdzv-id", job),
        *("--rdzv-endpoint", f"{first_host}:{rdzv_port(env)}"),
        *tail,
    ]


def _slurm_job(nnodes: int, env: Mapping[str, str], first_host: str | None) -> str:
    """The SLURM job id of a multi-node run, once its allocation is known to fit."""
    job = env.get("SLURM_JOB_ID")
    if not job or not env.get("SLURM_JOB_NODELIST"):
        raise EyrieError(
            f"--nnodes {nnodes} needs a SLURM allocation (SLURM_JOB_ID and "
            "SLURM_JOB_NODELIST are not set); run inside sbatch/salloc with "
            f"--nodes {nnodes}, or start torchrun on each node yourself"
        )
    have = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or nnodes)
    if have < nnodes:
        raise EyrieError(
            f"--nnodes {nnodes} but SLURM job {job} has {have} node(s) "
            f"(SLURM_JOB_NUM_NODES); ask the scheduler for {nnodes} nodes"
        )
    if not first_host:
        raise EyrieError(
            f"--nnodes {nnodes}: no first host for SLURM_JOB_NODELIST="
            f"{env['SLURM_JOB_NODELIST']} (scontrol show hostnames gave nothing)"
        )
    return job


def first_slurm_host(nodelist: str) -> str | None:
    """First host of a SLURM node list (`scontrol show hostnames`, which expands `n[01-04]`)."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError) as exc:
        raise EyrieError(
            f"scontrol show hostnames {nodelist} failed ({exc}); multi-node "
            "training needs SLURM's scontrol on PATH"
        ) from exc
    return out[0] if out else None


def relaunch(worker_args: list[str], workers: Workers) -> int:
    """Run this stage again as nproc*nnodes torchrun workers; torchrun's exit status.

    The workers' lines (and torchrun's report of a failed rank) go to this process's stdout and
    stderr, so the rule's log holds them all.
    """
    env, nproc, nnodes = os.environ, workers.nproc, workers.nnodes
    host = (
        first_slurm_host(env["SLURM_JOB_NODELIST"])
        if nnodes > 1 and env.get("SLURM_JOB_NODELIST")
        else None
    )
    cmd = launch_command(worker_args, workers, env, sys.executable, host)
    log.info(
        "starting %d processes (%d per node on %d node(s)): %s",
        nproc * nnodes,
        nproc,
        nnodes,
        shlex.join(cmd),
    )
    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.Popen(cmd)

    def forward(signum, _frame):  # a cancelled job stops the workers, not only this parent
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = proc.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    status = rc if rc >= 0 else 128 - rc  # killed by a signal: the shell's convention
    if status != 0:
        log.error(
            "torchrun exited with status %d; each failing rank wrote its error above "
            "(one line 'rank R/W: ...', or a traceback)",
            status,
        )
    return status


@dataclass
class Dist:
    """This process's place in the run. world == 1: a plain single process (no process group)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    io_group: Any = field(default=None, compare=False, repr=False)  # gloo, IO_TIMEOUT

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Dist":
        env = os.environ if env is None else env
        world = int(env.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        return cls(
            rank=int(env["RANK"]),
            world=world,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world=int(env.get("LOCAL_WORLD_SIZE", "1")),
        )

    @property
    def main(self) -> bool:
        """Rank 0: the only process that writes metrics, checkpoints and outputs."""
        return self.rank == 0

    def start(self, device) -> bool:
        """Join the process group (nccl for a CUDA device, gloo on CPU); True when this call
        created it (and so must destroy it)."""
        import torch.distributed as dist

        if self.world <= 1 or dist.is_initialized():
            return False
        if device.type == "cuda":  # device_id: NCCL binds this rank's GPU at once
            dist.init_process_group(backend="nccl", device_id=device)
        else:
            dist.init_process_group(backend="gloo")
        self.io_group = dist.new_group(backend="gloo", timeout=IO_TIMEOUT)
        return True

    def barrier(self) -> None:
        """Wait for every rank (e.g. for rank 0's checkpoint)."""
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.io_group)

    def all_sum(self, values) -> Any:
        """Elementwise sum of a float64 tensor (on this rank's device) over ranks, in place."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if self.world <= 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.io_group)
        return out

    def from_main(self, obj):
        """Rank 0's `obj` on every rank."""
        if self.world <= 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.io_group)
        return box[0]


def stop(created: bool) -> None:
    """Leave the process group that `Dist.start` created."""
    if created:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
