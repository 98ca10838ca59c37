"""Run speculators' own trainer (`python -m speculators.train FLAGS`, unchanged) and record what its
logs do not give per step: when the trainer asked its train loader for a batch, when it got it,
the batch's real tokens (document_ids != -1), and at the end the process's peak GPU memory.

    torchrun --standalone --nproc-per-node 1 benchmarks/speculators_launch.py OUT.json -- FLAGS

Each rank writes OUT.json with `.rank<R>` before the suffix. The trainer is run by runpy as
`__main__`, exactly as `torchrun -m speculators.train` runs it; the only change is that
`speculators.train.cli.create_train_val_loaders` returns the train loader wrapped in `TimedLoader`
(same length, attributes and batches; each `next()` timed). The trainer waits for the device at
the end of every step when its timer is on (log_freq 1, its default), so the time between two
requests is a step's time and the time to the answer is the step's wait for data.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path


class TimedLoader:
    """A DataLoader whose iteration records (request time, answer time, real tokens) per batch."""

    def __init__(self, loader, log: list[dict]):
        self._loader, self._log = loader, log

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str):  # batch_sampler, dataset, ...: the loader's own
        return getattr(self._loader, name)

    def __iter__(self):
        it = iter(self._loader)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            t1 = time.perf_counter()
            self._log.append(
                {"request": t0, "got": t1, "tokens": int((batch["document_ids"] != -1).sum())}
            )
            yield batch


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        print("usage: speculators_launch.py OUT.json -- <speculators.train flags>", file=sys.stderr)
        return 2
    out, flags = Path(sys.argv[1]), sys.argv[3:]
    rank = int(os.environ.get("RANK", "0"))
    steps: list[dict] = []

    import speculators.train.cli as cli
    import torch

    make_loaders = cli.create_train_val_loaders

    def timed_loaders(**kwargs):
        train, val = make_loaders(**kwargs)
        return TimedLoader(train, steps), val

    cli.create_train_val_loaders = timed_loaders  # main() looks the name up when it runs
    started, error = time.time(), None
    sys.argv = ["speculators.train", *flags]
    try:
        runpy.run_module("speculators.train", run_name="__main__", alter_sys=True)
    except BaseException as exc:  # recorded, then raised again
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        cuda = torch.cuda.is_available()
        result = {
            "rank": rank,
            "flags": flags,
            "started": started,
            "error": error,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "steps": steps,
        }
        path = out.with_name(f"{out.stem}.rank{rank}{out.suffix}")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.rename(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
