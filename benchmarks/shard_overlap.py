"""Shards back to back through one engine, the close of one behind the next one's compute
(eyrie.extract.serving.Behind) against one shard at a time (the engine before it), side by side
in one run, on a CPU, with the real Extractor, writer threads, ShardWriter and Behind:

  (a) the engine alone: a stand-in for the capture path's engine (`PacedCaptureStandin`, named
      so: no model runs) that yields each generate() call's request files (made once in
      /dev/shm, as the capture worker writes them) no sooner than a GPU computing at
      `--engine-tokens-per-s` would, one call computed ahead as VllmBackend.states does;
  (d) the disk's raw write rate for the same bytes, write-back on, each shard fsynced;
  (1) "one at a time": `Extractor.extract` per shard (start, then finish: writes, fsync, rename);
  (2) "close behind": `Extractor.start` per shard, its `PendingShard.finish` handed to `Behind`.

Ratio = end to end / min(a, d); the issue's goal is >= 0.85. The default engine rate is the
H200's measured bare prefill for the shape (BENCHMARKS.md "vLLM extraction on one GPU", round 4):
what this machine's host side would have to keep up with. Rows run in turn, `--repeats` times.

    python benchmarks/shard_overlap.py [--shape llama8b|kimi4] [--shards 4] [--gib 0.8]
        [--engine-tokens-per-s N] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

# (aux ids, hidden size, the H200's bare prefill in tokens/s: round 4, 160 prompts)
SHAPES = {"llama8b": (3, 4096, 41_906), "kimi4": (3, 7168, 48_719)}


def paced_standin(paths: list[Path], lengths: list[int], rate: float):
    """A backend class whose states() yields the request files' rows as the capture path's
    FileBatches, a call no sooner than an engine at `rate` tokens/s would have computed it."""
    from capture_writes import file_batches
    from extraction_vllm import calls_of

    calls = calls_of(lengths)

    class PacedCaptureStandin:
        def __init__(self, *args):
            pass

        def states(self, input_ids, storage):
            # the engine computes call n+1 from the moment the driver takes call n
            ready = time.monotonic() + sum(lengths[j] for j in calls[0]) / rate
            for k, call in enumerate(calls):
                now = time.monotonic()
                if ready > now:
                    time.sleep(ready - now)
                if k + 1 < len(calls):
                    ready = max(now, ready) + sum(lengths[j] for j in calls[k + 1]) / rate
                yield from file_batches(paths, lengths, call)

        def close(self):
            pass

    return PacedCaptureStandin


def extractor(root: Path, n_aux: int, H: int, storage: str, backend):
    """An Extractor on a config-only target (no weights: the stand-in is its backend)."""
    from extraction_vllm import MAX_TOKENS_PER_CALL

    from eyrie.arch.target import fingerprint
    from eyrie.extract import extractor as module

    config = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        num_hidden_layers=32,
        hidden_size=H,
        intermediate_size=4 * H,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        torch_dtype="bfloat16",
    )
    target = root / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    (target / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    preflight = root / "preflight.json"
    preflight.write_text(json.dumps({"ok": True, "target": {"fingerprint": fingerprint(config)}}))
    settings = {
        "extract": {
            "backend": "hf",
            "device": "cpu",
            "dtype": "bfloat16",
            "storage_dtype": storage,
            "max_tokens_per_batch": MAX_TOKENS_PER_CALL,
        },
        "layers": {"aux_ids": list(range(1, n_aux + 1))},
        "trust_remote_code": False,
    }
    module.backend_class = lambda name: backend  # the stand-in instead of a model load
    return module.Extractor(target, preflight, settings)


def main() -> None:
    from capture_writes import make_files
    from extraction_vllm import raw_writes, run_shards

    from eyrie.formats.codecs import bytes_per_token

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama8b", choices=list(SHAPES))
    p.add_argument("--storage", default="bfloat16")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--gib", type=float, default=0.8, help="states per shard")
    p.add_argument("--engine-tokens-per-s", type=float, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", type=Path, default=REPO / "results", help="on local disk")
    args = p.parse_args()
    n_aux, H, measured = SHAPES[args.shape]
    rate = args.engine_tokens_per_s or measured
    per_token = bytes_per_token(args.storage, n_aux + 1, H)
    rng = np.random.default_rng(0)
    lengths, total = [], 0
    while total * per_token < args.gib * 2**30:
        lengths.append(int(rng.integers(1024, 2049)))
        total += lengths[-1]
    ids = [np.ones(T, np.int32) for T in lengths]
    tokenized = (
        [f"s{j}" for j in range(len(lengths))],
        ids,
        [np.ones(T, np.uint8) for T in lengths],
    )
    args.work.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="eyrie-so-", dir=args.work))
    scratch = Path(tempfile.mkdtemp(dir="/dev/shm"))
    nbytes = total * per_token
    times: dict[str, list[dict]] = {}
    try:
        paths = make_files(scratch, lengths, n_aux, H, args.storage)
        standin = paced_standin(paths, lengths, rate)
        ex = extractor(root, n_aux, H, args.storage, standin)
        for _ in range(args.repeats):  # rows in turn: the machine's other load falls on each
            t0 = time.perf_counter()
            for _ in range(args.shards):
                for item in ex.backend.states(ids, None):
                    item.release()
            times.setdefault("engine alone (a)", []).append({"seconds": time.perf_counter() - t0})
            synced = sum(
                raw_writes(root / "raw", nbytes, writeback=True)[1] for _ in range(args.shards)
            )
            times.setdefault("disk, write-back, fsync per shard (d)", []).append(
                {"seconds": synced}
            )
            for name, behind in (("one at a time (before)", False), ("close behind (now)", True)):
                times.setdefault(name, []).append(
                    run_shards(ex, tokenized, root / "shard", args.shards, behind)
                )
    finally:
        shutil.rmtree(scratch)
        shutil.rmtree(root)
    tokens = total * args.shards
    print(
        f"{args.shape}, {args.storage}: {args.shards} shards of {len(lengths)} prompts, "
        f"{total:,} tokens, {nbytes / 2**30:.2f} GiB each; engine stand-in at {rate:,.0f} "
        f"tokens/s; {os.cpu_count()} cores; best of {args.repeats}"
    )
    # the slower of the two limits, in seconds: ratio = tokens/s over min(a, d) tokens/s
    limit = max(min(r["seconds"] for r in times[k]) for k in times if k.endswith(("(a)", "(d)")))
    print(
        "| row | seconds | tokens/s | GB/s | ratio | in start() s | writers wait s | close s "
        "| range s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rows in times.items():
        best = min(rows, key=lambda r: r["seconds"])
        s = best["seconds"]
        per = [f"{best[k]:.2f}" if k in best else "" for k in ("compute_s", "writers_s", "close_s")]
        spread = [r["seconds"] for r in rows]
        print(
            f"| {name} | {s:.2f} | {tokens / s:,.0f} | {nbytes * args.shards / s / 1e9:.2f} | "
            f"{limit / s:.2f} | {' | '.join(per)} | {min(spread):.2f}–{max(spread):.2f} |"
        )


if __name__ == "__main__":
    main()
