"""Compare the outputs of two workflow runs: the formats that pass between stages must be equal.

    python scripts/parity.py RESULTS_A RESULTS_B        # two results/<name> folders
    python scripts/parity.py --rev REV [--config FILE]   # run REV and this tree, then compare

Byte for byte: tokenized shards, the vocabulary map, the demo target, the trained and the exported
draft. HDF5 hidden-state shards: every dataset's bytes, dtype and shape and every attribute except
`producer` (it records the run's command, time and git SHA). JSON reports and metrics.jsonl: every
value except provenance, wall-clock timings, free disk space and the training run id (it hashes
the inputs' modification times). The runs' own folders may differ: each run's working directory
reads as `<workdir>` in every file. Exit status 1 names each difference.
`--rev` runs the workflow twice in temporary folders (the other revision through a git worktree,
with this tree's Python environment) and keeps both results folders for inspection.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# files compared as bytes (relative to results/<name>)
BYTES = (
    "tokenized/*.parquet",
    "vocab/vocab.safetensors",
    "target/*.safetensors",
    "target/config.json",
    "target/generation_config.json",
    "target/tokenizer*.json",
    "target/chat_template.jinja",
    "train/draft/*",
    "draft/config.json",
    "draft/config.py",
    "draft/model.safetensors",
)
HDF5 = ("hidden/*.h5",)
JSON = (
    "tokenized/report.json",
    "vocab/vocab.json",
    "preflight.json",
    "train/train.json",
    "eval/eval.json",
    "target/demo_training.json",
)
JSONL = ("train/metrics.jsonl",)
# keys whose values describe the run (when, where, how fast), not its outputs
VOLATILE = re.compile(
    r"^(provenance|producer|time|host|.*wall_s|wall_time_s|data_wait_s|data_wait_fraction|"
    r"tokens_per_s|peak_gpu_memory_bytes|seconds|.*_seconds|load_s|free_bytes|run_id)$"
)


def read_bytes(path: Path, workdir: Path) -> bytes:
    """The file's bytes, with its run's working directory written as <workdir>."""
    return path.read_bytes().replace(str(workdir).encode(), b"<workdir>")


def digest(path: Path, workdir: Path) -> str:
    return hashlib.sha256(read_bytes(path, workdir)).hexdigest()


def strip(value):
    """`value` without volatile keys, recursively."""
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if not VOLATILE.match(str(k))}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def hdf5_content(path: Path, workdir: Path) -> dict:
    """{name: (dtype, shape, sha256)} of every dataset, {attr: value} of the file, less producer."""
    import h5py
    import numpy as np

    out: dict = {}
    with h5py.File(path, "r") as f:
        for name, value in f.attrs.items():
            if name != "producer":
                out[f"@{name}"] = np.asarray(value).tolist()
        for name, ds in f.items():
            data = ds[()]
            raw = (
                b"\0".join(x if isinstance(x, bytes) else str(x).encode() for x in data.ravel())
                if data.dtype == object
                else np.ascontiguousarray(data).tobytes()
            )
            out[name] = (str(ds.dtype), list(ds.shape), hashlib.sha256(raw).hexdigest())
            out[f"{name}@"] = {k: np.asarray(v).tolist() for k, v in ds.attrs.items()}
    return out


def compare(a: Path, b: Path) -> tuple[list[str], list[str]]:
    """(files compared, differences) between results folders `a` and `b`."""
    checked, diffs = [], []

    def pairs(patterns):
        for pattern in patterns:
            found = sorted(p for p in a.glob(pattern) if p.is_file())
            for p in found:
                yield p, b / p.relative_to(a)

    def text(p, w):
        return read_bytes(p, w).decode()

    kinds = (
        (BYTES, digest),
        (HDF5, hdf5_content),
        (JSON, lambda p, w: strip(json.loads(text(p, w)))),
        (JSONL, lambda p, w: [strip(json.loads(x)) for x in text(p, w).splitlines() if x]),
    )
    # results/<name> lies in its run's working directory
    wa, wb = a.resolve().parents[1], b.resolve().parents[1]
    for patterns, read in kinds:
        for pa, pb in pairs(patterns):
            rel = str(pa.relative_to(a))
            checked.append(rel)
            if not pb.is_file():
                diffs.append(f"{rel}: missing in {b}")
            elif read(pa, wa) != read(pb, wb):
                diffs.append(f"{rel}: differs")
    for pattern in (*BYTES, *HDF5, *JSON, *JSONL):
        for pb in b.glob(pattern):
            if pb.is_file() and not (a / pb.relative_to(b)).is_file():
                diffs.append(f"{pb.relative_to(b)}: missing in {a}")
    return checked, diffs


def run_workflow(tree: Path, workdir: Path, config: Path | None) -> Path:
    """Run the whole workflow of `tree` (its Snakefile and package) in `workdir`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "snakemake", "-s", str(tree / "Snakefile"), "-d", str(workdir)]
    cmd += ["-c", "all"] + (["--configfile", str(config)] if config else [])
    log = workdir / "snakemake.log"
    workdir.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        # cwd: `python -m` puts the working directory first on sys.path, before PYTHONPATH
        run = subprocess.run(cmd, env=env, cwd=workdir, stdout=f, stderr=subprocess.STDOUT)
        rc = run.returncode
    if rc:
        raise SystemExit(f"parity: the workflow of {tree} failed (exit {rc}); see {log}")
    name = "demo"
    if config:
        import yaml

        name = (yaml.safe_load(config.read_text()).get("target") or {}).get("name", name)
    return workdir / "results" / name


def run_both(rev: str, config: Path | None) -> tuple[Path, Path]:
    root = Path(tempfile.mkdtemp(prefix="eyrie-parity-"))
    other = root / "rev"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(other), rev], check=True
    )
    try:
        config = config.resolve() if config else None
        print(f"parity: running {rev} in {root / 'run-rev'} and this tree in {root / 'run-here'}")
        a = run_workflow(other, root / "run-rev", config)
        b = run_workflow(REPO, root / "run-here", config)
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(other)], check=False
        )
    return a, b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="*", type=Path, help="two results/<name> folders")
    parser.add_argument("--rev", help="a git revision to run and compare with this tree")
    parser.add_argument("--config", type=Path, help="with --rev: the config file (default demo)")
    args = parser.parse_args(argv)
    if args.rev:
        a, b = run_both(args.rev, args.config)
    elif len(args.results) == 2:
        a, b = args.results
    else:
        parser.error("give two results folders, or --rev REV")
    checked, diffs = compare(a, b)
    if not checked:
        print(f"parity: nothing to compare in {a}", file=sys.stderr)
        return 1
    for d in diffs:
        print(f"parity: {d}", file=sys.stderr)
    print(f"parity: {len(checked)} files compared, {len(diffs)} differences ({a} vs {b})")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
