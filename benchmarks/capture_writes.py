"""The capture path's last leg on the host, side by side in one run: request files in /dev/shm
(written by eyrie.extract.requestfile, as the capture worker writes them) into an HDF5 shard on
local disk, by the extractor's writer threads (batches.Writers), three ways:

  (a) the disk's raw write rate for the same bytes (pwrite threads from one buffer);
  (b) "mapped": each call's files mapped and written as one batch by one writer
      (put_stored from the mapping; what the H200's round 4 ran);
  (c) "sendfile": each call's files cut into WRITERS batches, the kernel copying the rows
      (FileBatch, ShardWriter.put_from_file; what the backend does now).

No GPU and no vLLM: this is the part of the capture path the H200's round 4 found limiting.

    python benchmarks/capture_writes.py [--gib 0.8] [--shape kimi4|llama8b] [--storage bfloat16]
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPES = {"kimi4": (3, 7168), "llama8b": (3, 4096)}  # (aux ids, hidden size)
CALL_TOKENS = 32768  # extract.max_tokens_per_batch of extraction_vllm.py's rows


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


def run(kind: str, root: Path, lengths: list[int], n_aux: int, H: int, storage: str) -> float:
    """Seconds to write every prompt's files into a new shard, `kind` mapped | sendfile."""
    from eyrie.extract.batches import WRITERS, FileBatch, StagedBatch, Writers
    from eyrie.extract.requestfile import BAD, TOKEN_IDS, RequestFile
    from eyrie.extract.vllm_backend import _CloseWithLast, _parts
    from eyrie.formats.hidden import ShardMeta
    from eyrie.formats.hidden_writer import ShardWriter

    scratch = Path(tempfile.mkdtemp(dir="/dev/shm"))
    paths = make_files(scratch, lengths, n_aux, H, storage)
    calls, call, n = [], [], 0
    for j, T in enumerate(lengths):
        if call and n + T > CALL_TOKENS:
            calls.append(call)
            call, n = [], 0
        call.append(j)
        n += T
    calls.append(call)
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
                files = [RequestFile(paths[j]) for j in call]
                parts = _parts([lengths[j] for j in call], WRITERS)
                free = _CloseWithLast(files, len(parts))
                for part in parts:
                    fs = [files[p] for p in part]
                    writers.submit(
                        FileBatch(
                            [call[p] for p in part],
                            [lengths[call[p]] for p in part],
                            [
                                {n: f.source(n) for n in f.arrays if n not in (BAD, TOKEN_IDS)}
                                for f in fs
                            ],
                            [(f.arrays["aux_hidden"][1], f.arrays["final_hidden"][1]) for f in fs],
                            np.concatenate([f.read(BAD) for f in fs]),
                            free=free,
                        )
                    )
            writers.join()
            seconds = time.perf_counter() - t0  # the shard's fsync and rename on exit not timed
    for p in paths:
        p.unlink()
    scratch.rmdir()
    shard.unlink()
    return seconds


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

    cached = min(raw_writes(root / "raw", nbytes)[0] for _ in range(args.repeats))
    rows = {"disk (raw pwrite)": cached}
    for kind in ("mapped", "sendfile"):
        rows[kind] = min(
            run(kind, root, lengths, n_aux, H, args.storage) for _ in range(args.repeats)
        )
    root.rmdir()
    print(
        f"{args.shape}, {args.storage}: {len(lengths)} prompts, {total:,} tokens, "
        f"{nbytes / 2**30:.2f} GiB, {os.cpu_count()} cores"
    )
    print("| row | seconds | GB/s | tokens/s | of disk |")
    print("|---|---|---|---|---|")
    disk = rows["disk (raw pwrite)"]
    for name, s in rows.items():
        print(f"| {name} | {s:.2f} | {nbytes / s / 1e9:.2f} | {total / s:,.0f} | {disk / s:.2f} |")


if __name__ == "__main__":
    main()
