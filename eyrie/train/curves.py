"""Training curves where people look at them: the step records of metrics.jsonl as TensorBoard
scalars (local event files) and, when train.report_to asks for it, a W&B run; rank 0 writes them
when it writes the records.

Contract: each record gives `train/loss`, `train/lr`, `train/grad_norm` and `accuracy/ttt_step_<k>`
(one tag per TTT position; none at a step without targets) at global step = the record's step;
`train/tokens_per_s` comes at each log step (every `log_every` steps and the last), over the steps
since the previous log step: the host reads the device there, so those times are exact. Resume and
where the files are: docs/training.md#curves.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from eyrie.core.errors import EyrieError

TENSORBOARD_DIR = "tensorboard"  # beside metrics.jsonl in the run folder, and in the output folder
WANDB_ID = "wandb_run_id"  # in the run folder: the W&B run that a resumed run continues


class Scalars:
    """Each record's scalars by tag, fed the records in step order (tokens/s needs those before)."""

    def __init__(self, ttt_steps: int, log_every: int, last_step: int):
        self.ttt_steps, self.log_every, self.last_step = ttt_steps, log_every, last_step
        self.tokens = 0  # of every step fed so far
        self.mark = (0, 0.0)  # (tokens, wall_s) at the previous log step

    def of(self, record: dict) -> dict[str, float]:
        step = record["step"]
        self.tokens += record["tokens"]
        out = {
            "train/loss": record["loss"],
            "train/lr": record["lr"],
            "train/grad_norm": record["grad_norm"],
        }
        for k in range(self.ttt_steps):
            if record.get(f"full_acc_{k}") is not None:
                out[f"accuracy/ttt_step_{k}"] = record[f"full_acc_{k}"]
        if step % self.log_every == 0 or step == self.last_step:
            tokens, wall_s = self.mark
            if record["wall_s"] > wall_s:
                out["train/tokens_per_s"] = (self.tokens - tokens) / (record["wall_s"] - wall_s)
            self.mark = (self.tokens, record["wall_s"])
        return out


def writable(folder: Path) -> None:
    """Refuse, in one line, a TensorBoard folder this process cannot write event files in."""
    probe = folder / f".eyrie-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise EyrieError(
            f"{folder}: TensorBoard cannot write its event files there ({exc.strerror or exc}); "
            "fix the folder's permissions or free space, or leave tensorboard out of "
            "train.report_to"
        ) from exc


class _TensorBoard:
    """Event files in `folder`; `first_step` > 1 hides an earlier attempt's events from that step
    on (TensorBoard's purge_step: the steps a resumed run trains again)."""

    def __init__(self, folder: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        if first_step <= 1:  # a fresh start: no earlier attempt's curves
            shutil.rmtree(folder, ignore_errors=True)
        writable(folder)  # SummaryWriter fails in its own thread, training on without curves
        # the steps before first_step are there (else: a run resumed with report_to changed)
        self.has_history = any(folder.glob("events.out.tfevents.*"))
        purge = first_step if self.has_history else None
        self.writer = SummaryWriter(str(folder), purge_step=purge)

    def write(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    """A W&B run, continued by a resumed run (its id in the run folder); WANDB_PROJECT,
    WANDB_ENTITY and WANDB_MODE (offline: nothing leaves the machine) are wandb's own."""

    def __init__(self, run_dir: Path, name: str, resumed: bool, config: dict):
        import wandb

        id_file = run_dir / WANDB_ID
        self.has_history = resumed and id_file.is_file()
        if self.has_history:
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:16]
            id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "eyrie"),
            id=run_id,
            name=name,
            resume="allow",
            dir=str(run_dir),
            config=config,
        )

    def write(self, step: int, values: dict[str, float]) -> None:
        # W&B ignores a step below the run's current one: a resumed run's repeated steps keep
        # their first values (the same losses: a resumed run trains the same steps)
        self.run.log(values, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class Curves:
    """The curves of one run on rank 0: every backend of train.report_to, fed the step records."""

    def __init__(self, sinks: list, scalars: Scalars):
        self.sinks, self.scalars = sinks, scalars

    @classmethod
    def open(
        cls,
        report_to: tuple[str, ...],
        run_dir: Path,
        scalars: Scalars,
        history: list[dict],
        wandb_config: dict,
    ) -> "Curves":
        """The run folder's curves; `history`: the records of the steps before this process (a
        resumed run's), which tokens/s counts from and which a backend gets only when it does
        not have them yet (turned on in a resumed run)."""
        backlog = [(record["step"], scalars.of(record)) for record in history]
        first_step = history[-1]["step"] + 1 if history else 1
        sinks = []
        if "tensorboard" in report_to:
            sinks.append(_TensorBoard(run_dir / TENSORBOARD_DIR, first_step))
        if "wandb" in report_to:
            sinks.append(_WandB(run_dir, run_dir.name, bool(history), wandb_config))
        for sink in sinks:
            if not sink.has_history:
                for step, values in backlog:
                    sink.write(step, values)
        return cls(sinks, scalars)

    def add(self, records: list[dict]) -> None:
        """Write the records' scalars, then flush (a kill loses no written step)."""
        for record in records:
            values = self.scalars.of(record)
            for sink in self.sinks:
                sink.write(record["step"], values)
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def write_event_files(folder: Path, records: list[dict], ttt_steps: int, log_every: int) -> None:
    """A finished run's records as TensorBoard event files in `folder` (the output folder's copy:
    every step once, whatever resumes made the run)."""
    scalars = Scalars(ttt_steps, log_every, records[-1]["step"] if records else 0)
    curves = Curves([_TensorBoard(folder, first_step=1)], scalars)
    curves.add(records)
    curves.close()
