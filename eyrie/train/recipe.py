"""Train the EAGLE-3 draft (speculators' Eagle3DraftModel) on hidden-state shards, resumably, in
one process or several (torchrun + DistributedDataParallel) with the same result.

Data (`eyrie.train.packing`): every sample of every shard, aligned for EAGLE-3 (`shift_sample`) and
packed into batches ("packs") of at most `max_tokens_per_batch` tokens (`document_ids` keep
samples apart; -1 is padding), in an order shuffled per epoch by a seeded generator. One
optimizer step takes `packs_per_step` consecutive packs of the epoch's plan (a trailing
remainder too small for a step is dropped for that epoch); its loss is the mean of its packs'
losses. The whole plan is a function of the settings and the shards, never of the number of
processes, so a position (epoch, step in epoch) identifies the data exactly and a resumed run
sees the same batches as an uninterrupted one. A background thread (`Prefetcher`) builds the
coming steps' packs while the device trains (on a GPU: pinned, copied on a side stream, hidden
states widened to float32 there); the time the loop still waits for them is logged per step
(metrics.jsonl `data_wait_s`) and summed (train.json `data_wait_fraction`). Device-side metrics
are read at log and checkpoint steps only, so the host waits for the device there and nowhere
else (`wall_s` of a record is exact at those steps).

Processes (docs/training.md): with W processes each rank trains a contiguous 1/W of every
step's packs (rank r: packs r*k .. r*k+k-1, k = packs_per_step / W), accumulating gradients
locally (DDP `no_sync` on all but its last pack) and DDP averages them over ranks: the same
mean gradient as one process accumulating all the packs. Metrics are summed over ranks; only
rank 0 writes metrics, checkpoints and outputs.

State: `--state-dir/<run id>/step_<N>/` (model safetensors, optimizer + scheduler + RNG states,
data position), written atomically every `checkpoint_every` steps and at the end; the run id
hashes the settings that change the weights (packs_per_step included, the number of processes
not) and the identity of every input file. A run restarts from the latest checkpoint of its run
id, under any number of processes that divides packs_per_step.

Shards are checked before the first step (`verify_shards`): every file opens (a truncated HDF5
file fails here), matches the run and, once per run, has only finite stored values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import random
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from eyrie.arch.target import fingerprint, read_config, tokenizer_hash
from eyrie.errors import EyrieError, ShardError
from eyrie.formats.hidden import ShardReader, validate_shard
from eyrie.formats.report import read_report
from eyrie.formats.vocab import read_vocab
from eyrie.io import atomic_path, provenance, write_json
from eyrie.train.checkpoint import (
    _metric_records,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from eyrie.train.config import NOT_IN_RUN_ID, TrainSettings, check_world
from eyrie.train.launch import Dist, stop
from eyrie.train.packing import (
    PackedShards,
    Prefetcher,
    decode_batch,
    epoch_order,
    pack,
)

log = logging.getLogger(__name__)


VERIFIED_MARKER = "shards_verified.json"  # in the run folder: the value scan passed once


def _expectation(preflight_path: Path) -> dict:
    report = read_report(preflight_path)
    target = report.get("target") or {}
    expect = {
        "target_fingerprint": target.get("fingerprint"),
        "tokenizer_hash": target.get("tokenizer_hash"),
        "aux_layer_ids": report.get("aux_layer_ids"),
        "final_layer_id": report.get("final_layer_id"),
        "hidden_size": target.get("hidden_size"),
    }
    names = {
        "target_fingerprint": "target.fingerprint",
        "tokenizer_hash": "target.tokenizer_hash",
        "hidden_size": "target.hidden_size",
    }
    for key, value in expect.items():
        if value is None:
            raise EyrieError(
                f"{preflight_path}: key {names.get(key, key)} missing; rerun eyrie preflight"
            )
    return expect


def verify_shards(paths: list[Path], expect: dict, scan_values: bool, dist: Dist) -> None:
    """Refuse bad shards before any step, all of them in one line with the way to rebuild them.

    Every rank opens every shard: HDF5 compares the file's size with the end address its
    superblock records, so a truncated file fails here; attrs, the run's expected fields and
    the datasets' shapes and offsets are checked too. With `scan_values`, every stored value is
    checked finite (one read of the data, the shards split over the ranks): overwritten bytes
    that form inf/NaN bit patterns are caught. Overwritten bytes that still form finite values
    cannot be told from data without checksums, which the shard format does not have.
    """
    if scan_values:
        log.info(
            "checking every stored value of %d shard(s) before the first step (once per run; "
            "train.verify_shards: false skips it)",
            len(paths),
        )
    problems: list[tuple[int, str]] = []
    for i, path in enumerate(paths):
        try:
            ShardReader(path, expect=expect).close()
            if scan_values and i % dist.world == dist.rank:
                validate_shard(path, check_values=True)
        except ShardError as exc:
            problems.append((i, str(exc)))
    found = sorted({p for part in dist.gather(problems) for p in part})  # same error, every rank
    if found:
        bad = " ".join(str(paths[i]) for i in sorted({i for i, _ in found}))
        raise ShardError(
            "; ".join(msg for _, msg in found) + f" -- to rebuild: delete {bad} and "
            f"rerun snakemake (or: snakemake --force {bad})"
        )


def _file_identity(path: Path, content: bool) -> dict:
    st = path.stat()
    ident = {"name": path.name, "size": st.st_size}
    if content:
        ident["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    else:  # large files: name, size and modification time
        ident["mtime_ns"] = st.st_mtime_ns
    return ident


def run_id(
    cfg: TrainSettings, target: Path, preflight: Path, vocab: Path, shards: list[Path]
) -> str:
    weights = sorted(p for p in target.iterdir() if p.suffix == ".safetensors")
    ident = {
        "settings": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_IN_RUN_ID},
        "target_config": fingerprint(read_config(target)),
        "target_weights": [_file_identity(p, content=False) for p in weights],
        "preflight": _file_identity(preflight, content=True),
        "vocab": _file_identity(vocab, content=True),
        "shards": [_file_identity(p, content=False) for p in shards],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def resolve_device(name: str, dist: Dist | None = None) -> torch.device:
    """cpu, or this process's GPU (cuda:LOCAL_RANK) when CUDA is asked for or `auto` finds it."""
    dist = dist or Dist()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise EyrieError("train.device is cuda but no CUDA device is visible; use auto or cpu")
    if dist.local_world > torch.cuda.device_count():
        raise EyrieError(
            f"{dist.local_world} processes on this node but {torch.cuda.device_count()} "
            "GPU(s) visible (CUDA_VISIBLE_DEVICES); use --nproc-per-node <= GPUs per node"
        )
    torch.cuda.set_device(dist.local_rank)
    return torch.device("cuda", dist.local_rank)


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _schedule(
    plan: list[list[list[int]]],
    steps_per_epoch: list[int],
    P: int,
    k: int,
    rank: int,
    epoch: int,
    step_in_epoch: int,
) -> list[tuple[int, int, list[list[int]], list[list[int]]]]:
    """(epoch, step in epoch, this rank's packs, all packs) of every step from a position on."""
    out = []
    for e in range(epoch, len(plan)):
        for s in range(step_in_epoch if e == epoch else 0, steps_per_epoch[e]):
            packs = plan[e][s * P : (s + 1) * P]
            out.append((e, s, packs[rank * k : (rank + 1) * k], packs))
    return out


def _to_device(
    batch: dict[str, torch.Tensor], device: torch.device, stream: "torch.cuda.Stream | None"
) -> dict[str, torch.Tensor]:
    """A host batch (pinned for CUDA) copied to the device on `stream`, without waiting."""
    if device.type != "cuda":
        return batch
    with torch.cuda.stream(stream):
        return {n: v.to(device, non_blocking=True) for n, v in batch.items()}


def _pack_sums(loss: torch.Tensor, metrics: dict, ttt_steps: int) -> torch.Tensor:
    """One pack's additive device-side metrics, float64 [1 + 3K]: [loss, loss_k.., acc_sum_k..,
    acc_total_k..] (the host knows the token counts from the plan)."""
    K = range(ttt_steps)
    values = [
        loss,
        *(metrics[f"loss_{k}_sum"] for k in K),
        *(metrics[f"full_acc_{k}_sum"] for k in K),
        *(metrics[f"full_acc_{k}_total"] for k in K),
    ]
    return torch.stack([torch.as_tensor(v).detach().to(torch.float64) for v in values])


def _read_pending(
    pending: list[tuple[dict, torch.Tensor, torch.Tensor]], packs: int, ttt_steps: int
) -> list[dict]:
    """The metrics records of steps whose device values were not read yet (one wait)."""
    sums = torch.stack([s for _, s, _ in pending]).tolist()
    norms = torch.stack([g.detach().float() for _, _, g in pending]).tolist()
    records = []
    for (head, _, _), v, norm in zip(pending, sums, norms):
        tokens, loss_tokens = head["tokens"]
        records.append(
            {
                "step": head["step"],
                "epoch": head["epoch"],
                **_step_record([v[0], tokens, loss_tokens, *v[1:]], packs, ttt_steps),
                "lr": head["lr"],
                "grad_norm": norm,
                "data_wait_s": head["data_wait_s"],
                "wall_s": head["wall_s"],
            }
        )
    return records


def _step_record(sums: list[float], packs: int, ttt_steps: int) -> dict:
    """A step's metrics from the sums of its packs over all ranks (loss: mean over packs)."""
    K = ttt_steps
    out = {"loss": sums[0] / packs, "tokens": int(sums[1]), "loss_tokens": int(sums[2])}
    for k in range(K):
        total = sums[3 + 2 * K + k]
        out[f"full_acc_{k}"] = sums[3 + K + k] / total if total else None
        out[f"loss_{k}"] = sums[3 + k] / packs
    return out


def train(
    target: Path,
    preflight: Path,
    vocab: Path,
    shards: list[Path],
    out_dir: Path,
    state_dir: Path,
    settings: dict,
    *,
    stop_after_steps: int | None = None,
    on_step: Callable[[int], None] | None = None,
) -> dict | None:
    """Train (resuming when a checkpoint of the same run exists) and write `out_dir`.

    Under torchrun (WORLD_SIZE > 1) every rank calls this; they join one process group.
    `stop_after_steps`: checkpoint and return None once that many steps are done (a planned
    preemption; the next call resumes). `on_step(step)` is called after each step.
    Returns the train.json summary (on every rank) when training finished.
    """
    cfg = TrainSettings.from_settings(settings)
    dist = Dist.from_env()
    check_world(cfg.packs_per_step, dist.world)
    target, preflight, vocab = Path(target).resolve(), Path(preflight), Path(vocab)
    shards, out_dir, state_dir = [Path(s) for s in shards], Path(out_dir), Path(state_dir)
    if state_dir.resolve().is_relative_to(out_dir.resolve()):
        raise EyrieError(
            f"--state-dir {state_dir} is inside --out-dir {out_dir}; keep them apart "
            "(the output folder is replaced as a whole)"
        )
    device = resolve_device(cfg.device, dist)
    created = dist.start(device)
    try:
        return _train(
            cfg,
            dist,
            device,
            target,
            preflight,
            vocab,
            shards,
            out_dir,
            state_dir,
            settings,
            stop_after_steps,
            on_step,
        )
    finally:
        stop(created)


def _train(
    cfg: TrainSettings,
    dist: Dist,
    device: torch.device,
    target: Path,
    preflight: Path,
    vocab: Path,
    shards: list[Path],
    out_dir: Path,
    state_dir: Path,
    settings: dict,
    stop_after_steps: int | None,
    on_step: Callable[[int], None] | None,
) -> dict | None:
    from speculators.losses import resolve_loss_config

    from eyrie.draft import build_draft

    if not dist.main:  # one copy of the progress lines; warnings and errors from every rank
        log.setLevel(logging.WARNING)
    expect = _expectation(preflight)
    for key, have in (
        ("fingerprint", fingerprint(read_config(target))),
        ("tokenizer_hash", tokenizer_hash(target)),
    ):
        want = expect["target_fingerprint" if key == "fingerprint" else key]
        if have != want:
            raise EyrieError(
                f"{preflight}: target.{key} is {want} but {target} has {have}; "
                "rerun eyrie preflight for this target"
            )
    rid = dist.from_main(run_id(cfg, target, preflight, vocab, shards))  # one run on all ranks
    run_dir = state_dir / rid
    marker = run_dir / VERIFIED_MARKER
    verify_shards(shards, expect, cfg.verify_shards and not marker.is_file(), dist)
    if dist.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in run_dir.glob(".step_*.tmp-*"):  # a checkpoint cut short by a kill
            shutil.rmtree(stale, ignore_errors=True)
        if cfg.verify_shards and not marker.is_file():
            write_json(marker, {"shards": [str(s) for s in shards]})

    gap, P = cfg.ttt_steps - 1, cfg.packs_per_step
    k = P // dist.world  # packs of each step that this rank trains
    data = PackedShards(
        shards, expect, cfg.max_tokens_per_batch, gap, values_checked=cfg.verify_shards
    )
    d2t, t2d = read_vocab(vocab)
    plan = [
        pack(data.lengths, epoch_order(len(data), cfg.seed, e), cfg.max_tokens_per_batch, gap)
        for e in range(cfg.epochs)
    ]
    steps_per_epoch = [len(p) // P for p in plan]
    total_steps, dropped = sum(steps_per_epoch), sum(len(p) % P for p in plan)
    if total_steps == 0:
        raise EyrieError(
            f"train.packs_per_step is {P} but an epoch packs into only "
            f"{max(len(p) for p in plan)} batches of train.max_tokens_per_batch="
            f"{cfg.max_tokens_per_batch} tokens: no whole step; lower either"
        )
    log.info(
        "%d samples (%d skipped without loss tokens, %d truncated to %d tokens) from %d shards; "
        "%d steps of %d packs over %d epochs (%d trailing packs dropped); %d process(es); run %s "
        "on %s",
        len(data),
        data.skipped,
        data.truncated,
        cfg.max_tokens_per_batch - gap,
        len(shards),
        total_steps,
        P,
        cfg.epochs,
        dropped,
        dist.world,
        rid,
        device,
    )

    # On a GPU speculators' own attention (flex, block-sparse over the packed documents and TTT
    # steps): measured on an H200 (BENCHMARKS.md), 1.18x the tokens/s of dense-mask sdpa at 4096
    # tokens per pack. FlexAttention has no backward on a CPU, where sdpa stays.
    cuda = device.type == "cuda"
    attn = "simple_flex_attention" if cuda else "sdpa"
    model = build_draft(
        target,
        expect["aux_layer_ids"],
        d2t,
        t2d,
        num_layers=cfg.num_layers,
        draft_arch=cfg.draft_arch,
        norm_before_residual=cfg.norm_before_residual,
        ttt_steps=cfg.ttt_steps,
        seed=cfg.seed,
        attn_impl=attn,
    ).to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, total_steps)
    )
    loss_config = resolve_loss_config("kl_div", "eager")

    metrics_path = run_dir / "metrics.jsonl"
    position = {
        "step": 0,
        "epoch": 0,
        "step_in_epoch": 0,
        "tokens": 0,
        "wall_s": 0.0,
        "run_id": rid,
    }
    ckpt = dist.from_main(str(latest_checkpoint(run_dir) or "") if dist.main else None)
    if ckpt:
        if not (Path(ckpt) / "position.json").is_file():
            raise EyrieError(
                f"rank {dist.rank}: rank 0 resumes from {ckpt}, which this node does not "
                "see; put --state-dir on a filesystem that every node shares"
            )
        position = load_checkpoint(Path(ckpt), model, optimizer, scheduler)
        log.info(
            "resumed from %s (step %d, epoch %d, step %d of the epoch)",
            ckpt,
            position["step"],
            position["epoch"],
            position["step_in_epoch"],
        )
        if dist.main:
            lines = _metric_records(
                metrics_path, position["step"]
            )  # drop steps after the checkpoint
            with atomic_path(metrics_path) as tmp:
                tmp.write_text("".join(f"{ln}\n" for ln in lines))
    else:
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        if dist.main:
            metrics_path.unlink(missing_ok=True)
    resumed_from = position["step"]
    net = model
    if dist.world > 1:  # after loading: DDP starts from rank 0's (identical) weights
        from torch.nn.parallel import DistributedDataParallel

        # The compiled draft (on a GPU) would otherwise be split into graphs at DDP's bucket
        # boundaries, fused differently from one process's: on an H200, 1 and 2 GPUs on the same
        # global batch ended 0.012 apart in weights. Unsplit, the kernels are a single process's
        # (whose steps repeat bit for bit run to run) and the weights were identical, at 1.89x
        # the tokens/s of one GPU (BENCHMARKS.md).
        torch._dynamo.config.optimize_ddp = False
        net = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)

    schedule = _schedule(
        plan, steps_per_epoch, P, k, dist.rank, position["epoch"], position["step_in_epoch"]
    )
    copy_stream = torch.cuda.Stream(device) if cuda else None
    started = time.monotonic()
    wall0 = position["wall_s"]
    window: list[dict] = []
    # Steps whose device-side values (loss sums, grad norm) are not read yet: read at log and
    # checkpoint steps only, so the host does not wait for the device after every step.
    pending: list[tuple[dict, torch.Tensor, torch.Tensor]] = []
    waited = 0.0  # seconds this process was blocked getting batches (summary: data_wait_fraction)
    # bfloat16 autocast (weights and optimizer state stay float32; losses and softmax in float32),
    # what speculators' trainer does on a GPU; float32 throughout on a CPU unless asked
    bf16 = cfg.precision == "bfloat16" or (cfg.precision == "auto" and cuda)
    # The draft's forward is compiled on a GPU (speculators' model class) and recompiles for every
    # new pack length; past dynamo's recompile limit it runs uncompiled (measured on an H200: 0.6-0.9
    # s per step against speculators' 0.17 s at one padded shape). Fixed: every pack padded to
    # max_tokens_per_batch positions, outside the loss (tests/test_train.py: same loss).
    fixed = cfg.pack_shape == "fixed" or (cfg.pack_shape == "auto" and cuda)
    pad_to = cfg.max_tokens_per_batch if fixed else None
    with contextlib.ExitStack() as stack:
        stack.callback(data.close)
        metrics_file = stack.enter_context(metrics_path.open("a")) if dist.main else None
        # closed before data (ExitStack: last in, first out)
        loader = stack.enter_context(
            Prefetcher(
                data,
                [mine for _, _, mine, _ in schedule],
                pin=cuda,
                dtype=data.transfer_dtype if cuda else torch.float32,
                pad_to=pad_to,
            )
        )

        def stage() -> tuple[list[dict], float]:
            """The next step's batches, copies to the device under way; seconds blocked."""
            t = time.perf_counter()
            batches = [_to_device(b, device, copy_stream) for b in loader.get()]
            return batches, time.perf_counter() - t

        staged = stage() if schedule else None
        for n, (e, s, mine, packs) in enumerate(schedule):
            batches, wait = staged
            waited += wait
            if cuda:  # the copies (on copy_stream) complete before the step reads them
                torch.cuda.current_stream(device).wait_stream(copy_stream)
                for b in batches:
                    for v in b.values():
                        v.record_stream(torch.cuda.current_stream(device))
            optimizer.zero_grad(set_to_none=True)
            sums = torch.zeros(1 + 3 * cfg.ttt_steps, dtype=torch.float64, device=device)
            for j, batch in enumerate(batches):
                batch = decode_batch(
                    batch
                )  # float8 codes (GPU transfers) to float32, on the device
                if not bf16:  # under bfloat16 autocast the layers take the stored bf16 as it is
                    batch = {
                        n_: (v.float() if v.is_floating_point() else v) for n_, v in batch.items()
                    }
                # DDP averages gradients over ranks at the backward of a rank's last pack only
                sync = net is model or j == k - 1
                with (
                    contextlib.nullcontext() if sync else net.no_sync(),
                    torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16),
                ):
                    _, loss, metrics = net(
                        **batch,
                        ttt_steps=cfg.ttt_steps,
                        ttt_step_loss_decay=cfg.ttt_step_loss_decay,
                        loss_config=loss_config,
                    )
                    (loss / k if k > 1 else loss).backward()
                sums += _pack_sums(loss, metrics, cfg.ttt_steps)
            dist.all_sum(sums)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            if n + 1 < len(schedule):  # read while the device still works on this step
                staged = stage()
            tokens = [
                sum(t) for t in zip(*(data.tokens(p) for p in packs))
            ]  # [tokens, loss tokens]
            position.update(
                step=position["step"] + 1,
                epoch=e,
                step_in_epoch=s + 1,
                tokens=position["tokens"] + tokens[0],
                wall_s=wall0 + time.monotonic() - started,
            )
            step = position["step"]
            pending.append(
                (
                    {
                        "step": step,
                        "epoch": e,
                        "tokens": tokens,
                        "lr": scheduler.get_last_lr()[0],
                        "data_wait_s": wait,
                        "wall_s": position["wall_s"],
                    },
                    sums,
                    grad_norm,
                )
            )
            stopping = (
                stop_after_steps is not None and step >= stop_after_steps and step < total_steps
            )
            log_now = step % cfg.log_every == 0 or step == total_steps
            if log_now or step % cfg.checkpoint_every == 0 or stopping:
                records = _read_pending(pending, P, cfg.ttt_steps)  # waits for the device
                position["wall_s"] = records[-1]["wall_s"] = wall0 + time.monotonic() - started
                pending.clear()
                if metrics_file is not None:
                    metrics_file.write("".join(json.dumps(r) + "\n" for r in records))
                    metrics_file.flush()
                window = (window + records)[-cfg.log_every :]
            if log_now:
                accs = " ".join(
                    f"acc{t}={_fmt(_mean(window, f'full_acc_{t}'))}" for t in range(cfg.ttt_steps)
                )
                log.info(
                    "step %d/%d epoch %d loss %s %s lr %.2e %.0f tok/s (data wait %.1f%%)",
                    step,
                    total_steps,
                    e,
                    _fmt(_mean(window, "loss")),
                    accs,
                    window[-1]["lr"],
                    position["tokens"] / max(position["wall_s"], 1e-9),
                    100 * waited / max(time.monotonic() - started, 1e-9),
                )
            if step % cfg.checkpoint_every == 0 or step == total_steps or stopping:
                if dist.main:
                    save_checkpoint(
                        run_dir,
                        model,
                        optimizer,
                        scheduler,
                        {**position, "packs_per_step": P, "world_size": dist.world},
                    )
                dist.barrier()
            if on_step is not None:
                on_step(step)
            if stopping:
                log.info("stopping after step %d as asked; rerun to resume", step)
                return None
    loop_s = time.monotonic() - started
    position.update(epoch=cfg.epochs, step_in_epoch=0)
    timing = {
        "data_wait_s": waited,
        "steps_wall_s": loop_s,
        # of this process's steps (not those before a resume): time blocked on batches
        "data_wait_fraction": waited / loop_s if loop_s > 0 else 0.0,
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
    }

    summary = None
    if dist.main:
        records = [json.loads(ln) for ln in metrics_path.read_text().splitlines()]
        summary = _summary(
            cfg,
            dist,
            records,
            position,
            total_steps,
            dropped,
            resumed_from,
            data,
            device,
            expect,
            target,
            preflight,
            vocab,
            shards,
            settings,
            timing,
        )
        write_outputs(out_dir, model, records, summary, cfg.ttt_steps)
        log.info(
            "wrote %s: final loss %s, accuracy per TTT step %s",
            out_dir,
            _fmt(summary["final"]["loss"]),
            [_fmt(a) for a in summary["final"]["full_acc"]],
        )
    return dist.from_main(summary)  # the other ranks wait here until the outputs are written


def _summary(
    cfg: TrainSettings,
    dist: Dist,
    records: list[dict],
    position: dict,
    total_steps: int,
    dropped: int,
    resumed_from: int,
    data: PackedShards,
    device: torch.device,
    expect: dict,
    target: Path,
    preflight: Path,
    vocab: Path,
    shards: list[Path],
    settings: dict,
    timing: dict,
) -> dict:
    last = records[-cfg.log_every :]
    return {
        "steps": total_steps,
        "epochs": cfg.epochs,
        "samples": len(data),
        "skipped_samples": data.skipped,
        "truncated_samples": data.truncated,
        "packs_per_step": cfg.packs_per_step,
        "dropped_packs": dropped,
        "world_size": dist.world,
        "tokens": position["tokens"],
        "final": {
            "loss": _mean(last, "loss"),
            "full_acc": [_mean(last, f"full_acc_{k}") for k in range(cfg.ttt_steps)],
            "over_last_steps": len(last),
        },
        "wall_time_s": position["wall_s"],
        "tokens_per_s": position["tokens"] / max(position["wall_s"], 1e-9),
        **timing,
        "resumed_from_step": resumed_from,
        "run_id": position["run_id"],
        "device": str(device),
        "target": {
            "path": str(target),
            "fingerprint": expect["target_fingerprint"],
            "tokenizer_hash": expect["tokenizer_hash"],
            "hidden_size": expect["hidden_size"],
        },
        "aux_layer_ids": expect["aux_layer_ids"],
        "final_layer_id": expect["final_layer_id"],
        "inputs": {
            "preflight": str(preflight),
            "vocab": str(vocab),
            "shards": [str(s) for s in shards],
        },
        "provenance": provenance(settings),
    }


def write_outputs(out_dir: Path, model, records: list[dict], summary: dict, ttt_steps: int) -> None:
    """out_dir/{draft/, metrics.jsonl, curves.png, train.json}, replaced as a whole."""
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        model.to("cpu").save_pretrained(tmp / "draft")
        (tmp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        plot_curves(records, ttt_steps, tmp / "curves.png")
        write_json(tmp / "train.json", summary)


def _mean(records: list[dict], key: str) -> float | None:
    """Mean of `key` over records that have it (accuracy is None for a step without targets)."""
    values = [r[key] for r in records if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def plot_curves(records: list[dict], ttt_steps: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [r["loss"] for r in records], lw=1)
    ax_loss.set(xlabel="step", ylabel="loss (sum over TTT steps)", title="training loss")
    for k in range(ttt_steps):
        pts = [
            (r["step"], r[f"full_acc_{k}"]) for r in records if r.get(f"full_acc_{k}") is not None
        ]
        ax_acc.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, label=f"TTT step {k}")
    ax_acc.set(
        xlabel="step",
        ylabel="accuracy (all previous steps correct)",
        ylim=(0, 1),
        title="draft accuracy vs target argmax",
    )
    ax_acc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
