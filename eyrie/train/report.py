"""What the training loop carries and reports: its position (what a checkpoint saves), rank 0's
step records in the run's metrics.jsonl and curves, and the progress line.

Contract: a step's device-side values are read at log and checkpoint steps only (and before a
planned stop), so the host does not wait for the device after every step; the records are then
appended to metrics.jsonl and the curves, and at log steps one progress line averages the last
`log_every` records. Metrics: docs/training.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import torch

from eyrie.config.sections import TrainSettings
from eyrie.train.curves import Curves, Scalars
from eyrie.train.metrics import fmt, mean, read_pending

# The recipe's lines, under the recipe's name: its setup quiets this logger on ranks > 0.
log = logging.getLogger("eyrie.train.recipe")


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

    def advance(self, epoch: int, s: int, tokens: int) -> int:
        """The position after step `s` of `epoch`, which trained `tokens`; the step number."""
        position = self.position
        position.update(
            step=position["step"] + 1,
            epoch=epoch,
            step_in_epoch=s + 1,
            tokens=position["tokens"] + tokens,
            wall_s=self.wall_s(),
        )
        return position["step"]

    def head(self, epoch: int, tokens: list[int], lr: float, wait: float) -> dict:
        """The host-side part of the step's metrics record (`tokens`: [all, loss-masked])."""
        position = self.position
        return {
            "step": position["step"],
            "epoch": epoch,
            "tokens": tokens,
            "lr": lr,
            "data_wait_s": wait,
            "wall_s": position["wall_s"],
        }


def read_metrics(path: Path) -> list[dict]:
    """The step records of a metrics.jsonl."""
    return [json.loads(ln) for ln in path.read_text().splitlines()]


class Reporter:
    """Rank 0's metrics file and curves (None on the other ranks) and the progress line."""

    def __init__(
        self,
        cfg: TrainSettings,
        total: int,
        metrics_file: IO[str] | None = None,
        curves: Curves | None = None,
    ):
        self.cfg, self.total = cfg, total
        self.metrics_file, self.curves = metrics_file, curves

    @classmethod
    def open(
        cls,
        stack: contextlib.ExitStack,
        cfg: TrainSettings,
        total: int,
        metrics_path: Path | None,
        run_dir: Path,
        curves_config: dict,
    ) -> "Reporter":
        """`metrics_path` opened to append, and the TensorBoard and W&B curves that
        train.report_to asks for beside it (in `run_dir`), both closed by `stack`;
        `metrics_path` None (the ranks after 0): neither."""
        if metrics_path is None:
            return cls(cfg, total)
        metrics_file = stack.enter_context(metrics_path.open("a"))
        if not cfg.report_to:
            return cls(cfg, total, metrics_file)
        curves = Curves.open(
            cfg.report_to,
            run_dir,
            Scalars(cfg.positions, cfg.log_every, total),
            read_metrics(metrics_path),
            curves_config,
        )
        stack.callback(curves.close)
        return cls(cfg, total, metrics_file, curves)

    def report(self, state: LoopState, epoch: int, stopping: bool) -> None:
        """Metrics records written at log and checkpoint steps; the progress line at log steps."""
        cfg = self.cfg
        step, total = state.position["step"], self.total
        log_now = step % cfg.log_every == 0 or step == total
        if log_now or step % cfg.checkpoint_every == 0 or stopping:
            records = read_pending(state.pending, cfg.packs_per_step, cfg.positions)  # waits
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
            f"acc{t}={fmt(mean(window, f'full_acc_{t}'))}" for t in range(cfg.positions)
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


# torch.compile's own timers (torch._dynamo.utils.compile_times) worth a line: tracing the draft,
# lowering the forward and backward graphs to kernels, and waiting for the kernels' compilation
COMPILE_PHASES = {
    "bytecode_tracing": "traced",
    "compile_fx.<locals>.fw_compiler_base": "forward lowered",
    "compile_fx.<locals>.bw_compiler": "backward lowered",
    "async_compile.wait": "kernels waited for",
}


def compile_breakdown() -> str:
    """Where the first step's torch.compile spent its time, in words: graphs loaded from the
    cache show no lowering ('' when torch keeps no timers: an eager run, or a torch whose
    private timers moved)."""
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
    except Exception:  # a private API: its absence costs the line, nothing else
        return ""
    got = dict(zip(names, values))
    parts = [f"{what} {float(got[k]):.1f} s" for k, what in COMPILE_PHASES.items() if k in got]
    return f" (torch.compile: {', '.join(parts)})" if parts else ""
