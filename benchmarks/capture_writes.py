"""The capture path's last leg on the host, side by side in one run: request files in /dev/shm
(written by eyrie.extract.requestfile, as the capture worker writes them) into an HDF5 shard on
local disk, by the extractor's writer threads (batches.Writers), each row timed until its
writers are done ("write") and through the shard's close (validation, the fsync before its
rename, the rename and the folder's fsync: "close"):

  (a) the disk's raw write rate for the same bytes (pwrite threads from one buffer; its close
      is the fsync), without and with write-back started as each piece is written;
  (b) "mapped": each call's files mapped and written as one batch by one writer
      (put_stored from the mapping; what the H200's round 4 ran);
  (c) "sendfile": each call's files cut into WRITERS batches, the kernel copying the rows
      (FileBatch, ShardWriter.put_from_file; what the backend does now).

(b) and (c) run three ways each: every page left to the fsync at close (as before the
write-back), write-back started as each range is written and never waited for, and as
ShardWriter does now (write-back started, a writer thread waiting past WRITEBACK_AHEAD bytes).
Rows run in turn, `--repeats` times; the table gives each row's best total, and the median and
range of its totals. No GPU and no vLLM: this is the part of the capture path the H200's round 4
found limiting.

    python benchmarks/capture_writes.py [--gib 0.8] [--shape kimi4|llama8b] [--storage bfloat16]
        [--repeats 2]
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPES = {"kimi4": (3, 7168), "llama8b": (3, 4096)}  # (aux ids, hidden size)


def make_files(scratch: Path, lengths: list[int], n_aux: int, H: int, storage: str) -> list[Path]:
    """One request file per prompt, of random finite states in their stored representation."""
    import torch

    from eyrie.extract.requestfile import request_path, write_request
    from eyrie.formats.codecs import stored_tensors

    paths, g = [], torch.Generator().manual_seed(0)
    for n, T in enumerate(lengths):
        aux = torch.randn(T, n_aux * H, generator=g, dtype=torch.float32)
        stored, bad = stored_tensors(aux, aux[:, :H], storage)
        arrays = {k: v.numpy() for k, v in stored.items()}
        arrays.update(bad=bad.numpy(), token_ids=np.arange(T, dtype=np.int64))
        paths.append(request_path(scratch, 0, f"p{n}"))
        write_request(paths[-1], arrays)
    return paths


def mapped(path: Path) -> dict[str, np.ndarray]:
    """(b)'s reader: the file's arrays as views of its mapping."""
    from eyrie.extract.requestfile import RequestFile

    f = RequestFile(path)
    m = mmap.mmap(f.fd, 0, prot=mmap.PROT_READ)
    out = {
        n: np.frombuffer(m, d, s[0] * int(np.prod(s[1:])), at).reshape(s)
        for n, (d, s, at, _) in f.arrays.items()
    }
    f.close()
    return out


# (c)'s ways: write-back on, and the bytes a writer thread may have under way before it waits
WRITEBACK = {"fsync at close only": (False, None), "write-back, no wait": (True, None)}


@contextlib.contextmanager
def writeback(on: bool, ahead: int | None):
    """ShardWriter with write-back on or off (off: as before it had any) and WRITEBACK_AHEAD."""
    from eyrie.formats import hidden_writer

    saved = hidden_writer.start_writeback, hidden_writer.WRITEBACK_AHEAD
    if not on:
        hidden_writer.start_writeback = lambda fd, at, nbytes: False
    hidden_writer.WRITEBACK_AHEAD = ahead
    try:
        yield
    finally:
        hidden_writer.start_writeback, hidden_writer.WRITEBACK_AHEAD = saved


def file_batches(paths: list[Path], lengths: list[int], call: list[int]):
    """One generate() call's request files as the capture path's FileBatches: cut into one
    batch per writer thread, rows copied by the kernel, the files closed with the last."""
    from eyrie.extract.batches import WRITERS, FileBatch
    from eyrie.extract.requestfile import BAD, TOKEN_IDS, RequestFile
    from eyrie.extract.vllm_backend import _CloseWithLast, _parts

    files = [RequestFile(paths[j]) for j in call]
    parts = _parts([lengths[j] for j in call], WRITERS)
    free = _CloseWithLast(files, len(parts))
    for part in parts:
        fs = [files[p] for p in part]
        yield FileBatch(
            [call[p] for p in part],
            [lengths[call[p]] for p in part],
            [{n: f.source(n) for n in f.arrays if n not in (BAD, TOKEN_IDS)} for f in fs],
            [(f.arrays["aux_hidden"][1], f.arrays["final_hidden"][1]) for f in fs],
            np.concatenate([f.read(BAD) for f in fs]),
            free=free,
        )


def run(
    kind: str, root: Path, paths: list[Path], lengths: list[int], n_aux: int, H: int, storage: str
) -> tuple[float, float]:
    """Seconds to write every prompt's files into a new shard (until the writers are done) and
    to close it, `kind` mapped | sendfile."""
    from extraction_vllm import calls_of

    from eyrie.extract.batches import StagedBatch, Writers
    from eyrie.extract.requestfile import BAD, TOKEN_IDS
    from eyrie.formats.hidden import ShardMeta
    from eyrie.formats.hidden_writer import ShardWriter

    calls = calls_of(lengths)
    meta = ShardMeta("fp", "tok", list(range(1, n_aux + 1)), n_aux + 1, H, storage)
    ids = [[1] * T for T in lengths]
    shard = root / f"{kind}.h5"
    t0 = time.perf_counter()
    with ShardWriter(shard, meta, [str(j) for j in range(len(lengths))], ids, ids) as w:
        with Writers(w) as writers:
            for call in calls:
                if kind == "mapped":
                    got = [mapped(paths[j]) for j in call]
                    rows = [{k: v for k, v in x.items() if k not in (BAD, TOKEN_IDS)} for x in got]
                    bad = np.concatenate([x[BAD] for x in got])
                    lens = [lengths[j] for j in call]
                    writers.submit(StagedBatch(call, lens, rows, bad, None, free=got.clear))
                    continue
                for batch in file_batches(paths, lengths, call):
                    writers.submit(batch)
            writers.join()
            written = time.perf_counter() - t0
    closed = time.perf_counter() - t0
    shard.unlink()
    return written, closed - written


def main() -> None:
    from eyrie.formats.codecs import bytes_per_token

    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=0.8, help="states written per row")
    p.add_argument("--shape", default="kimi4", choices=list(SHAPES))
    p.add_argument("--storage", default="bfloat16")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work", type=Path, default=REPO / "results", help="on local disk")
    args = p.parse_args()
    n_aux, H = SHAPES[args.shape]
    per_token = bytes_per_token(args.storage, n_aux + 1, H)
    rng = np.random.default_rng(0)
    lengths, total = [], 0
    while total * per_token < args.gib * 2**30:
        lengths.append(int(rng.integers(1024, 2049)))
        total += lengths[-1]
    args.work.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="eyrie-cw-", dir=args.work))
    nbytes = total * per_token
    from extraction_vllm import raw_writes  # (d) of the GPU benchmark: the same pwrite threads

    from eyrie.formats.hidden_writer import WRITEBACK_AHEAD

    now = (True, WRITEBACK_AHEAD)
    ways = {**WRITEBACK, f"write-back, wait past {WRITEBACK_AHEAD >> 20} MiB (now)": now}
    times: dict[str, list[tuple[float, float]]] = {}
    scratch = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        paths = make_files(scratch, lengths, n_aux, H, args.storage)
        for _ in range(args.repeats):  # rows in turn: the machine's other load falls on each
            for name, on in (("", False), (", write-back", True)):
                cached, synced = raw_writes(root / "raw", nbytes, writeback=on)
                times.setdefault(f"disk (raw pwrite){name}", []).append((cached, synced - cached))
            for kind in ("mapped", "sendfile"):
                for way, setting in ways.items():
                    with writeback(*setting):
                        times.setdefault(f"{kind}, {way}", []).append(
                            run(kind, root, paths, lengths, n_aux, H, args.storage)
                        )
    finally:
        shutil.rmtree(scratch)
    root.rmdir()
    print(
        f"{args.shape}, {args.storage}: {len(lengths)} prompts, {total:,} tokens, "
        f"{nbytes / 2**30:.2f} GiB, {os.cpu_count()} cores, best of {args.repeats}"
    )
    print("| row | write s | close s | total s | GB/s | tokens/s | of disk | median s | range s |")
    print("|---|---|---|---|---|---|---|---|---|")
    disk = min(w + c for name, ts in times.items() if name.startswith("disk") for w, c in ts)
    for name, ts in times.items():
        w, c = min(ts, key=sum)
        s, totals = w + c, [sum(t) for t in ts]
        print(
            f"| {name} | {w:.2f} | {c:.2f} | {s:.2f} | {nbytes / s / 1e9:.2f} | {total / s:,.0f} "
            f"| {disk / s:.2f} | {np.median(totals):.2f} | {min(totals):.2f}–{max(totals):.2f} |"
        )


if __name__ == "__main__":
    main()
