"""`eyrie train`: train the EAGLE-3 draft on hidden-state shards (the train stage's entry).

Contract: the arguments name the inputs and outputs (`TrainPaths`) and the `train` settings; with
more than one process (`--nproc-per-node` x `--nnodes`) the command re-executes itself under
torchrun and each worker runs the recipe (`eyrie.train.recipe.TrainRecipe`). Exit status 0 when
training finished, 3 after a planned stop (`--stop-after-steps`). Docs: docs/training.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from eyrie.core.errors import EyrieError
from eyrie.train.inputs import TrainPaths
from eyrie.train.launch import Dist, Workers, relaunch, under_torchrun
from eyrie.train.recipe import TrainRecipe

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, type=Path, help="target model folder")
    parser.add_argument("--preflight", required=True, type=Path, help="preflight.json")
    parser.add_argument("--vocab", required=True, type=Path, help="vocab.safetensors (d2t, t2d)")
    parser.add_argument(
        "--shards", required=True, nargs="+", type=Path, help="hidden-state HDF5 shards"
    )
    parser.add_argument("--out-dir", required=True, type=Path, help="results/<name>/train")
    parser.add_argument("--state-dir", required=True, type=Path, help="results/<name>/train_state")
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="training processes per node, one per GPU (torchrun, started by this command)",
    )
    parser.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="nodes (more than 1: inside a SLURM allocation, through srun)",
    )
    # Planned preemption: checkpoint after this many steps and exit (the next run resumes).
    parser.add_argument("--stop-after-steps", type=int, default=None, help=argparse.SUPPRESS)


def worker_args(args: argparse.Namespace) -> list[str]:
    """The `eyrie ...` arguments that parse back to `args` (what each torchrun worker runs)."""
    out = ["--threads", str(args.threads)] if getattr(args, "threads", None) else []
    out += [
        "train",
        "--target",
        str(args.target),
        "--preflight",
        str(args.preflight),
        "--vocab",
        str(args.vocab),
        "--shards",
        *map(str, args.shards),
        "--out-dir",
        str(args.out_dir),
        "--state-dir",
        str(args.state_dir),
        "--settings",
        json.dumps(args.settings),
        "--nproc-per-node",
        str(args.nproc_per_node),
        "--nnodes",
        str(args.nnodes),
    ]
    if args.stop_after_steps is not None:
        out += ["--stop-after-steps", str(args.stop_after_steps)]
    return out


def run(args: argparse.Namespace) -> int:
    workers = Workers(args.nproc_per_node, args.nnodes)
    if workers.nproc * workers.nnodes > 1 and not under_torchrun(os.environ):
        return relaunch(worker_args(args), workers)
    dist = Dist.from_env()
    if dist.world > 1 and getattr(args, "threads", None):  # --threads is the node's: share it
        from eyrie.core.runtime import set_torch_threads

        set_torch_threads(args.threads, share=dist.local_world)
    paths = TrainPaths(
        args.target, args.preflight, args.vocab, args.shards, args.out_dir, args.state_dir
    )
    try:
        summary = TrainRecipe(paths, args.settings).run(args.stop_after_steps)
    except EyrieError as exc:
        if dist.world > 1:  # which process said it (every rank that fails prints its line)
            raise EyrieError(f"rank {dist.rank}/{dist.world}: {exc}") from exc
        raise
    return 0 if summary is not None else 3
