"""The training recipe: the EAGLE-3 draft trained on hidden-state shards, as one flat class.

`TrainRecipe(paths, settings).run()` goes setup -> train (one `train_step` per optimizer step,
`checkpoint` every `checkpoint_every` steps) -> cleanup -> finish (the outputs). Contract: the plan
of packs is a function of the settings and the shards alone, never of the number of processes, so
a position (epoch, step in epoch) names the data exactly and a resumed run ends with the weights of
an uninterrupted one; under torchrun every rank runs the recipe, and only rank 0 writes metrics,
checkpoints and outputs. Steps, processes, resume and the shard checks: docs/training.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from eyrie.arch.target import fingerprint, read_config, tokenizer_hash
from eyrie.config.sections import TrainSettings, check_world
from eyrie.core.errors import EyrieError, ShardError
from eyrie.core.io import provenance, write_json
from eyrie.core.rehearsal import is_rehearsal, mark, refusal
from eyrie.core.runtime import auto_device
from eyrie.formats.hidden import ShardReader, read_meta, validate_shard
from eyrie.formats.report import shard_expectation
from eyrie.formats.vocab import read_vocab
from eyrie.train.checkpoint import (
    Checkpoint,
    CheckpointProblem,
    Checkpoints,
    restore,
    run_id,
    truncate_metrics,
)
from eyrie.train.curves import Curves, Scalars
from eyrie.train.launch import Dist, stop
from eyrie.train.metrics import fmt, mean, pack_sums, read_pending, write_outputs
from eyrie.train.packing import BatchSpec, PackedShards, Plan, Prefetcher, decode_batch

log = logging.getLogger(__name__)


VERIFIED_MARKER = "shards_verified.json"  # in the run folder: the value scan passed once


@dataclass
class TrainPaths:
    """The files a run reads and the folders it writes (`eyrie train`'s path arguments)."""

    target: Path  # the target model folder (resolved: its path goes into train.json)
    preflight: Path  # preflight.json
    vocab: Path  # vocab.safetensors (d2t, t2d)
    shards: list[Path]  # hidden-state HDF5 shards
    out_dir: Path  # draft/, metrics.jsonl, curves.png, tensorboard/, train.json; replaced whole
    state_dir: Path  # <run id>/step_<N>/ checkpoints, the run's metrics.jsonl and tensorboard/

    def __post_init__(self) -> None:
        self.target = Path(self.target).resolve()
        self.preflight, self.vocab = Path(self.preflight), Path(self.vocab)
        self.shards = [Path(s) for s in self.shards]
        self.out_dir, self.state_dir = Path(self.out_dir), Path(self.state_dir)

    def check_apart(self) -> None:
        """Refuse a state folder inside the output folder (which is replaced as a whole)."""
        if self.state_dir.resolve().is_relative_to(self.out_dir.resolve()):
            raise EyrieError(
                f"--state-dir {self.state_dir} is inside --out-dir {self.out_dir}; keep them apart "
                "(the output folder is replaced as a whole)"
            )


@dataclass
class LoopState:
    """What the loop carries from step to step; `position` is what a checkpoint saves."""

    position: dict  # step, epoch, step_in_epoch, tokens, wall_s, run_id
    started: float  # time.monotonic() when this process's loop began
    wall0: float  # wall_s of the steps before this process (a resumed run's)
    waited: float = 0.0  # seconds blocked getting batches (train.json data_wait_fraction)
    window: list[dict] = field(default_factory=list)  # the records the log line averages
    # Steps whose device-side values (loss sums, grad norm) are not read yet: read at log and
    # checkpoint steps only, so the host does not wait for the device after every step.
    pending: list[tuple[dict, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def wall_s(self) -> float:
        return self.wall0 + time.monotonic() - self.started


def train(
    paths: TrainPaths,
    settings: dict,
    *,
    stop_after_steps: int | None = None,
    on_step: Callable[[int], None] | None = None,
) -> dict | None:
    """Train (resuming when a checkpoint of the same run exists) and write `paths.out_dir`.

    Under torchrun (WORLD_SIZE > 1) every rank calls this; they join one process group.
    `stop_after_steps`: checkpoint and return None once that many steps are done (a planned
    preemption; the next call resumes). `on_step(step)` is called after each step. Returns the
    train.json summary (on every rank) when training finished.
    """
    return TrainRecipe(paths, settings).run(stop_after_steps, on_step)


class TrainRecipe:
    """One training run: setup, train (train_step, checkpoint), cleanup, finish."""

    def __init__(self, paths: TrainPaths, settings: dict):
        self.paths, self.settings = paths, settings
        self.cfg = cfg = TrainSettings.from_settings(settings)
        self.rehearsal = is_rehearsal(settings)  # vllm.rehearsal: may train on rehearsal shards
        self.dist = Dist.from_env()
        check_world(cfg.packs_per_step, self.dist.world)
        paths.check_apart()
        self.device = resolve_device(cfg.device, self.dist)
        self.cuda = self.device.type == "cuda"
        # bfloat16 autocast (weights and optimizer state stay float32; losses and softmax in
        # float32), what speculators' trainer does on a GPU; float32 throughout on a CPU
        self.bf16 = cfg.precision == "bfloat16" or (cfg.precision == "auto" and self.cuda)
        # One padded pack shape on a GPU: the compiled draft compiles once instead of once per
        # pack length (docs/training.md); the padding is outside the loss.
        fixed = cfg.pack_shape == "fixed" or (cfg.pack_shape == "auto" and self.cuda)
        self.pad_to = cfg.max_tokens_per_batch if fixed else None
        self.k = cfg.packs_per_step // self.dist.world  # packs of each step that this rank trains
        self._stack = contextlib.ExitStack()  # the shards, the metrics file and curves, the loader

    def run(
        self,
        stop_after_steps: int | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> dict | None:
        """The whole run in this process's group; the summary, or None when stopped early."""
        created = self.dist.start(self.device)
        try:
            self.setup()
            done = self.train(stop_after_steps, on_step)
            self.cleanup()  # the loader, metrics file and shards close before the outputs
            return self.finish() if done else None
        finally:
            self.cleanup()
            stop(created)

    # ------------------------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Inputs checked, the data planned, the draft built and restored: all before step 1."""
        if not self.dist.main:  # one copy of the progress lines; warnings and errors from all
            log.setLevel(logging.WARNING)
        self.expect = self._check_target()
        auto = self.cfg.learning_rate == "auto"
        self.cfg = self.cfg.resolved_for(self.expect["hidden_size"])
        if auto:
            log.info(
                "learning rate %.3g (train.learning_rate: auto, for the target's hidden size %d)",
                self.cfg.learning_rate,
                self.expect["hidden_size"],
            )
        check_rehearsal(self.paths.shards, self.rehearsal)
        self._open_run()
        self.data = PackedShards(
            self.paths.shards,
            self.expect,
            self.cfg.max_tokens_per_batch,
            self.cfg.ttt_steps - 1,
            values_checked=self.cfg.verify_shards,
        )
        self._stack.callback(self.data.close)
        d2t, t2d = read_vocab(self.paths.vocab)
        self.plan = self._plan()
        self._build_model(d2t, t2d)
        self.checkpoints = Checkpoints(self.run_dir, self.rid, self.plan.steps_per_epoch)
        position = self._restore()
        self.resumed_from = position["step"]
        self.net = self._wrap_ddp()
        self.schedule = self.plan.steps_from(
            position["epoch"], position["step_in_epoch"], self.dist.rank, self.k
        )
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.state = LoopState(position, started=time.monotonic(), wall0=position["wall_s"])

    def _check_target(self) -> dict:
        """The preflight report's expectations, checked against the target folder."""
        p = self.paths
        expect = shard_expectation(p.preflight)
        for key, have in (
            ("fingerprint", fingerprint(read_config(p.target))),
            ("tokenizer_hash", tokenizer_hash(p.target)),
        ):
            want = expect["target_fingerprint" if key == "fingerprint" else key]
            if have != want:
                raise EyrieError(
                    f"{p.preflight}: target.{key} is {want} but {p.target} has {have}; "
                    "rerun eyrie preflight for this target"
                )
        return expect

    def _open_run(self) -> None:
        """The run id (rank 0's, on all ranks), the shards checked, the run folder made."""
        cfg, dist, p = self.cfg, self.dist, self.paths
        self.rid = dist.from_main(run_id(cfg, p.target, p.preflight, p.vocab, p.shards))
        self.run_dir = p.state_dir / self.rid
        self.metrics_path = self.run_dir / "metrics.jsonl"
        marker = self.run_dir / VERIFIED_MARKER
        verify_shards(p.shards, self.expect, cfg.verify_shards and not marker.is_file(), dist)
        if dist.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for stale in self.run_dir.glob(".step_*.tmp-*"):  # a checkpoint cut short by a kill
                shutil.rmtree(stale, ignore_errors=True)
            if cfg.verify_shards and not marker.is_file():
                write_json(marker, {"shards": [str(s) for s in p.shards]})

    def _plan(self) -> Plan:
        cfg, data = self.cfg, self.data
        plan = Plan.build(data, cfg.seed, cfg.epochs, cfg.packs_per_step)
        if plan.total_steps == 0:
            raise EyrieError(
                f"train.packs_per_step is {cfg.packs_per_step} but an epoch packs into only "
                f"{max(len(p) for p in plan.epochs)} batches of train.max_tokens_per_batch="
                f"{cfg.max_tokens_per_batch} tokens: no whole step; lower either"
            )
        log.info(
            "%d samples (%d skipped without loss tokens, %d truncated to %d tokens) from %d "
            "shards; %d steps of %d packs over %d epochs (%d trailing packs dropped); "
            "%d process(es); run %s on %s",
            len(data),
            data.skipped,
            data.truncated,
            cfg.max_tokens_per_batch - data.gap,
            len(self.paths.shards),
            plan.total_steps,
            cfg.packs_per_step,
            cfg.epochs,
            plan.dropped,
            self.dist.world,
            self.rid,
            self.device,
        )
        return plan

    def _build_model(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """The draft on the device, its AdamW optimizer, LR schedule and loss."""
        from speculators.losses import resolve_loss_config

        from eyrie.arch.draft import DraftSpec, build_draft

        cfg = self.cfg
        # speculators' flex attention on a GPU (a block mask over the packed documents and TTT
        # steps); FlexAttention has no backward on a CPU, where sdpa stays.
        spec = DraftSpec(
            self.expect["aux_layer_ids"],
            num_layers=cfg.num_layers,
            draft_arch=cfg.draft_arch,
            norm_before_residual=cfg.norm_before_residual,
            norm_before_fc=cfg.norm_before_fc,
            ttt_steps=cfg.ttt_steps,
            attn_impl="simple_flex_attention" if self.cuda else "sdpa",
            random_verifier=self.rehearsal,  # the target's weights need not be on disk yet
        )
        self.model = build_draft(self.paths.target, spec, d2t, t2d, seed=cfg.seed).to(self.device)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay
        )
        total = self.plan.total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg.warmup_steps, total, cfg.lr_schedule)
        )
        self.loss_config = resolve_loss_config(cfg.loss, "eager")

    def _restore(self) -> dict:
        """The position to start from: the newest checkpoint that verifies, or a fresh seeded
        start. Rank 0 verifies and picks; every rank reads that one (the same on all ranks)."""
        dist = self.dist
        found = self.checkpoints.newest_good(self.model, self.optimizer) if dist.main else None
        picked = dist.from_main(str(found.path) if found else "")
        if picked:
            return self._resume(found or self._read_picked(Path(picked)))
        random.seed(self.cfg.seed)
        np.random.seed(self.cfg.seed)
        torch.manual_seed(self.cfg.seed)
        if dist.main:
            self.metrics_path.unlink(missing_ok=True)
        return {
            "step": 0,
            "epoch": 0,
            "step_in_epoch": 0,
            "tokens": 0,
            "wall_s": 0.0,
            "run_id": self.rid,
        }

    def _read_picked(self, path: Path) -> Checkpoint:
        """Another rank's read of the checkpoint rank 0 verified."""
        try:
            return self.checkpoints.read(path, self.model, self.optimizer)
        except CheckpointProblem as exc:
            raise EyrieError(
                f"rank {self.dist.rank}: rank 0 resumes from {path}, which this process cannot "
                f"use ({exc}); put --state-dir on a filesystem that every node shares"
            ) from None

    def _resume(self, ckpt: Checkpoint) -> dict:
        position = restore(ckpt, self.model, self.optimizer, self.scheduler)
        log.info(
            "resumed from %s (step %d, epoch %d, step %d of the epoch)",
            ckpt.path,
            position["step"],
            position["epoch"],
            position["step_in_epoch"],
        )
        if self.dist.main:
            truncate_metrics(self.metrics_path, position["step"])
        return position

    def _wrap_ddp(self) -> torch.nn.Module:
        """The module the steps call: the draft, or under several processes its DDP wrapper
        (made after loading: DDP starts from rank 0's, identical, weights)."""
        if self.dist.world <= 1:
            return self.model
        from torch.nn.parallel import DistributedDataParallel

        # Unsplit at DDP's bucket boundaries the compiled draft fuses as in one process, so the
        # weights equal one process's (docs/training.md).
        torch._dynamo.config.optimize_ddp = False
        return DistributedDataParallel(
            self.model, device_ids=[self.device.index] if self.cuda else None
        )

    # ------------------------------------------------------------------------------------ train

    def train(
        self,
        stop_after_steps: int | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> bool:
        """Every planned step from the position on; False when stopped after `stop_after_steps`."""
        self._start_loading()
        total, state = self.plan.total_steps, self.state
        staged = self._stage() if self.schedule else None
        for n, (epoch, s, _, packs) in enumerate(self.schedule):
            batches, wait = staged
            state.waited += wait
            sums, grad_norm = self.train_step(batches)
            if n + 1 < len(self.schedule):  # read while the device still works on this step
                staged = self._stage()
            tokens = [sum(t) for t in zip(*(self.data.tokens(p) for p in packs))]  # [all, loss]
            step = self._advance(epoch, s, tokens[0])
            state.pending.append((self._head(epoch, tokens, wait), sums, grad_norm))
            stopping = stop_after_steps is not None and step >= stop_after_steps and step < total
            self._report(epoch, stopping)
            if step % self.cfg.checkpoint_every == 0 or step == total or stopping:
                self.checkpoint()
            if on_step is not None:
                on_step(step)
            if stopping:
                log.info("stopping after step %d as asked; rerun to resume", step)
                return False
        return True

    def _start_loading(self) -> None:
        """The metrics file and curves (rank 0) and the loader thread, closed by `cleanup`."""
        self.metrics_file = self.curves = None
        if self.dist.main:
            self.metrics_file = self._stack.enter_context(self.metrics_path.open("a"))
            self.curves = self._open_curves()
        spec = BatchSpec(
            dtype=self.data.transfer_dtype if self.cuda else torch.float32,
            pin=self.cuda,
            pad_to=self.pad_to,
        )
        self.loader = self._stack.enter_context(
            Prefetcher(self.data, [mine for _, _, mine, _ in self.schedule], spec=spec)
        )

    def _open_curves(self) -> Curves | None:
        """TensorBoard and W&B curves as train.report_to asks, beside metrics.jsonl."""
        cfg = self.cfg
        if not cfg.report_to:
            return None
        history = [json.loads(ln) for ln in self.metrics_path.read_text().splitlines()]
        curves = Curves.open(
            cfg.report_to,
            self.run_dir,
            Scalars(cfg.ttt_steps, cfg.log_every, self.plan.total_steps),
            history,
            {"train": self.settings["train"], "out_dir": str(self.paths.out_dir)},
        )
        self._stack.callback(curves.close)
        return curves

    def _stage(self) -> tuple[list[dict], float]:
        """The next step's batches, copies to the device under way; seconds blocked."""
        t = time.perf_counter()
        batches = [_to_device(b, self.device, self.copy_stream) for b in self.loader.get()]
        return batches, time.perf_counter() - t

    def train_step(self, batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over this rank's packs: (summed pack metrics, gradient norm)."""
        if self.cuda:  # the copies (on copy_stream) complete before the step reads them
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.copy_stream)
            for b in batches:
                for v in b.values():
                    v.record_stream(current)
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(1 + 3 * self.cfg.ttt_steps, dtype=torch.float64, device=self.device)
        for j, batch in enumerate(batches):
            sums += self._pack_step(j, batch)
        self.dist.all_sum(sums)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        return sums, grad_norm

    def _pack_step(self, j: int, batch: dict) -> torch.Tensor:
        """Forward and backward of this rank's pack j; its additive metrics."""
        cfg, net = self.cfg, self.net
        batch = decode_batch(batch)  # float8 codes (GPU transfers) to float32, on the device
        if not self.bf16:  # under bfloat16 autocast the layers take the stored bf16 as it is
            batch = {n: (v.float() if v.is_floating_point() else v) for n, v in batch.items()}
        if cfg.hidden_noise:  # the draft's input only; the target's distribution stays exact
            batch["hidden_states"] = add_hidden_noise(
                batch["hidden_states"],
                cfg.hidden_noise,
                batch["verifier_last_hidden_states"].shape[-1],
            )
        # DDP averages gradients over ranks at the backward of a rank's last pack only
        sync = net is self.model or j == self.k - 1
        with (
            contextlib.nullcontext() if sync else net.no_sync(),
            torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16),
        ):
            _, loss, metrics = net(
                **batch,
                ttt_steps=cfg.ttt_steps,
                ttt_step_loss_decay=cfg.ttt_step_loss_decay,
                loss_config=self.loss_config,
            )
            (loss / self.k if self.k > 1 else loss).backward()
        return pack_sums(loss, metrics, cfg.ttt_steps)

    def _advance(self, epoch: int, s: int, tokens: int) -> int:
        """The position after step `s` of `epoch`, which trained `tokens`; the step number."""
        position = self.state.position
        position.update(
            step=position["step"] + 1,
            epoch=epoch,
            step_in_epoch=s + 1,
            tokens=position["tokens"] + tokens,
            wall_s=self.state.wall_s(),
        )
        return position["step"]

    def _head(self, epoch: int, tokens: list[int], wait: float) -> dict:
        """The host-side part of the step's metrics record (`tokens`: [all, loss-masked])."""
        position = self.state.position
        return {
            "step": position["step"],
            "epoch": epoch,
            "tokens": tokens,
            "lr": self.scheduler.get_last_lr()[0],
            "data_wait_s": wait,
            "wall_s": position["wall_s"],
        }

    def _report(self, epoch: int, stopping: bool) -> None:
        """Metrics records written at log and checkpoint steps; the progress line at log steps."""
        cfg, state = self.cfg, self.state
        step, total = state.position["step"], self.plan.total_steps
        log_now = step % cfg.log_every == 0 or step == total
        if log_now or step % cfg.checkpoint_every == 0 or stopping:
            records = read_pending(state.pending, cfg.packs_per_step, cfg.ttt_steps)  # waits
            state.position["wall_s"] = records[-1]["wall_s"] = state.wall_s()
            state.pending.clear()
            if self.metrics_file is not None:
                self.metrics_file.write("".join(json.dumps(r) + "\n" for r in records))
                self.metrics_file.flush()
            if self.curves is not None:
                self.curves.add(records)
            state.window = (state.window + records)[-cfg.log_every :]
        if not log_now:
            return
        window = state.window
        accs = " ".join(
            f"acc{t}={fmt(mean(window, f'full_acc_{t}'))}" for t in range(cfg.ttt_steps)
        )
        log.info(
            "step %d/%d epoch %d loss %s %s lr %.2e %.0f tok/s (data wait %.1f%%)",
            step,
            total,
            epoch,
            fmt(mean(window, "loss")),
            accs,
            window[-1]["lr"],
            state.position["tokens"] / max(state.position["wall_s"], 1e-9),
            100 * state.waited / max(time.monotonic() - state.started, 1e-9),
        )

    def checkpoint(self) -> None:
        """Rank 0 writes step_<N>/ (weights, optimizer, scheduler, RNG, position); all wait."""
        if self.dist.main:
            self.checkpoints.save(
                self.model,
                self.optimizer,
                self.scheduler,
                {
                    **self.state.position,
                    "packs_per_step": self.cfg.packs_per_step,
                    "world_size": self.dist.world,
                },
            )
        self.dist.barrier()

    # ---------------------------------------------------------------------- cleanup and finish

    def cleanup(self) -> None:
        """Stop the loader, close the metrics file and the shards (again: a no-op)."""
        self._stack.close()

    def finish(self) -> dict:
        """Rank 0 writes the outputs; the train.json summary, on every rank."""
        state, cfg = self.state, self.cfg
        loop_s = time.monotonic() - state.started
        state.position.update(epoch=cfg.epochs, step_in_epoch=0)
        timing = {
            "data_wait_s": state.waited,
            "steps_wall_s": loop_s,
            # of this process's steps (not those before a resume): time blocked on batches
            "data_wait_fraction": state.waited / loop_s if loop_s > 0 else 0.0,
            "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(self.device)
            if self.cuda
            else None,
        }
        summary = None
        if self.dist.main:
            records = [json.loads(ln) for ln in self.metrics_path.read_text().splitlines()]
            summary = self._summary(records, timing)
            write_outputs(self.paths.out_dir, self.model, records, summary, cfg)
            log.info(
                "wrote %s: final loss %s, accuracy per TTT step %s",
                self.paths.out_dir,
                fmt(summary["final"]["loss"]),
                [fmt(a) for a in summary["final"]["full_acc"]],
            )
        return self.dist.from_main(summary)  # the other ranks wait here for the outputs

    def _summary(self, records: list[dict], timing: dict) -> dict:
        cfg, data, expect, p = self.cfg, self.data, self.expect, self.paths
        position = self.state.position
        last = records[-cfg.log_every :]
        return {
            "steps": self.plan.total_steps,
            "epochs": cfg.epochs,
            "samples": len(data),
            "skipped_samples": data.skipped,
            "truncated_samples": data.truncated,
            "packs_per_step": cfg.packs_per_step,
            "dropped_packs": self.plan.dropped,
            "world_size": self.dist.world,
            "tokens": position["tokens"],
            "final": {
                "loss": mean(last, "loss"),
                "full_acc": [mean(last, f"full_acc_{k}") for k in range(cfg.ttt_steps)],
                "over_last_steps": len(last),
            },
            "wall_time_s": position["wall_s"],
            "tokens_per_s": position["tokens"] / max(position["wall_s"], 1e-9),
            **timing,
            "resumed_from_step": self.resumed_from,
            "run_id": position["run_id"],
            "device": str(self.device),
            "target": {
                "path": str(p.target),
                "fingerprint": expect["target_fingerprint"],
                "tokenizer_hash": expect["tokenizer_hash"],
                "hidden_size": expect["hidden_size"],
            },
            "aux_layer_ids": expect["aux_layer_ids"],
            "final_layer_id": expect["final_layer_id"],
            "learning_rate": cfg.learning_rate,  # the peak rate it trained with (auto resolved)
            "inputs": {
                "preflight": str(p.preflight),
                "vocab": str(p.vocab),
                "shards": [str(s) for s in p.shards],
            },
            "provenance": provenance(self.settings),
            **mark(self.rehearsal),
        }


# ---------------------------------------------------------------------------- inputs and device


def check_rehearsal(paths: list[Path], rehearsal: bool) -> None:
    """A real run refuses a rehearsal's shards (hidden states of random weights), naming the
    first; a rehearsal (`rehearsal`) trains on any."""
    if rehearsal:
        return
    found = [p for p in paths if _rehearsal_shard(p)]
    if found:
        more = f" (and {len(found) - 1} more of the {len(paths)} shards)" if len(found) > 1 else ""
        raise ShardError(
            refusal(
                f"{found[0]}{more}",
                "a hidden-state shard",
                "train on the shards of the run without vllm.rehearsal (results/<name>/hidden/), "
                "or set vllm.rehearsal: true to rehearse the training",
            )
        )


def _rehearsal_shard(path: Path) -> bool:
    try:
        return read_meta(path).rehearsal
    except ShardError:
        return False  # unreadable: verify_shards reports it, with every other bad shard


def verify_shards(paths: list[Path], expect: dict, scan_values: bool, dist: Dist) -> None:
    """Refuse bad shards before any step, all of them in one line with the way to rebuild them.

    Every rank opens every shard (a truncated HDF5 file fails at open; attrs, the run's expected
    fields, shapes and offsets are checked). With `scan_values` every stored value is checked
    finite, the shards split over the ranks. Finite overwritten bytes cannot be told from data:
    the shard format has no checksums.
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


def resolve_device(name: str, dist: Dist | None = None) -> torch.device:
    """cpu, or this process's GPU (cuda:LOCAL_RANK) when CUDA is asked for or `auto` finds it."""
    dist = dist or Dist()
    if auto_device("train.device", name, EyrieError) == "cpu":
        return torch.device("cpu")
    if dist.local_world > torch.cuda.device_count():
        raise EyrieError(
            f"{dist.local_world} processes on this node but {torch.cuda.device_count()} "
            "GPU(s) visible (CUDA_VISIBLE_DEVICES); use --nproc-per-node <= GPUs per node"
        )
    torch.cuda.set_device(dist.local_rank)
    return torch.device("cuda", dist.local_rank)


def lr_factor(step: int, warmup: int, total: int, schedule: str = "cosine") -> float:
    """Linear warmup over `warmup` steps, then `schedule`: cosine or linear decay to 0 at
    `total`, or constant."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def add_hidden_noise(states: torch.Tensor, scale: float, width: int) -> torch.Tensor:
    """`states` [..., n * width] plus Gaussian noise of `scale` times the RMS of each row of each
    layer (of `width` values): the draft learns from states that vary a little, as its own
    drafted states do at inference. The RMS is computed without a gradient."""
    rows = states.unflatten(-1, (-1, width))
    rms = rows.detach().float().pow(2).mean(-1, keepdim=True).sqrt().to(states.dtype)
    return (rows + torch.randn_like(rows) * (scale * rms)).flatten(-2)


def _to_device(
    batch: dict[str, torch.Tensor], device: torch.device, stream: "torch.cuda.Stream | None"
) -> dict[str, torch.Tensor]:
    """A host batch (pinned for CUDA) copied to the device on `stream`, without waiting."""
    if device.type != "cuda":
        return batch
    with torch.cuda.stream(stream):
        return {n: v.to(device, non_blocking=True) for n, v in batch.items()}
