"""Shard read-path benchmark: eyrie's HDF5 ShardReader against speculators' per-sample
safetensors.

Why: training reads every sample once per epoch in random order; the read path must not be
slower than the format it replaces (goal: eyrie/peer >= 1.0x in every cell).

What it does, in one run on one machine:
  1. builds random bf16 hidden states of a realistic shape ([T, n_aux + 1, H] per sample, T in
     --min-tokens..--max-tokens, ~--gb GB in all) and writes the SAME tensors three times:
     - eyrie: several HDF5 shards through eyrie.formats.hidden_writer.ShardWriter
       (docs/shard-format.md), bfloat16;
     - eyrie_fp8: the same shards with storage_dtype float8_e4m3 (quantized by ShardWriter);
     - peer: one `hs_<i>.safetensors` per sample with speculators' keys
       (`hidden_states` [T, n_aux + 1, H] bfloat16, `token_ids` [T] int64;
       speculators/train/data.py).
  2. reads every sample once, in one random order shared by all readers, with
     - eyrie: ShardReader(check_values=False).read(i), readers opened once per shard: the read
       training makes after its verify_shards pass (eyrie.train.packing.PackedShards,
       values_checked);
     - eyrie_checked: ShardReader(path).read(i), the default: each read checks its sample finite;
     - eyrie_h5py: eyrie_checked through h5py slicing (the reader's fallback for chunked or
       compressed layouts; also what every read did before offsets were used);
     - eyrie_fp8: the float8_e4m3 shards, ShardReader(check_values=False).read(i, bfloat16)
       (dequantized to the dtype the peer returns);
     - eyrie_fp8_codes: the same, read(i, uint8): codes and per-token scales as stored, what
       training moves to a GPU and decodes there (eyrie.train.packing.decode_batch);
     - peer: hs_connectors.FileTransfer.get_cached(i) (safetensors.torch.load_file), the call
       speculators 0.9.0's data path makes for a cached sample;
     every reader's hidden tensors get the same `touch` (one value per 4 KiB page), because
     load_file and ShardReader return memory-mapped tensors whose bytes are otherwise never read;
     - verify: validate_shard(path) over every bfloat16 shard (the one scan of every value that
       train.verify_shards makes per run, not per epoch);
     each cold (page cache dropped first) and warm (right after, files cached), --repeats times
     with the reader order rotated; reports the median and the spread.
  3. prints a table and writes JSON (figures, ratios to the peer per pass and of the medians,
     command, machine, versions, cold-cache method) to benchmarks/results/read_path-<machine>.json.

Cold cache: `echo 3 > /proc/sys/vm/drop_caches` after `sync` (root); if that is not allowed,
posix_fadvise(POSIX_FADV_DONTNEED) on every benchmark file. The JSON names the method used.

    .venv/bin/python benchmarks/read_path.py --gb 5 --repeats 5     # the BENCHMARKS.md run
    .venv/bin/python benchmarks/read_path.py --gb 0.005 --hidden 64 --no-cold --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from eyrie.formats.codecs import decode_e4m3  # noqa: E402
from eyrie.formats.hidden import ShardMeta, ShardReader, validate_shard  # noqa: E402
from eyrie.formats.hidden_writer import ShardWriter  # noqa: E402

try:  # speculators' own loader for a cached sample (hs_connectors ships with speculators 0.9.0)
    from hs_connectors import FileTransfer
except ImportError:  # same call underneath: safetensors.torch.load_file(path)
    FileTransfer = None

N_AUX = 3
KINDS = ("eyrie", "eyrie_checked", "eyrie_h5py", "eyrie_fp8", "eyrie_fp8_codes", "peer", "verify")


# ----------------------------------------------------------------------------- data


def build_dataset(
    root: Path,
    gb: float,
    hidden: int,
    n_shards: int,
    min_tok: int,
    max_tok: int,
    seed: int,
    put_seconds: dict[str, float],
) -> list[tuple[int, int, int]]:
    """Writes the three layouts under root; returns (shard, index in shard, tokens) per sample.
    put_seconds: time spent in ShardWriter.put per storage dtype (the float8 quantization)."""
    g = torch.Generator().manual_seed(seed)
    per_tok = (N_AUX + 1) * hidden * 2
    lengths: list[int] = []
    while sum(lengths) * per_tok < gb * 1e9 or len(lengths) < n_shards:
        lengths.append(int(torch.randint(min_tok, max_tok + 1, (1,), generator=g)))
    n_shards = min(n_shards, len(lengths))
    bounds = np.linspace(0, len(lengths), n_shards + 1).astype(int)
    for d in ("hidden_states", "h5", "h5_fp8"):
        (root / d).mkdir(parents=True, exist_ok=True)
    meta = dict(
        target_fingerprint="bench",
        tokenizer_hash="bench",
        aux_layer_ids=[2, 16, 29],
        final_layer_id=32,
        hidden_size=hidden,
    )
    refs: list[tuple[int, int, int]] = []
    for s in range(n_shards):
        idx = range(bounds[s], bounds[s + 1])
        ids = [torch.randint(0, 128_000, (lengths[i],), generator=g) for i in idx]
        args = (
            [f"bench:{i}" for i in idx],
            [x.tolist() for x in ids],
            [[1] * lengths[i] for i in idx],
        )
        with (
            ShardWriter(root / "h5" / f"shard_{s:03d}.h5", ShardMeta(**meta), *args) as w,
            ShardWriter(
                root / "h5_fp8" / f"shard_{s:03d}.h5",
                ShardMeta(**meta, storage_dtype="float8_e4m3"),
                *args,
            ) as w8,
        ):
            for j, i in enumerate(idx):
                T = lengths[i]
                hs = torch.randn(T, N_AUX + 1, hidden, generator=g).to(torch.bfloat16)  # [T, 4, H]
                for writer in (w, w8):
                    t = time.perf_counter()
                    writer.put(j, hs[:, :N_AUX].reshape(T, N_AUX * hidden), hs[:, N_AUX])
                    dt = time.perf_counter() - t
                    put_seconds[writer.meta.storage_dtype] = (
                        put_seconds.get(writer.meta.storage_dtype, 0) + dt
                    )
                save_file(
                    {"hidden_states": hs, "token_ids": ids[j].to(torch.int64)},
                    str(root / "hidden_states" / f"hs_{i}.safetensors"),
                )
                refs.append((s, j, T))
    return refs


# ----------------------------------------------------------------------------- cold cache


def drop_caches(files: list[Path]) -> str:
    """Empties the page cache of the benchmark files; returns the method used."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in files:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "posix_fadvise_dontneed"


# ----------------------------------------------------------------------------- readers


def touch(x: torch.Tensor) -> int:
    """Reads one value per 4 KiB page of x and returns its row count. load_file and ShardReader
    return tensors over memory maps: without this their bytes would never be read from disk.
    Every reader's output gets the same touch (cheap where the bytes are already in RAM)."""
    x.view(torch.int16).reshape(-1)[::2048].sum()
    return x.shape[0]


def open_readers(kind: str, root: Path, n_shards: int) -> list[ShardReader]:
    folder = root / ("h5_fp8" if kind.startswith("eyrie_fp8") else "h5")
    readers = [
        ShardReader(
            folder / f"shard_{s:03d}.h5", check_values=kind in ("eyrie_checked", "eyrie_h5py")
        )
        for s in range(n_shards)
    ]
    if kind == "eyrie_h5py":  # the fallback path, as for a chunked or compressed shard
        for r in readers:
            r._off = dict.fromkeys(r._off)
    return readers


def run_reader(kind: str, root: Path, refs, order: list[int]) -> float:
    """Reads every sample in `order` (or, for verify, scans every shard); returns seconds,
    opening included."""
    t0 = time.perf_counter()
    n_shards = 1 + max(r[0] for r in refs)
    sink = 0
    if kind == "verify":
        for s in range(n_shards):
            validate_shard(root / "h5" / f"shard_{s:03d}.h5")
        return time.perf_counter() - t0
    if kind.startswith("eyrie"):
        readers = open_readers(kind, root, n_shards)
        dtype = {"eyrie_fp8": torch.bfloat16, "eyrie_fp8_codes": torch.uint8}.get(kind)
        for i in order:
            s, j, _ = refs[i]
            x = readers[s].read(j, dtype)
            sink += touch(x["aux_hidden"]) + touch(x["final_hidden"])
            if kind == "eyrie_fp8_codes":
                x["aux_scale"].sum(), x["final_scale"].sum()
        for r in readers:
            r.close()
    else:
        hs_dir = root / "hidden_states"
        transfer = FileTransfer(hs_dir) if FileTransfer is not None else None
        for i in order:
            x = (
                transfer.get_cached(i)
                if transfer is not None
                else load_file(hs_dir / f"hs_{i}.safetensors")
            )
            sink += touch(x["hidden_states"])
    assert sink == sum(r[2] for r in refs) * (2 if kind != "peer" else 1)
    return time.perf_counter() - t0


def check_equal(root: Path, refs, n: int = 3) -> None:
    """The readers return the same tensors (the comparison is of the same data); float8 within
    its per-token bound (1/28 of the row's largest magnitude, docs/shard-format.md)."""
    n_shards = 1 + max(r[0] for r in refs)
    kinds = ("eyrie", "eyrie_checked", "eyrie_h5py", "eyrie_fp8")
    readers = {k: open_readers(k, root, n_shards) for k in kinds}
    for i in range(min(n, len(refs))):
        s, j, T = refs[i]
        st = load_file(root / "hidden_states" / f"hs_{i}.safetensors")
        hs = st["hidden_states"]  # [T, 4, H] bf16
        want = {"aux_hidden": hs[:, :N_AUX].reshape(T, -1), "final_hidden": hs[:, N_AUX]}
        for k in kinds:
            got = readers[k][s].read(j, torch.float32 if k == "eyrie_fp8" else None)
            assert torch.equal(got["input_ids"], st["token_ids"]), k
            for name, ref in want.items():
                if k == "eyrie_fp8":
                    amax = ref.float().abs().amax(dim=1)  # [T]
                    err = (got[name] - ref.float()).abs().amax(dim=1)
                    assert bool((err <= amax / 28 * (1 + 2**-18)).all()), (k, name)
                else:
                    assert torch.equal(got[name].view(torch.int16), ref.view(torch.int16)), (
                        k,
                        name,
                    )
        codes = open_readers("eyrie_fp8_codes", root, n_shards)[s].read(j, torch.uint8)
        fp8 = readers["eyrie_fp8"][s].read(j, torch.float32)
        for name, scale in (("aux_hidden", "aux_scale"), ("final_hidden", "final_scale")):
            assert torch.equal(decode_e4m3(codes[name], codes[scale]), fp8[name]), ("codes", name)
    for rs in readers.values():
        for r in rs:
            r.close()


def per_read_best(root: Path, refs, order: list[int], n: int = 8, repeats: int = 15) -> dict:
    """Warm, per sample: the best of `repeats` timings of one read + touch, summed over the first
    n samples of `order`, per reader. The minimum filters out time lost to other processes on a
    shared machine, which the whole-pass medians cannot; it is the intrinsic cost of a read."""
    n_shards = 1 + max(r[0] for r in refs)
    readers = {k: open_readers(k, root, n_shards) for k in ("eyrie", "eyrie_checked")}
    hs_dir = root / "hidden_states"
    best = {k: 0.0 for k in ("eyrie", "eyrie_checked", "peer")}
    for i in order[:n]:
        s, j, _ = refs[i]
        calls = {
            k: (lambda rd=readers[k][s]: [touch(x) for x in list(rd.read(j).values())[2:]])
            for k in readers
        }
        calls["peer"] = lambda: touch(load_file(hs_dir / f"hs_{i}.safetensors")["hidden_states"])
        for k, f in calls.items():
            f()  # warm
            ts = []
            for _ in range(repeats):
                t = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t)
            best[k] += min(ts)
    for rs in readers.values():
        for r in rs:
            r.close()
    tokens = sum(refs[i][2] for i in order[:n])
    return {
        "samples": n,
        "tokens": tokens,
        "repeats": repeats,
        "seconds": best,
        "ratio_eyrie_over_peer": best["peer"] / best["eyrie"],
        "ratio_eyrie_checked_over_peer": best["peer"] / best["eyrie_checked"],
    }


# ----------------------------------------------------------------------------- main


def machine_label() -> str:
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip()
        return name.split()[-1] if name else "gpu"
    return "cpu"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=5.0, help="hidden-state bytes per layout (GB)")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="work folder (default: a temporary folder under /work, else the system temp)",
    )
    p.add_argument("--keep", action="store_true", help="keep the data folder")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--min-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-cold", action="store_true", help="warm cells only (no root needed)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared 2-core machine two OpenMP "
        "workers stall every op whenever the other core is busy)",
    )
    p.add_argument(
        "--machine", default=None, help="label for the JSON name (default cpu / GPU model)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default benchmarks/results/read_path-<machine>.json)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    machine = args.machine or machine_label()
    out = args.out or REPO / "benchmarks" / "results" / f"read_path-{machine}.json"
    if args.dir is None:
        base = "/work" if os.access("/work", os.W_OK) else None
        root = Path(tempfile.mkdtemp(prefix="eyrie-readbench-", dir=base))
    else:
        root = args.dir
        root.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    try:
        t = time.perf_counter()
        put_s: dict[str, float] = {}
        refs = build_dataset(
            root,
            args.gb,
            args.hidden,
            args.shards,
            args.min_tokens,
            args.max_tokens,
            args.seed,
            put_s,
        )
        os.sync()
        build_s = time.perf_counter() - t
        check_equal(root, refs)
        n = len(refs)
        tokens = sum(r[2] for r in refs)
        hbytes = (
            tokens * (N_AUX + 1) * args.hidden * 2
        )  # bf16 hidden-state bytes each reader returns
        files = sorted(root.glob("h5*/*.h5")) + sorted((root / "hidden_states").glob("*"))
        sizes = {
            d: sum(f.stat().st_size for f in (root / d).iterdir())
            for d in ("h5", "h5_fp8", "hidden_states")
        }
        order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + 1)).tolist()
        modes = ["warm"] if args.no_cold else ["cold", "warm"]
        times = {k: {m: [] for m in modes} for k in KINDS}
        cold_method = None
        for rep in range(args.repeats):
            r = rep % len(KINDS)
            for k in KINDS[r:] + KINDS[:r]:  # rotate who goes first
                if "cold" in modes:
                    cold_method = drop_caches(files)
                    times[k]["cold"].append(run_reader(k, root, refs, order))
                else:
                    run_reader(k, root, refs, order)  # warm-up pass
                times[k]["warm"].append(run_reader(k, root, refs, order))
        cells = {}
        for m in modes:
            med = {k: statistics.median(times[k][m]) for k in KINDS}
            cells[m] = {
                k: {
                    "seconds": med[k],
                    "seconds_all": times[k][m],
                    "GB_per_s": hbytes / med[k] / 1e9,
                    "samples_per_s": n / med[k],
                }
                for k in KINDS
            }
            for k in KINDS:
                if k != "peer":  # per pass: pass r of k against pass r of the peer
                    per_pass = [tp / tk for tp, tk in zip(times["peer"][m], times[k][m])]
                    cells[m][f"ratio_{k}_over_peer"] = med["peer"] / med[k]
                    cells[m][f"ratio_{k}_over_peer_per_pass"] = per_pass
                    cells[m][f"ratio_{k}_over_peer_best_pass"] = min(times["peer"][m]) / min(
                        times[k][m]
                    )
        run_reader("eyrie", root, refs, order)  # warm again (the last pass may have been cold)
        run_reader("peer", root, refs, order)
        micro = per_read_best(root, refs, order)
        result = {
            "benchmark": "read_path",
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine,
            "host": {
                "cpus": os.cpu_count(),
                "mem_GiB": round(
                    os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1
                ),
                "platform": platform.platform(),
                "torch_threads": torch.get_num_threads(),
                "loadavg_at_end": os.getloadavg(),
                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            },
            "command": " ".join([Path(sys.executable).name, *sys.argv])
            if argv is None
            else "main(" + repr(argv) + ")",
            "versions": {
                "torch": torch.__version__,
                "h5py": h5py.__version__,
                "hdf5": h5py.version.hdf5_version,
                "numpy": np.__version__,
                "safetensors": __import__("safetensors").__version__,
            },
            "peer_call": "hs_connectors.FileTransfer.get_cached"
            if FileTransfer is not None
            else "safetensors.torch.load_file",
            "cold_cache_method": cold_method,
            "data": {
                "samples": n,
                "tokens": tokens,
                "hidden": args.hidden,
                "n_aux": N_AUX,
                "shards": 1 + max(r[0] for r in refs),
                "hidden_bytes": hbytes,
                "file_bytes": sizes,
                "seed": args.seed,
                "repeats": args.repeats,
                "build_seconds": build_s,
                "put_seconds": put_s,
            },
            "cells": cells,
            "per_read_best_warm": micro,
            "total_seconds": None,
        }
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    result["total_seconds"] = time.perf_counter() - t_start
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)
    print_table(result)
    print(f"wrote {out}")
    return result


def print_table(r: dict) -> None:
    d = r["data"]
    print(
        f"read_path on {r['machine']} ({r['host']['cpus']} CPUs, {r['host']['mem_GiB']} GiB): "
        f"{d['samples']} samples, {d['tokens']} tokens, {d['hidden_bytes'] / 1e9:.2f} GB bf16, "
        f"H={d['hidden']}, median of {d['repeats']}; cold cache: {r['cold_cache_method']}"
    )
    print(
        "GB/s of bf16 hidden states delivered; eyrie/peer = ratio of medians "
        "[min-max of the per-pass ratios] (ratio of the best passes)"
    )
    for m, c in r["cells"].items():
        parts = [f"peer {c['peer']['GB_per_s']:.2f} GB/s"]
        for k in KINDS:
            if k == "peer":
                continue
            pp = c[f"ratio_{k}_over_peer_per_pass"]
            parts.append(
                f"{k} {c[k]['GB_per_s']:.2f} GB/s {c[f'ratio_{k}_over_peer']:.2f}x "
                f"[{min(pp):.2f}-{max(pp):.2f}] ({c[f'ratio_{k}_over_peer_best_pass']:.2f}x)"
            )
        print(f"{m:5}: " + " | ".join(parts))
    mb = r["per_read_best_warm"]
    print(
        f"warm, best of {mb['repeats']} per sample over {mb['samples']} samples: eyrie/peer "
        f"{mb['ratio_eyrie_over_peer']:.2f}x, "
        f"eyrie_checked/peer {mb['ratio_eyrie_checked_over_peer']:.2f}x "
        f"(" + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in mb["seconds"].items()) + ")"
    )


if __name__ == "__main__":
    main()
