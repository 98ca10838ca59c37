"""What the way a cold read fills the page cache costs the warm reads that come after it.

Why: eyrie's ShardReader maps a sample's bytes (eyrie.formats.pagecache.map_private) and, when
the first page is not cached, asks for the whole range at once with posix_fadvise(WILLNEED).
That readahead fills the page cache with 4 KiB pages, while the readahead of page faults (and of
large reads) builds large folios, which a later warm fault maps many pages at a time. This
measures both sides of that trade on one file, for the same random ranges ("samples"), read cold
in each way:
  - fault: map the range and touch it (page faults and the kernel's mmap readahead);
  - willneed: map, posix_fadvise(WILLNEED) over the range, touch (what map_private does);
  - populate: map, madvise(MADV_POPULATE_READ) over the range, touch;
  - pread: one pread of the range into a fresh buffer;
  - sequential (the reference for a cache of large folios): the whole file by 1 MiB preads;
then, for each, the warm read map_private makes (map + touch one byte per 4 KiB page), the best
of --repeats per sample, summed over the samples. Each way is measured --rounds times, the ways
in turn; the table gives medians.

Cold cache: `echo 3 > /proc/sys/vm/drop_caches` after `sync` (root); otherwise, or with
--dontneed, posix_fadvise(DONTNEED) on the file. The JSON names the method used.

    .venv/bin/python benchmarks/page_cache_fill.py                   # the BENCHMARKS.md run
    .venv/bin/python benchmarks/page_cache_fill.py --file-mb 16 --sample-mb 2 --samples 3 \
        --dontneed --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from eyrie.formats import pagecache as shards_pagecache  # noqa: E402

MADV_POPULATE_READ = 22  # Linux 5.14
WAYS = ("fault", "willneed", "populate", "pread", "sequential")


def drop_cache(fd: int, dontneed: bool) -> str:
    os.sync()
    if dontneed:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return "posix_fadvise_dontneed"
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return "posix_fadvise_dontneed"


def touch(a: np.ndarray) -> int:
    return int(a[::4096].sum())


def private_map(fd: int, start: int, length: int) -> tuple[int, int, np.ndarray]:
    """map_private's map without its probe or advice: (address, size, array over the range)."""
    base = start - start % mmap.PAGESIZE
    size = length + start - base
    addr = shards_pagecache._LIBC.mmap(
        None,
        size,
        mmap.PROT_READ | mmap.PROT_WRITE,
        mmap.MAP_PRIVATE | shards_pagecache.MAP_NORESERVE,
        fd,
        base,
    )
    if addr is None or addr == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap")
    return addr, size, np.asarray(shards_pagecache._Map(addr, size))[start - base :]


def read_cold(way: str, fd: int, start: int, length: int) -> None:
    if way == "pread":
        buf = np.empty(length, np.uint8)
        os.preadv(fd, [buf], start)
        touch(buf)
        return
    addr, size, a = private_map(fd, start, length)
    if way == "willneed":
        os.posix_fadvise(fd, start - start % mmap.PAGESIZE, size, os.POSIX_FADV_WILLNEED)
    elif way == "populate" and shards_pagecache._LIBC.madvise(addr, size, MADV_POPULATE_READ):
        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_READ)")
    touch(a)


def file_huge_pages_kb() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("FileHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def one_round(
    way: str, path: Path, starts: list[int], length: int, repeats: int, dontneed: bool
) -> dict:
    fd = os.open(path, os.O_RDONLY)
    try:
        method = drop_cache(fd, dontneed)
        t = time.perf_counter()
        if way == "sequential":
            size = os.fstat(fd).st_size
            for off in range(0, size, 1 << 20):
                os.pread(fd, 1 << 20, off)
            cold_bytes = size
        else:
            for s in starts:
                read_cold(way, fd, s, length)
            cold_bytes = len(starts) * length
        cold_s = time.perf_counter() - t
        huge_kb = file_huge_pages_kb()
        warm = 0.0
        for s in starts:
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                touch(shards_pagecache.map_private(fd, s, length))
                best = min(best, time.perf_counter() - t)
            warm += best
        return {
            "cold_gb_s": cold_bytes / cold_s / 1e9,
            "warm_ms": warm * 1e3,
            "file_huge_pages_kb": huge_kb,
            "cold_cache_method": method,
        }
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file-mb", type=int, default=512)
    ap.add_argument("--sample-mb", type=float, default=40)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5, help="warm reads per sample (best kept)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--dontneed",
        action="store_true",
        help="cold cache by posix_fadvise(DONTNEED) "
        "on the file only, even as root (leaves the rest of the page cache alone)",
    )
    ap.add_argument(
        "--dir", help="work folder (default: a temporary folder under /work, else the system temp)"
    )
    ap.add_argument("--out", help="JSON path (default benchmarks/results/page_cache_fill-cpu.json)")
    args = ap.parse_args(argv)
    if shards_pagecache._LIBC is None:
        sys.exit("page_cache_fill: needs Linux (eyrie.formats.pagecache maps samples only there)")
    shards_pagecache._LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    size, length = args.file_mb << 20, int(args.sample_mb * (1 << 20))
    if length * args.samples > size:
        sys.exit("page_cache_fill: --samples x --sample-mb must fit in --file-mb")
    base = args.dir or ("/work" if os.access("/work", os.W_OK) else None)
    with tempfile.TemporaryDirectory(dir=base, prefix="eyrie-pcfill-") as tmp:
        path = Path(tmp) / "data.bin"
        with open(path, "wb") as f:
            rng = np.random.default_rng(args.seed)
            for off in range(0, size, 1 << 24):
                f.write(rng.integers(0, 256, min(1 << 24, size - off), np.uint8).tobytes())
        # disjoint ranges at random 2-byte-aligned offsets (rows of bfloat16), in random order
        slots = np.random.default_rng(args.seed + 1).permutation(size // length)[: args.samples]
        starts = [
            int(k) * length + 2 * int(np.random.default_rng(int(k)).integers(0, 1024))
            for k in slots
        ]
        starts = [min(s, size - length) for s in starts]
        runs: dict[str, list[dict]] = {w: [] for w in WAYS}
        for _ in range(args.rounds):
            for way in WAYS:
                runs[way].append(one_round(way, path, starts, length, args.repeats, args.dontneed))
    table = {
        w: {
            "cold_gb_s": statistics.median(r["cold_gb_s"] for r in rs),
            "warm_ms": statistics.median(r["warm_ms"] for r in rs),
            "warm_ms_range": [min(r["warm_ms"] for r in rs), max(r["warm_ms"] for r in rs)],
            "file_huge_pages_kb": [r["file_huge_pages_kb"] for r in rs],
        }
        for w, rs in runs.items()
    }
    result = {
        "benchmark": "page_cache_fill",
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "command": "python "
        + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "file_mb": args.file_mb,
        "sample_mb": args.sample_mb,
        "samples": args.samples,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "cold_cache_method": runs["fault"][0]["cold_cache_method"],
        "ways": table,
        "runs": runs,
    }
    print(
        f"page_cache_fill: {args.samples} samples of {args.sample_mb:g} MiB from a {args.file_mb} "
        f"MiB file; medians of {args.rounds} rounds; cold cache: {result['cold_cache_method']}"
    )
    print(
        f"{'filled by':12s} {'cold GB/s':>10s} {'then warm map+touch':>20s}  "
        "FileHugePages (system-wide)"
    )
    for w, r in table.items():
        lo, hi = r["warm_ms_range"]
        print(
            f"{w:12s} {r['cold_gb_s']:10.2f} {r['warm_ms']:11.2f} ms [{lo:.2f}-{hi:.2f}]  "
            f"{r['file_huge_pages_kb']} kB"
        )
    out = (
        Path(args.out) if args.out else REPO / "benchmarks" / "results" / "page_cache_fill-cpu.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
