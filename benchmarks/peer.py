"""speculators 0.9.0's trainer as the peer of eyrie's benchmarks (training_gpu.py, quality.py): its
offline data format made from eyrie's shards, the settings it resolves, and its run under torchrun.

No CLI: the benchmarks import it from this folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from failure import cause, exit_status  # benchmarks/failure.py, beside this file

HERE = Path(__file__).resolve().parent

# The settings of speculators' run that the benchmarks report (its defaults for the rest).
REPORTED = (
    "optimizer",
    "lr",
    "weight_decay",
    "scheduler_type",
    "loss_fn",
    "loss_implementation",
    "draft_attn_impl",
    "hidden_states_dtype",
    "num_workers",
    "prefetch_factor",
    "log_freq",
    "norm_before_fc",
    "norm_output",
    "norm_before_residual",
    "sliding_window",
    "full_attention_indices",
    "total_seq_len",
    "train_data_ratio",
    "ttt_steps",
    "ttt_step_loss_decay",
    "epochs",
    "max_steps",
    "seed",
)


def convert_shards(shards: list[Path], d2t: torch.Tensor, t2d: torch.Tensor, out: Path) -> dict:
    """speculators' offline format, read from eyrie's shards: hidden_states/hs_<i>.safetensors
    (`hidden_states` [T, n_aux + 1, H] in the shard's values as bf16, `token_ids` [T]), an Arrow
    dataset (input_ids, loss_mask, seq_len; torch format) and d2t/t2d .npy. Samples keep the
    shards' order."""
    from datasets import Dataset
    from safetensors.torch import save_file

    from eyrie.formats.hidden import ShardReader

    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    i = 0
    for path in shards:
        with ShardReader(path) as reader:
            n_aux, H = len(reader.meta.aux_layer_ids), reader.meta.hidden_size
            for s in range(len(reader)):
                x = reader.read(s)
                T = x["input_ids"].shape[0]
                hs = torch.cat(
                    [x["aux_hidden"].reshape(T, n_aux, H), x["final_hidden"][:, None]], 1
                ).to(torch.bfloat16)
                save_file(
                    {"hidden_states": hs.contiguous(), "token_ids": x["input_ids"].clone()},
                    str(out / "hidden_states" / f"hs_{i}.safetensors"),
                )
                rows["input_ids"].append(x["input_ids"].tolist())
                rows["loss_mask"].append(x["loss_mask"].to(torch.int64).tolist())
                rows["seq_len"].append(T)
                i += 1
    ds = Dataset.from_dict(rows)
    ds.set_format(type="torch")
    ds.save_to_disk(str(out))
    V = int(d2t.shape[0])
    np.save(out / f"d2t-{V}.npy", d2t.numpy())
    np.save(out / f"t2d-{V}.npy", t2d.numpy())
    return {
        "data_path": out,
        "d2t": out / f"d2t-{V}.npy",
        "t2d": out / f"t2d-{V}.npy",
        "samples": i,
        "tokens": sum(rows["seq_len"]),
    }


def resolved(flags: list[str]):
    """speculators' own resolution of `flags` (its defaults for the rest), as its CLI's args."""
    import argparse

    from speculators.train.config import TrainConfig

    return argparse.Namespace(**TrainConfig.resolve(flags).flatten())


def train_loader(a, hidden: int, n_aux: int):
    """speculators' own train loader for the resolved args `a` (no workers: on the CPU, in this
    process), as its trainer would build it."""
    import speculators.train.cli as cli
    from hs_connectors import HiddenStatesBackend
    from speculators.models.eagle3.data import shift_batch

    transfer = HiddenStatesBackend.registry[a.hidden_states_backend].from_train_args(a, a.data_path)
    loader, _ = cli.create_train_val_loaders(
        data_path=a.data_path,
        total_seq_len=a.total_seq_len,
        hidden_states_dtype=torch.bfloat16,
        transfer=transfer,
        vllm_endpoint=a.vllm_endpoint,
        on_missing=a.on_missing,
        verifier_name_or_path=a.verifier_name_or_path,
        request_timeout=a.request_timeout,
        max_retries=a.max_retries,
        generation_validation_retries=a.generation_validation_retries,
        max_consecutive_generation_failures=a.max_consecutive_generation_failures,
        hidden_size=hidden,
        num_target_layers=n_aux,
        num_workers=0,
        prefetch_factor=None,
        preprocess=shift_batch,
        train_data_ratio=a.train_data_ratio,
        seed=a.seed,
    )
    return loader


def settings(flags: list[str]) -> dict:
    """The settings speculators resolves from `flags` (its defaults for the rest), those in
    REPORTED."""
    args = vars(resolved(flags))
    return {k: args[k] for k in REPORTED if k in args}


def run(flags: list[str], root: Path, record: Path, timeout: float) -> tuple:
    """`torchrun --nproc-per-node 1 speculators_launch.py record -- flags` in `root` on GPU 0:
    (the finished process, its wall seconds). The log is root/speculators.log."""
    t0 = time.perf_counter()
    proc = wait(start(flags, root, record), root, timeout)
    return proc, time.perf_counter() - t0


def start(flags: list[str], root: Path, record: Path) -> subprocess.Popen:
    """The same run, started: its output goes to root/speculators.log."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        str(HERE / "speculators_launch.py"),
        str(record),
        "--",
        *flags,
    ]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    root.mkdir(parents=True, exist_ok=True)
    # appended: a resumed run counts the steps logged before it (quality.py reads them all)
    log = open(root / "speculators.log", "a")  # noqa: SIM115 (the child writes it until `wait`)
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def wait(proc: subprocess.Popen, root: Path, timeout: float) -> subprocess.CompletedProcess:
    """The started run, finished: its status, with root/speculators.log as its output."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    proc.log.close()
    text = (root / "speculators.log").read_text()
    return subprocess.CompletedProcess(proc.args, code, text, "")


def failure(proc) -> str:
    """One line for a failed speculators run: its exit status and its cause line
    (benchmarks/failure.py: the root error, not torchrun's ChildFailedError around it)."""
    said = cause(proc.stdout + proc.stderr) or "no error line in speculators.log"
    return f"{exit_status(proc.returncode)}: {said}"
