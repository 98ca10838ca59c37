"""`eyrie store`: what the output store holds, and pruning it (docs/store.md).

`eyrie store [--path results/store]` lists the entries by kind with their size and the part only
the store holds (an entry whose files are still linked from an output costs no extra disk);
`--prune --older-than-days D` and/or `--max-gib G` remove the entries used longest ago until
both hold (`--dry-run` says what would go). `--verify [sampled|full]` checks every entry (as a
restore does, or also reading every shard whole) and removes the damaged ones. Removing an entry
never touches an output: a rerun that needs it computes it again.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from eyrie.core.errors import EyrieError
from eyrie.store.store import Store

log = logging.getLogger(__name__)

GIB = 1 << 30


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / (1 << 20):.1f} MiB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", type=Path, default=Path("results/store"), help="store.path")
    parser.add_argument("--prune", action="store_true", help="remove entries (see below)")
    parser.add_argument(
        "--older-than-days", type=float, default=None, help="prune: entries unused this long"
    )
    parser.add_argument(
        "--max-gib",
        type=float,
        default=None,
        help="prune: the oldest-used entries until what only the store holds fits",
    )
    parser.add_argument("--dry-run", action="store_true", help="prune: only say what would go")
    parser.add_argument(
        "--verify",
        nargs="?",
        const="sampled",
        choices=["sampled", "full"],
        default=None,
        help="check every entry and remove the damaged ones: `sampled` (default) as a restore "
        "does (sizes and sampled digests), `full` also reads every hidden-state shard whole "
        "(structure, ids, finite values)",
    )


def prune_plan(store: Store, older_than_days: float | None, max_gib: float | None) -> list:
    """The entries to remove, oldest used first."""
    entries = store.entries()
    cutoff = time.time() - older_than_days * 86400 if older_than_days is not None else None
    drop = [e for e in entries if cutoff is not None and e.used < cutoff]
    if max_gib is not None:
        held = sum(e.held_bytes for e in entries if e not in drop)
        for e in entries:
            if held <= max_gib * GIB:
                break
            if e not in drop:
                drop.append(e)
                held -= e.held_bytes
    return drop


def _problem(store: Store, entry, full: bool) -> str | None:
    """Why one entry is damaged, or None."""
    problem = store.damage(entry)
    if problem is None and full and entry.kind == "hidden":
        from eyrie.formats.hidden import validate_shard

        try:
            validate_shard(entry.path / "shard.h5", check_values=True)
        except (EyrieError, OSError) as exc:
            problem = str(exc)
    return problem


def verify(store: Store, entries: list, full: bool) -> tuple[list, int]:
    """(the entries that pass the check, the damaged ones left in place): each damaged one is
    removed with one line saying why, or, where the store cannot be written (a read-only
    mount), named with why it stays; a restore refuses it either way."""
    good, left = [], 0
    for entry in entries:
        problem = _problem(store, entry, full)
        if problem is None:
            good.append(entry)
            continue
        try:
            store.remove(entry)
        except OSError as exc:
            left += 1
            print(
                f"{entry.path}: damaged ({problem}); not removed ({exc.strerror or exc}): a "
                f"restore refuses it; remove it where the store can be written (rm -r {entry.path})"
            )
            continue
        print(
            f"{entry.path}: damaged ({problem}); removed: a rerun that needs it computes it again"
        )
    return good, left


def run(args: argparse.Namespace) -> int:
    store = Store(args.path)
    if not store.root.is_dir():
        raise EyrieError(f"--path {store.root}: no store there; give store.path of the config")
    if args.prune and args.older_than_days is None and args.max_gib is None:
        raise EyrieError("--prune needs --older-than-days D and/or --max-gib G")
    entries, left = store.entries(), 0
    if args.verify:
        entries, left = verify(store, entries, args.verify == "full")
    for kind in sorted({e.kind for e in entries}):
        mine = [e for e in entries if e.kind == kind]
        print(
            f"{kind}: {len(mine)} entries, {_size(sum(e.bytes for e in mine))}, of which "
            f"{_size(sum(e.held_bytes for e in mine))} held only by the store"
        )
    if not entries:
        print(f"{store.root}: empty")
    if args.prune:
        drop = prune_plan(store, args.older_than_days, args.max_gib)
        for e in drop:
            if not args.dry_run:
                store.remove(e)
        freed = _size(sum(e.held_bytes for e in drop))
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {len(drop)} entries ({freed} held only by the store)")
    return 1 if left else 0  # damaged entries still in the store
