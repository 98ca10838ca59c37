"""The training recipe: the EAGLE-3 draft trained on hidden-state shards, as one flat class.

`TrainRecipe(paths, settings).run()` goes setup -> train (one `Stepper.step` per optimizer step,
`checkpoint` every `checkpoint_every` steps) -> cleanup -> finish (the outputs). Contract: the plan
of packs is a function of the settings and the shards alone, never of the number of processes, so
a position (epoch, step in epoch) names the data exactly and a resumed run ends with the weights of
an uninterrupted one; under torchrun every rank runs the recipe, and only rank 0 writes metrics,
checkpoints and outputs. The parts: inputs (the checks before step 1), model (draft, optimizer,
schedule, DDP), step (one optimizer step), report (records and progress lines). Steps, processes,
resume and the shard checks: docs/training.md.
"""

from __future__ import annotations

import contextlib
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from eyrie.config.sections import TrainSettings, check_world
from eyrie.core.errors import EyrieError
from eyrie.core.io import provenance, write_json
from eyrie.core.rehearsal import is_rehearsal, mark
from eyrie.formats.vocab import read_vocab
from eyrie.train.checkpoint import (
    Checkpoint,
    CheckpointProblem,
    Checkpoints,
    frozen_keys,
    is_last,
    restore,
    run_id,
    truncate_metrics,
)
from eyrie.train.inputs import (
    VERIFIED_MARKER,
    TrainPaths,
    check_rehearsal,
    check_target,
    verify_shards,
)
from eyrie.train.launch import Dist, stop
from eyrie.train.metrics import fmt, mean, write_outputs
from eyrie.train.model import build_trainable, resolve_device, wrap_ddp
from eyrie.train.packing import BatchSpec, PackedShards, Plan, Prefetcher
from eyrie.train.report import LoopState, Reporter, compile_breakdown, read_metrics
from eyrie.train.sharding import full_states, is_sharded
from eyrie.train.step import Stepper

log = logging.getLogger(__name__)


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
    """One training run: setup, train (Stepper.step, checkpoint), cleanup, finish."""

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
        self.expect = check_target(self.paths)
        auto = self.cfg.learning_rate == "auto"
        self.cfg = self.cfg.resolved_for(self.expect["hidden_size"])
        if auto:
            log.info(
                "learning rate %.3g (train.learning_rate: auto, for the target's hidden size %d)",
                self.cfg.learning_rate,
                self.expect["hidden_size"],
            )
        check_rehearsal(self.paths.shards, self.rehearsal)
        self.layers = self.cfg.draft_layers(self.expect["aux_layer_ids"], str(self.paths.preflight))
        self._open_run()
        self.data = PackedShards(
            self.paths.shards,
            self.expect,
            self.cfg.max_tokens_per_batch,
            0 if self.cfg.block else self.cfg.ttt_steps - 1,  # EAGLE-3's TTT shifts need a gap
            values_checked=self.cfg.verify_shards,
            layers=self.layers,
            shifted=not self.cfg.block,  # a block drafter's positions as stored (block_sample)
        )
        self._stack.callback(self.data.close)
        vocab = read_vocab(self.paths.vocab)  # d2t, t2d
        self.plan = self._plan()
        built = time.monotonic()
        self.draft = build_trainable(
            self.paths.target,
            self.layers,
            self.cfg,
            vocab,
            self.plan.total_steps,
            self.device,
            self.rehearsal,
            self.dist.world,
        )
        self.sharded = is_sharded(self.draft.model)
        log.info(
            "draft built on %s in %.1f s%s",
            self.device,
            time.monotonic() - built,
            f"; sharded over {self.dist.world} processes (train.fsdp)" if self.sharded else "",
        )
        self.checkpoints = Checkpoints(self.run_dir, self.rid, self.plan.steps_per_epoch)
        position = self._restore()
        self.resumed_from = position["step"]
        net = wrap_ddp(self.draft.model, self.dist, self.device)
        self.schedule = self.plan.steps_from(
            position["epoch"], position["step_in_epoch"], self.dist.rank, self.k
        )
        copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.stepper = Stepper(
            self.cfg, self.draft, net, self.device, self.dist, self.k, self.bf16, copy_stream
        )
        self.state = LoopState(position, started=time.monotonic(), wall0=position["wall_s"])

    def _open_run(self) -> None:
        """The run id (rank 0's, on all ranks), the shards checked, the run folder made."""
        cfg, dist, p = self.cfg, self.dist, self.paths
        self.rid = dist.from_main(run_id(cfg, p.target, p.preflight, p.vocab, p.shards))
        self.run_dir = p.state_dir / self.rid
        self.metrics_path = self.run_dir / "metrics.jsonl"
        marker = self.run_dir / VERIFIED_MARKER
        scan = cfg.verify_shards and not marker.is_file()
        if scan:
            log.info(
                "checking every stored value of %d shard(s) before the first step (once per "
                "run; train.verify_shards: false skips it)",
                len(p.shards),
            )
        verify_shards(p.shards, self.expect, scan, dist)
        if dist.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for stale in self.run_dir.glob(".step_*.tmp-*"):  # a checkpoint cut short by a kill
                shutil.rmtree(stale, ignore_errors=True)
            if scan:
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

    def _restore(self) -> dict:
        """The position to start from: the newest checkpoint that verifies, or a fresh seeded
        start. Rank 0 verifies and picks; every rank reads that one (the same on all ranks)."""
        dist, d = self.dist, self.draft
        found = self.checkpoints.newest_good(d.model, d.optimizer) if dist.main else None
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
            return self.checkpoints.read(path, self.draft.model, self.draft.optimizer)
        except CheckpointProblem as exc:
            raise EyrieError(
                f"rank {self.dist.rank}: rank 0 resumes from {path}, which this process cannot "
                f"use ({exc}); put --state-dir on a filesystem that every node shares"
            ) from None

    def _resume(self, ckpt: Checkpoint) -> dict:
        d = self.draft
        position = restore(ckpt, d.model, d.optimizer, d.scheduler)
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

    # ------------------------------------------------------------------------------------ train

    def train(
        self,
        stop_after_steps: int | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> bool:
        """Every planned step from the position on; False when stopped after `stop_after_steps`."""
        self._start_loading()
        total, state, stepper = self.plan.total_steps, self.state, self.stepper
        staged = stepper.stage(self.loader) if self.schedule else None
        for n, (epoch, s, _, packs) in enumerate(self.schedule):
            batches, wait = staged
            state.waited += wait
            sums, grad_norm = stepper.step(batches)
            if n == 0:  # torch.compile builds the draft's graphs (or loads them) in this step
                log.info(
                    "first step launched in %.1f s%s",
                    time.monotonic() - state.started,
                    compile_breakdown(),
                )
            if n + 1 < len(self.schedule):  # read while the device still works on this step
                staged = stepper.stage(self.loader)
            tokens = [sum(t) for t in zip(*(self.data.tokens(p) for p in packs))]  # [all, loss]
            step = state.advance(epoch, s, tokens[0])
            lr = self.draft.scheduler.get_last_lr()[0]
            state.pending.append((state.head(epoch, tokens, lr, wait), sums, grad_norm))
            stopping = stop_after_steps is not None and step >= stop_after_steps and step < total
            self.reporter.report(state, epoch, stopping)
            if step % self.cfg.checkpoint_every == 0 or step == total or stopping:
                saving = time.monotonic()
                self.checkpoint()
                log.info("checkpoint of step %d in %.1f s", step, time.monotonic() - saving)
            if on_step is not None:
                on_step(step)
            if stopping:
                log.info("stopping after step %d as asked; rerun to resume", step)
                return False
        return True

    def _start_loading(self) -> None:
        """The metrics file and curves (rank 0) and the loader thread, closed by `cleanup`."""
        self.reporter = Reporter.open(
            self._stack,
            self.cfg,
            self.plan.total_steps,
            self.metrics_path if self.dist.main else None,
            self.run_dir,
            {"train": self.settings["train"], "out_dir": str(self.paths.out_dir)},
        )
        spec = BatchSpec(
            dtype=self.data.transfer_dtype if self.cuda else torch.float32,
            pin=self.cuda,
            pad_to=self.pad_to,
        )
        self.loader = self._stack.enter_context(
            Prefetcher(self.data, [mine for _, _, mine, _ in self.schedule], spec=spec)
        )

    def checkpoint(self) -> None:
        """Rank 0 writes step_<N>/ (weights, optimizer, scheduler, RNG, position); all wait
        (a sharded draft's tensors are gathered whole first, by every rank)."""
        d = self.draft
        whole = None
        if self.sharded:  # the optimizer state only where it is written (not at the last step)
            frozen = frozenset(frozen_keys(d.model))
            last = is_last(self.state.position["step"], self.plan.steps_per_epoch)
            optimizer = None if last else d.optimizer
            whole = full_states(d.model, optimizer, self.dist.main, skip=frozen)
        if self.dist.main:
            self.checkpoints.save(
                self.draft.model,
                self.draft.optimizer,
                self.draft.scheduler,
                {
                    **self.state.position,
                    "packs_per_step": self.cfg.packs_per_step,
                    "world_size": self.dist.world,
                },
                whole,
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
        # a sharded draft's whole weights, gathered by every rank, kept by rank 0
        weights = full_states(self.draft.model, None, self.dist.main)[0] if self.sharded else None
        if self.dist.main:
            records = read_metrics(self.metrics_path)
            summary = self._summary(records, timing)
            writing = time.monotonic()
            write_outputs(self.paths.out_dir, self.draft.model, records, summary, cfg, weights)
            log.info(
                "wrote %s in %.1f s: final loss %s, accuracy per TTT step %s",
                self.paths.out_dir,
                time.monotonic() - writing,
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
                "full_acc": [mean(last, f"full_acc_{k}") for k in range(cfg.positions)],
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
            "method": cfg.method,  # the kind of draft (train.method)
            "aux_layer_ids": self.layers,  # the layers the draft reads (train.aux_ids)
            "stored_layer_ids": expect["aux_layer_ids"],  # the shards' (layers.aux_ids)
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
