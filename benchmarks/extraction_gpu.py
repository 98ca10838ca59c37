"""Extraction throughput on one GPU: in one run, on the same model and prompts,

  (a) the bare forward pass of the target's base model, same batches, no capture, no copies, no
      writes: the ceiling;
  (b) eyrie's extraction (`Extractor.extract`: hooks, device-to-host copies, the HDF5 writer
      thread) into a shard on local disk;
  (c) the naive peer of the original EAGLE scripts: one sample at a time, `output_hidden_states`,
      the chosen layers copied to the host and one `torch.save` per sample.

(d) the write side's physical limit: the shard's byte count written by as many threads with pwrite
    into one file on the same disk, nothing else; b/min(a, d) is eyrie against the slower limit.

Targets: random-weight models built from a config (no download): Llama-3.1-8B's shape
(32 layers, hidden 4096, bf16) and a DeepSeek-V3-shaped MLA + MoE model with few layers.
Goals: (b) >= 0.85 x (a) tokens/s and (b) >= 3 x (c).

    python benchmarks/extraction_gpu.py [--models llama8b deepseek] [--tokens 300000] [--tiny]

`--tiny` runs the same code on small shapes (a CPU check that the script works). Prints a table
and writes benchmarks/results/extraction-<device>.json. The model load is not timed: (b) runs
eyrie's Extractor on the in-memory model (only `Extractor.__init__`'s load is skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent

SHAPES = {
    "llama8b": dict(
        model_type="llama",
        num_hidden_layers=32,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    # DeepSeek-V3's layer shapes (MLA ranks, 7168 hidden, routed + shared experts), 4 layers
    # (1 dense + 3 MoE) and 64 routed experts instead of 61 and 256, so that it fits and builds
    # fast.
    "deepseek": dict(
        model_type="deepseek_v3",
        num_hidden_layers=4,
        first_k_dense_replace=1,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_routed_experts=64,
        num_experts_per_tok=8,
        n_shared_experts=1,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        vocab_size=129280,
        max_position_embeddings=8192,
    ),
}
TINY = {
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "vocab_size": 1000,
}


def build(shape: str, tiny: bool, device: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[shape])
    if tiny:
        spec.update({k: v for k, v in TINY.items() if k in spec})
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), config


def prompts(n_tokens: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < n_tokens:
        t = int(rng.integers(lo, hi + 1))
        out.append(rng.integers(0, vocab, size=t).astype(np.int32))
        total += t
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bare_forward(model, ids: list[np.ndarray], max_tokens: int, device: str) -> float:
    """(a): the same length-sorted padded batches as eyrie's, forward only."""
    from eyrie.extract.batches import plan_batches

    batches = plan_batches([len(x) for x in ids], max_tokens)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            T = max(len(ids[i]) for i in batch)
            x = torch.zeros(len(batch), T, dtype=torch.long)
            m = torch.zeros(len(batch), T, dtype=torch.long)
            for b, i in enumerate(batch):
                x[b, : len(ids[i])] = torch.from_numpy(ids[i].astype(np.int64))
                m[b, : len(ids[i])] = 1
            model.base_model(input_ids=x.to(device), attention_mask=m.to(device), use_cache=False)
    sync(device)
    return time.perf_counter() - t0


def eyrie_extract(
    model,
    config,
    ids: list[np.ndarray],
    aux_ids: list[int] | None,
    max_tokens: int,
    device: str,
    out: Path,
) -> float:
    """(b): eyrie's Extractor.extract on the in-memory model (its load skipped, nothing else)."""
    from eyrie.arch.target import inspect_target, resolve_layer_ids
    from eyrie.extract.extractor import Extractor, ExtractSettings
    from eyrie.extract.hf import HFBackend

    folder = out.parent / "target"
    config.save_pretrained(folder)  # config.json only: what inspect_target reads
    settings = {
        "extract": {
            "backend": "hf",
            "device": device,
            "dtype": "bfloat16" if device == "cuda" else "float32",
            "storage_dtype": "bfloat16",
            "max_tokens_per_batch": max_tokens,
        },
        "layers": {"aux_ids": aux_ids},
        "trust_remote_code": False,
    }
    ex = Extractor.__new__(Extractor)
    ex.target, ex.settings, ex.cfg = folder, settings, ExtractSettings.from_settings(settings)
    ex.info = inspect_target(folder)
    ex.aux_ids, ex.final_id = resolve_layer_ids(aux_ids, ex.info.num_hidden_layers)
    ex.tokenizer_hash, ex.load_s = "benchmark", 0.0
    backend = HFBackend.__new__(HFBackend)
    backend.cfg, backend.aux_ids, backend.final_id, backend.model = (
        ex.cfg,
        ex.aux_ids,
        ex.final_id,
        model,
    )
    ex.backend = backend
    tokenized = ([f"s{i}" for i in range(len(ids))], ids, [np.ones(len(x), np.int8) for x in ids])
    sync(device)
    t0 = time.perf_counter()
    ex.extract("benchmark", out, tokenized=tokenized)
    sync(device)
    return time.perf_counter() - t0


def naive(model, ids: list[np.ndarray], layer_ids: list[int], device: str, out: Path) -> float:
    """(c): one sample per forward, output_hidden_states, chosen layers to the host, torch.save."""
    out.mkdir(parents=True, exist_ok=True)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i, x in enumerate(ids):
            hs = model.base_model(
                input_ids=torch.from_numpy(x.astype(np.int64))[None].to(device),
                output_hidden_states=True,
                use_cache=False,
            ).hidden_states
            # hidden_states[k] is the input of layer k (the last one is after the final norm; the
            # naive scripts save it as is)
            torch.save(
                {
                    "input_ids": torch.from_numpy(x),
                    "hidden_states": [hs[k][0].cpu() for k in layer_ids],
                },
                out / f"{i}.pt",
            )
    sync(device)
    return time.perf_counter() - t0


def raw_writes(path: Path, nbytes: int, threads: int) -> float:
    """(d), the physical limit of the write side: the same number of bytes written to one
    preallocated file on the same disk by `threads` threads with pwrite (eyrie's writers' call), in
    64 MiB pieces, no forward pass, no HDF5. Seconds."""
    from concurrent.futures import ThreadPoolExecutor

    piece = 64 << 20
    buf = np.random.default_rng(0).integers(0, 255, piece, dtype=np.uint8)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, nbytes)
        offsets = list(range(0, nbytes, piece))

        def write(at: int) -> None:
            view = memoryview(buf)[: min(piece, nbytes - at)]
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], at + done)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(write, offsets))
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def run_shape(shape: str, args, device: str, work: Path) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    model, config = build(shape, args.tiny, device, dtype)
    build_s = time.perf_counter() - t0
    n = config.num_hidden_layers
    from eyrie.arch.target import resolve_layer_ids

    aux_ids = None if n >= 8 else [1, 2, 3]  # EAGLE-3's default [2, N//2, N-3] needs N >= 8
    aux, final = resolve_layer_ids(aux_ids, n)
    lo, hi = (16, 64) if args.tiny else (1024, 2048)
    ids = prompts(args.tokens, config.vocab_size, lo, hi)
    tokens = sum(len(x) for x in ids)
    warm = prompts(min(args.tokens, 4 * hi), config.vocab_size, lo, hi, seed=1)
    bare_forward(model, warm, args.max_tokens, device)  # warm-up: kernels, allocator
    row = {
        "shape": shape,
        "layers": n,
        "aux_ids": aux,
        "final_id": final,
        "hidden": config.hidden_size,
        "samples": len(ids),
        "tokens": tokens,
        "build_s": round(build_s, 1),
        "max_tokens_per_batch": args.max_tokens,
    }
    times = {}
    # bare and eyrie alternate twice and each keeps its faster pass: the first passes over new
    # batch shapes pay for the allocator's growth and kernel selection
    bare, ours = [], []
    for _ in range(2):
        bare.append(bare_forward(model, ids, args.max_tokens, device))
        ours.append(
            eyrie_extract(
                model, config, ids, aux_ids, args.max_tokens, device, work / shape / "shard.h5"
            )
        )
    times["bare"], times["eyrie"] = min(bare), min(ours)
    row["bare_passes_tok_s"] = [round(tokens / t) for t in bare]
    row["eyrie_passes_tok_s"] = [round(tokens / t) for t in ours]
    naive_ids = ids[: max(1, len(ids) // args.naive_fraction)]
    naive_tokens = sum(len(x) for x in naive_ids)
    times["naive"] = naive(model, naive_ids, aux + [final], device, work / shape / "naive")
    row.update(
        {
            "bare_tok_s": tokens / times["bare"],
            "eyrie_tok_s": tokens / times["eyrie"],
            "naive_tok_s": naive_tokens / times["naive"],
            "naive_tokens": naive_tokens,
            "shard_bytes": (work / shape / "shard.h5").stat().st_size,
        }
    )
    row["eyrie_vs_bare"] = row["eyrie_tok_s"] / row["bare_tok_s"]
    row["eyrie_vs_naive"] = row["eyrie_tok_s"] / row["naive_tok_s"]
    from eyrie.extract.batches import WRITERS

    # (d) right after (b), like (b)'s second pass: into a page cache holding (b)'s dirty pages
    raw_s = raw_writes(work / shape / "raw.bin", row["shard_bytes"], WRITERS)
    row.update(
        raw_write_GB_s=row["shard_bytes"] / raw_s / 1e9,
        raw_write_tok_s=tokens / raw_s,
        eyrie_write_GB_s=row["shard_bytes"] / times["eyrie"] / 1e9,
    )
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    shutil.rmtree(work / shape, ignore_errors=True)
    return row


def main() -> None:
    import logging

    # eyrie's extraction log: its own tokens/s and the time it waited for the writer
    logging.basicConfig(level=logging.WARNING, format="  %(name)s: %(message)s")
    logging.getLogger("eyrie.extract").setLevel(logging.INFO)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["llama8b", "deepseek"], choices=list(SHAPES))
    p.add_argument("--tokens", type=int, default=300_000, help="prompt tokens per variant")
    p.add_argument("--max-tokens", type=int, default=16384, help="extract.max_tokens_per_batch")
    p.add_argument(
        "--naive-fraction",
        type=int,
        default=4,
        help="the naive peer runs on 1/N of the prompts (it is the slow one)",
    )
    p.add_argument("--tiny", action="store_true", help="small shapes: check the script on a CPU")
    p.add_argument("--work", type=Path, default=None, help="local folder for the shards")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(args.work or tempfile.mkdtemp(prefix="eyrie-extract-bench-"))
    rows = [run_shape(s, args, device, work) for s in args.models]
    name = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu"
    print(
        f"\nextraction on {name} ({date.today()}), bf16 storage, prompts "
        f"{'16-64' if args.tiny else '1024-2048'} tokens"
    )
    print(
        f"{'model':10} {'tokens':>8} {'(a) bare':>10} {'(b) eyrie':>10} {'(c) naive':>10} "
        f"{'(d) disk':>10} {'b/a':>6} {'b/c':>6} {'b/min(a,d)':>10}   "
        "(tokens/s; (d): raw writes of b's bytes)"
    )
    for r in rows:
        print(
            f"{r['shape']:10} {r['tokens']:>8} {r['bare_tok_s']:>10.0f} {r['eyrie_tok_s']:>10.0f} "
            f"{r['naive_tok_s']:>10.0f} {r['raw_write_tok_s']:>10.0f} {r['eyrie_vs_bare']:>6.2f} "
            f"{r['eyrie_vs_naive']:>6.2f} "
            f"{r['eyrie_tok_s'] / min(r['bare_tok_s'], r['raw_write_tok_s']):>10.2f}   "
            f"(eyrie writes {r['eyrie_write_GB_s']:.2f} GB/s, raw {r['raw_write_GB_s']:.2f} GB/s)"
        )
    machine = name.split()[-1].lower() if device == "cuda" else device
    out = args.out or REPO / "benchmarks" / "results" / (
        f"extraction-{'tiny-' if args.tiny else ''}{machine}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"date": str(date.today()), "device": name, "torch": torch.__version__, "rows": rows},
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
