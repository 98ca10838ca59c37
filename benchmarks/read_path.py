"""Shard read-path benchmark: eyrie's HDF5 ShardReader against speculators' per-sample safetensors.

Why: training reads every sample once per epoch in random order; the read path must not be slower
than the format it replaces (eyrie issue 5, item 2; goal: eyrie/peer >= 1.0x in every cell).

What it does, in one run on one machine:
  1. builds random bf16 hidden states of a realistic shape ([T, n_aux + 1, H] per sample, T in
     --min-tokens..--max-tokens, ~--gb GB in all) and writes the SAME tensors twice:
     - eyrie: several HDF5 shards through eyrie.shards.ShardWriter (docs/shard-format.md);
     - peer: one `hs_<i>.safetensors` per sample with speculators' keys
       (`hidden_states` [T, n_aux + 1, H] bfloat16, `token_ids` [T] int64; speculators/train/data.py).
  2. reads every sample once, in one random order shared by all readers, with
     - eyrie: ShardReader.read(i), readers opened once per shard, as eyrie/packing.py does;
     - peer: hs_connectors.FileTransfer.get_cached(i) (safetensors.torch.load_file), the call
       speculators 0.9.0's data path makes for a cached sample;
     - prototype (NOT used by eyrie): `proto_read` below, one pread per dataset at the dataset's
       file offset into a fresh buffer, and a cheaper finite check (same contract as read());
     - prototype "proto_reuse" (NOT used by eyrie): the same into one grow-only buffer per
       dataset and reader, valid until the next read (an API change: the caller must copy first,
       which eyrie/packing.py's batch() does anyway with .float());
     - prototype "proto_mmap" (NOT used by eyrie): zero-copy read-only tensors over a memory map
       of the shard, as load_file returns, with the finite check (which reads every byte);
     every reader's hidden tensors get the same `touch` (one value per 4 KiB page), because
     load_file returns memory-mapped tensors whose bytes are otherwise never read;
     each cold (page cache dropped first) and warm (right after, files cached), --repeats times
     with the reader order rotated; reports the median.
  3. prints a table and writes JSON (figures, ratios eyrie/peer and proto/peer, command, machine,
     versions, cold-cache method) to benchmarks/results/read_path-<machine>.json.
It also times the parts of ShardReader.read on a warm cache (profile section) to show where the
time goes.

Cold cache: `echo 3 > /proc/sys/vm/drop_caches` after `sync` (root); if that is not allowed,
posix_fadvise(POSIX_FADV_DONTNEED) on every benchmark file. The JSON names the method used.

    .venv/bin/python benchmarks/read_path.py --gb 5            # the BENCHMARKS.md run
    .venv/bin/python benchmarks/read_path.py --gb 0.005 --hidden 64 --no-cold --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import h5py
import numpy as np
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from eyrie.shards import ShardMeta, ShardReader, ShardWriter, all_finite, from_storage  # noqa: E402

try:  # speculators' own loader for a cached sample (hs_connectors ships with speculators 0.9.0)
    from hs_connectors import FileTransfer
except ImportError:  # same call underneath: safetensors.torch.load_file(path)
    FileTransfer = None

N_AUX = 3


# ----------------------------------------------------------------------------- data

def build_dataset(root: Path, gb: float, hidden: int, n_shards: int, min_tok: int, max_tok: int,
                  seed: int) -> list[tuple[int, int, int]]:
    """Writes both layouts under root; returns (shard, index in shard, tokens) per global sample."""
    g = torch.Generator().manual_seed(seed)
    per_tok = (N_AUX + 1) * hidden * 2
    lengths: list[int] = []
    while sum(lengths) * per_tok < gb * 1e9 or len(lengths) < n_shards:
        lengths.append(int(torch.randint(min_tok, max_tok + 1, (1,), generator=g)))
    n_shards = min(n_shards, len(lengths))
    bounds = np.linspace(0, len(lengths), n_shards + 1).astype(int)
    (root / "hidden_states").mkdir(parents=True, exist_ok=True)
    (root / "h5").mkdir(parents=True, exist_ok=True)
    meta = ShardMeta(target_fingerprint="bench", tokenizer_hash="bench",
                     aux_layer_ids=[2, 16, 29], final_layer_id=32, hidden_size=hidden)
    refs: list[tuple[int, int, int]] = []
    for s in range(n_shards):
        idx = range(bounds[s], bounds[s + 1])
        ids = [torch.randint(0, 128_000, (lengths[i],), generator=g) for i in idx]
        masks = [[1] * lengths[i] for i in idx]
        with ShardWriter(root / "h5" / f"shard_{s:03d}.h5", meta, [f"bench:{i}" for i in idx],
                         [x.tolist() for x in ids], masks) as w:
            for j, i in enumerate(idx):
                T = lengths[i]
                hs = torch.randn(T, N_AUX + 1, hidden, generator=g).to(torch.bfloat16)  # [T, 4, H]
                w.put(j, hs[:, :N_AUX].reshape(T, N_AUX * hidden), hs[:, N_AUX])
                save_file({"hidden_states": hs, "token_ids": ids[j].to(torch.int64)},
                          str(root / "hidden_states" / f"hs_{i}.safetensors"))
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


# ----------------------------------------------------------------------------- prototype reader

class ProtoReader:
    """PROTOTYPE, not used by eyrie: ShardReader's checks at open, then read(i) does one
    os.preadv per dataset at its file offset (contiguous, uncompressed: docs/shard-format.md)
    straight into a fresh torch buffer, and checks finiteness with one and+max over a reused
    cache-sized scratch buffer instead of two full-size temporaries."""

    CHUNK = 1 << 18  # uint16 values per finite-check step (512 KiB, stays in L2)

    def __init__(self, path: Path, reuse: bool = False, use_mmap: bool = False):
        self.reuse, self.use_mmap = reuse, use_mmap  # True: read into one buffer per dataset, valid until the next read()
        self.bufs: dict[str, torch.Tensor] = {}
        self.base = ShardReader(path)  # all of eyrie's open-time checks
        f, self.meta = self.base.f, self.base.meta
        assert self.meta.storage_dtype == "bfloat16"
        self.ids = self.base.f["input_ids"][:].astype(np.int64)  # [T] small: kept in memory
        self.mask = self.base.f["loss_mask"][:].astype(bool)  # [T]
        self.offsets = self.base.offsets
        self.layout = {}
        for name in ("aux_hidden", "final_hidden"):
            ds = f[name]
            off = ds.id.get_offset()
            if off is None or ds.chunks is not None or ds.compression is not None:
                raise RuntimeError(f"{path}: {name} not contiguous; prototype cannot read it")
            self.layout[name] = (off, ds.shape[1])
        self.fd = os.open(path, os.O_RDONLY)
        # use_mmap: tensors are read-only views of a shared memory map, as load_file returns
        self.mm = mmap.mmap(self.fd, 0, prot=mmap.PROT_READ) if use_mmap else None
        self.scratch = np.empty(self.CHUNK, np.uint16)

    def _finite(self, a: np.ndarray) -> bool:  # a: uint16 bf16 patterns, any shape
        flat = a.reshape(-1)
        for k in range(0, flat.size, self.CHUNK):
            part = flat[k:k + self.CHUNK]
            s = self.scratch[:part.size]
            np.bitwise_and(part, 0x7FFF, out=s)
            if s.max(initial=0) >= 0x7F80:
                return False
        return True

    def read(self, i: int) -> dict[str, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        out = {"input_ids": torch.from_numpy(self.ids[a:b].copy()),
               "loss_mask": torch.from_numpy(self.mask[a:b].copy())}
        for name, (off, width) in self.layout.items():
            if self.mm is not None:  # zero-copy view; the finite check faults the pages in
                with warnings.catch_warnings():  # read-only map: torch warns it cannot enforce it
                    warnings.simplefilter("ignore", UserWarning)
                    buf = torch.frombuffer(self.mm, dtype=torch.int16, count=(b - a) * width,
                                           offset=off + a * width * 2).view(b - a, width)
                if not self._finite(buf.numpy().view(np.uint16)):
                    raise ValueError(f"{self.base.path}: sample {i}: non-finite values in {name}")
                out[name] = buf.view(torch.bfloat16)
                continue
            if self.reuse:  # grow-only buffer: no fresh pages to fault in on every read
                if name not in self.bufs or self.bufs[name].numel() < (b - a) * width:
                    self.bufs[name] = torch.empty((b - a) * width, dtype=torch.int16)
                buf = self.bufs[name][:(b - a) * width].view(b - a, width)  # [T_i, width]
            else:
                buf = torch.empty(b - a, width, dtype=torch.int16)  # [T_i, width]
            arr = buf.numpy()
            nbytes = arr.nbytes
            got = os.preadv(self.fd, [memoryview(arr).cast("B")], off + a * width * 2)
            if got != nbytes:
                raise OSError(f"{self.base.path}: short read of {name} sample {i}")
            if not self._finite(arr.view(np.uint16)):
                raise ValueError(f"{self.base.path}: sample {i}: non-finite values in {name}")
            out[name] = buf.view(torch.bfloat16)
        return out

    def close(self) -> None:
        if self.mm is not None:
            self.mm = None  # tensors handed out keep the map alive until they are freed
        os.close(self.fd)
        self.base.close()


# ----------------------------------------------------------------------------- readers

def touch(x: torch.Tensor) -> int:
    """Reads one value per 4 KiB page of x and returns its row count. safetensors' load_file
    returns tensors over a memory map: without this the peer's bytes would never be read from
    disk. Every reader's output gets the same touch (cheap where the bytes are already in RAM)."""
    x.view(torch.int16).reshape(-1)[::2048].sum()
    return x.shape[0]


def run_reader(kind: str, root: Path, refs, order: list[int]) -> float:
    """Reads every sample in `order`; returns seconds (opening included)."""
    t0 = time.perf_counter()
    n_shards = 1 + max(r[0] for r in refs)
    sink = 0
    if kind in ("eyrie", "proto", "proto_reuse", "proto_mmap"):
        paths = [root / "h5" / f"shard_{s:03d}.h5" for s in range(n_shards)]
        readers = [ShardReader(p) for p in paths] if kind == "eyrie" else \
            [ProtoReader(p, reuse=kind == "proto_reuse", use_mmap=kind == "proto_mmap")
             for p in paths]
        for i in order:
            s, j, _ = refs[i]
            x = readers[s].read(j)
            sink += touch(x["aux_hidden"]) + touch(x["final_hidden"])
        for r in readers:
            r.close()
    else:
        hs_dir = root / "hidden_states"
        transfer = FileTransfer(hs_dir) if FileTransfer is not None else None
        for i in order:
            x = transfer.get_cached(i) if transfer is not None else \
                load_file(hs_dir / f"hs_{i}.safetensors")
            sink += touch(x["hidden_states"])
    assert sink == sum(r[2] for r in refs) * (2 if kind != "peer" else 1)
    return time.perf_counter() - t0


def check_equal(root: Path, refs, n: int = 3) -> None:
    """The three readers return the same tensors (the comparison is of the same data)."""
    n_shards = 1 + max(r[0] for r in refs)
    ey = [ShardReader(root / "h5" / f"shard_{s:03d}.h5") for s in range(n_shards)]
    pr = [ProtoReader(root / "h5" / f"shard_{s:03d}.h5") for s in range(n_shards)]
    pm = [ProtoReader(root / "h5" / f"shard_{s:03d}.h5", use_mmap=True) for s in range(n_shards)]
    for i, rd in ((i, rd) for i in range(min(n, len(refs))) for rd in (pr, pm)):
        s, j, T = refs[i]
        a, p = ey[s].read(j), rd[s].read(j)
        st = load_file(root / "hidden_states" / f"hs_{i}.safetensors")
        hs = st["hidden_states"]  # [T, 4, H]
        assert torch.equal(a["aux_hidden"].view(torch.int16),
                           hs[:, :N_AUX].reshape(T, -1).view(torch.int16))
        assert torch.equal(a["final_hidden"].view(torch.int16), hs[:, N_AUX].view(torch.int16))
        for k in a:
            assert torch.equal(a[k].view(torch.int16) if a[k].dtype == torch.bfloat16 else a[k],
                               p[k].view(torch.int16) if p[k].dtype == torch.bfloat16 else p[k]), k
        assert torch.equal(a["input_ids"], st["token_ids"])
    for r in ey + pr + pm:
        r.close()


def profile_eyrie(root: Path, refs, order: list[int]) -> dict[str, float]:
    """Warm cache: seconds per part of ShardReader.read, summed over the samples in `order`."""
    n_shards = 1 + max(r[0] for r in refs)
    readers = [ShardReader(root / "h5" / f"shard_{s:03d}.h5") for s in range(n_shards)]
    parts = dict(h5py_slices=0.0, all_finite=0.0, from_storage=0.0, ids_mask_astype=0.0,
                 read_total=0.0, memcpy_floor=0.0)
    for i in order:
        s, j, _ = refs[i]
        r = readers[s]
        a, b = int(r.offsets[j]), int(r.offsets[j + 1])
        t = time.perf_counter()
        ids, mask = r._ids[a:b], r._mask[a:b]
        aux, final = r._aux[a:b], r._final[a:b]
        t1 = time.perf_counter()
        all_finite(aux, "bfloat16"), all_finite(final, "bfloat16")
        t2 = time.perf_counter()
        from_storage(aux, "bfloat16"), from_storage(final, "bfloat16")
        t3 = time.perf_counter()
        torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(bool))
        t4 = time.perf_counter()
        r.read(j)
        t5 = time.perf_counter()
        aux.copy(), final.copy()  # one copy of the bytes into fresh memory: a floor for any reader
        t6 = time.perf_counter()
        for k, v in zip(parts, (t1 - t, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
            parts[k] += v
    for r in readers:
        r.close()
    return parts


# ----------------------------------------------------------------------------- main

def machine_label() -> str:
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip()
        return name.split()[-1] if name else "gpu"
    return "cpu"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=5.0, help="hidden-state bytes per layout (GB)")
    p.add_argument("--dir", type=Path, default=None,
                   help="work folder (default: a temporary folder under /work, else the system temp)")
    p.add_argument("--keep", action="store_true", help="keep the data folder")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--min-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-cold", action="store_true", help="warm cells only (no root needed)")
    p.add_argument("--machine", default=None, help="label for the JSON name (default cpu / GPU model)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default benchmarks/results/read_path-<machine>.json)")
    args = p.parse_args(argv)

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
        refs = build_dataset(root, args.gb, args.hidden, args.shards, args.min_tokens,
                             args.max_tokens, args.seed)
        os.sync()
        build_s = time.perf_counter() - t
        check_equal(root, refs)
        n = len(refs)
        tokens = sum(r[2] for r in refs)
        hbytes = tokens * (N_AUX + 1) * args.hidden * 2  # hidden-state bytes each reader returns
        files = sorted((root / "h5").glob("*.h5")) + sorted((root / "hidden_states").glob("*"))
        order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + 1)).tolist()
        kinds = ["eyrie", "peer", "proto", "proto_reuse", "proto_mmap"]
        modes = ["warm"] if args.no_cold else ["cold", "warm"]
        times = {k: {m: [] for m in modes} for k in kinds}
        cold_method = None
        for rep in range(args.repeats):
            for k in kinds[rep % 5:] + kinds[:rep % 5]:  # rotate who goes first
                if "cold" in modes:
                    cold_method = drop_caches(files)
                    times[k]["cold"].append(run_reader(k, root, refs, order))
                else:
                    run_reader(k, root, refs, order)  # warm-up pass
                times[k]["warm"].append(run_reader(k, root, refs, order))
        run_reader("eyrie", root, refs, order)  # the last cell may have been a peer cold pass
        profile = profile_eyrie(root, refs, order)
        cells = {}
        for m in modes:
            med = {k: statistics.median(times[k][m]) for k in kinds}
            cells[m] = {k: {"seconds": med[k], "seconds_all": times[k][m],
                            "GB_per_s": hbytes / med[k] / 1e9, "samples_per_s": n / med[k]}
                        for k in kinds}
            cells[m]["ratio_eyrie_over_peer"] = med["peer"] / med["eyrie"]
            cells[m]["ratio_proto_over_peer"] = med["peer"] / med["proto"]
            cells[m]["ratio_proto_reuse_over_peer"] = med["peer"] / med["proto_reuse"]
            cells[m]["ratio_proto_mmap_over_peer"] = med["peer"] / med["proto_mmap"]
        result = {
            "benchmark": "read_path",
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine,
            "host": {"cpus": os.cpu_count(), "mem_GiB": round(os.sysconf("SC_PAGE_SIZE")
                     * os.sysconf("SC_PHYS_PAGES") / 2**30, 1), "platform": platform.platform(),
                     "torch_threads": torch.get_num_threads(),
                     "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
            "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None
            else "main(" + repr(argv) + ")",
            "versions": {"torch": torch.__version__, "h5py": h5py.__version__,
                         "hdf5": h5py.version.hdf5_version, "numpy": np.__version__,
                         "safetensors": __import__("safetensors").__version__},
            "peer_call": "hs_connectors.FileTransfer.get_cached" if FileTransfer is not None
            else "safetensors.torch.load_file",
            "cold_cache_method": cold_method,
            "data": {"samples": n, "tokens": tokens, "hidden": args.hidden, "n_aux": N_AUX,
                     "shards": 1 + max(r[0] for r in refs), "hidden_bytes": hbytes,
                     "seed": args.seed, "repeats": args.repeats, "build_seconds": build_s},
            "cells": cells,
            "profile_warm_eyrie_read_seconds": profile,
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
    print(f"read_path on {r['machine']} ({r['host']['cpus']} CPUs, {r['host']['mem_GiB']} GiB): "
          f"{d['samples']} samples, {d['tokens']} tokens, {d['hidden_bytes'] / 1e9:.2f} GB, "
          f"H={d['hidden']}, median of {d['repeats']}; cold cache: {r['cold_cache_method']}")
    print(f"{'cache':6} {'eyrie GB/s':>10} {'peer GB/s':>10} {'eyrie smp/s':>11} {'peer smp/s':>10} "
          f"{'eyrie/peer':>10} | {'proto GB/s':>10} {'proto/peer':>10} {'reuse GB/s':>10} "
          f"{'reuse/peer':>10} {'mmap GB/s':>10} {'mmap/peer':>10}")
    for m, c in r["cells"].items():
        print(f"{m:6} {c['eyrie']['GB_per_s']:10.2f} {c['peer']['GB_per_s']:10.2f} "
              f"{c['eyrie']['samples_per_s']:11.1f} {c['peer']['samples_per_s']:10.1f} "
              f"{c['ratio_eyrie_over_peer']:9.2f}x | {c['proto']['GB_per_s']:10.2f} "
              f"{c['ratio_proto_over_peer']:9.2f}x {c['proto_reuse']['GB_per_s']:10.2f} "
              f"{c['ratio_proto_reuse_over_peer']:9.2f}x {c['proto_mmap']['GB_per_s']:10.2f} "
              f"{c['ratio_proto_mmap_over_peer']:9.2f}x")
    print("proto, reuse: prototype readers in this script, NOT used by eyrie (see ProtoReader)")
    prof = r["profile_warm_eyrie_read_seconds"]
    tot = prof["read_total"]
    print("ShardReader.read, warm, parts timed separately (s, share of read_total): " + ", ".join(
        f"{k} {v:.2f} ({v / tot:.0%})" for k, v in prof.items()))


if __name__ == "__main__":
    main()
