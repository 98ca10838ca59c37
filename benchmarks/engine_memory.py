"""Preflight's memory prediction against vLLM's own figures, on one GPU, for the engines eyrie
starts: a random-weight target built from a config (`load_format="dummy"`), started the way the
extraction engine starts it (eyrie.vllm.engine: lengths from `bounds`, no chunked prefill,
eager), then vLLM's worker asked what it measured while profiling (weights, the profiling step's
torch peak, memory outside torch, the KV cache it kept). Each row is one engine in its own process.

    python benchmarks/engine_memory.py [--rows llama8b:2048 kimi4int4:2048 kimi4int4:2048:65536]

A row is SHAPE:LONGEST[:BATCH]: the shape (benchmarks/extraction_vllm.py's), the longest sample's
tokens, and vllm.max_num_batched_tokens (default: eyrie's). Runs in the vLLM environment; prints
a table and writes benchmarks/results/engine-memory-<gpu>.json. BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import failure  # noqa: E402  (benchmarks/failure.py: a failed child's cause line)

GIB = 2**30
UTILIZATION = 0.85


def _figures(worker) -> dict:
    """What vLLM's worker measured at its start (vllm/v1/worker/gpu_worker.py)."""
    return {
        "weights": int(worker.model_runner.model_memory_usage),
        "activations": int(worker.peak_activation_memory),
        "non_torch": int(worker.non_torch_memory),
        "cudagraph": int(getattr(worker, "cudagraph_memory_estimate", 0) or 0),
        "kv_cache": int(worker.available_kv_cache_memory_bytes),
        "requested": int(worker.requested_memory),
    }


def child(shape: str, longest: int, batch: int | None, out: Path) -> None:
    """One engine: preflight's prediction, the engine started with the same lengths, vLLM's
    figures; the row as JSON into `out`."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of _figures
    import torch
    from extraction_vllm import shape_config

    from eyrie.arch.target import read_config
    from eyrie.config.sections import VllmSettings
    from eyrie.preflight.vllm_memory import predict
    from eyrie.preflight.vllm_sizing import architecture_bytes
    from eyrie.vllm.engine import bound_kwargs, bounds, engine_args

    total = torch.cuda.mem_get_info()[1]
    config, _ = shape_config(shape)
    target = out.parent / f"target-{shape}"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(config, indent=1))
    section = {
        "gpu_memory_gib": total / GIB,  # the budget vLLM requests: utilization x this GPU
        "gpu_memory_utilization": UTILIZATION,
        "max_num_batched_tokens": batch,
        "rehearsal": True,
    }
    v = VllmSettings.from_section(section)
    engine = bounds(v, longest, chunked=False, source="the row's longest sample")
    weights = architecture_bytes(read_config(target))["bytes"]
    predicted = predict(config, v, engine, weights)
    from vllm import LLM

    kwargs = engine_args(
        target,
        v,
        enforce_eager=True,
        dtype="bfloat16",
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        **bound_kwargs(engine),
    )
    llm = LLM(**kwargs)
    measured = llm.collective_rpc(_figures)[0]
    row = {
        "shape": shape,
        "engine": engine,
        "predicted_gib": predicted,
        "measured_gib": {k: round(v / GIB, 3) for k, v in measured.items()},
    }
    out.write_text(json.dumps(row, indent=1))


def compare(row: dict) -> dict:
    """Prediction / measurement of each term and of the non-KV total."""
    p, m = row["predicted_gib"], row["measured_gib"]
    non_kv_p = p["weights_gib"] + p["activations_gib"] + p["other_gib"]
    non_kv_m = m["weights"] + m["activations"] + m["non_torch"] + m["cudagraph"]
    return {
        "weights": p["weights_gib"] / m["weights"],
        "activations": p["activations_gib"] / m["activations"] if m["activations"] else None,
        "non_kv": non_kv_p / non_kv_m,
        "kv_cache": p["kv_cache_gib"] / m["kv_cache"] if m["kv_cache"] else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rows", nargs="+", default=["llama8b:2048", "kimi4int4:2048", "kimi4int4:2048:65536"]
    )
    ap.add_argument("--child", nargs=4, metavar=("SHAPE", "LONGEST", "BATCH", "OUT"))
    args = ap.parse_args()
    if args.child:
        shape, longest, batch, out = args.child
        child(shape, int(longest), int(batch) or None, Path(out))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.rows:
            shape, longest, *rest = spec.split(":")
            out = Path(tmp) / f"{spec.replace(':', '-')}.json"
            cmd = [sys.executable, __file__, "--child", shape, longest, rest[0] if rest else "0"]
            proc = subprocess.run([*cmd, str(out)], capture_output=True, text=True, timeout=900)
            if proc.returncode or not out.exists():
                rows.append(
                    {"row": spec, **failure.failed(proc.returncode, proc.stdout + proc.stderr)}
                )
                print(f"{spec}: {failure.why(rows[-1])}", flush=True)
                continue
            row = {"row": spec, **json.loads(out.read_text())}
            row["ratio"] = compare(row)
            rows.append(row)
            print(json.dumps(row), flush=True)
    import torch

    gpu = torch.cuda.get_device_name().replace(" ", "_")
    result = {"date": str(date.today()), "gpu": gpu, "utilization": UTILIZATION, "rows": rows}
    path = REPO / "benchmarks" / "results" / f"engine-memory-{gpu}.json"
    path.write_text(json.dumps(result, indent=1))
    table(rows)


def table(rows: list[dict]) -> None:
    print("| row | lengths | weights | activations | outside torch | non-KV total | KV cache |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['row']} | {failure.why(row)} | | | | | |")
            continue
        p, m, e = row["predicted_gib"], row["measured_gib"], row["engine"]
        non_kv_p = p["weights_gib"] + p["activations_gib"] + p["other_gib"]
        non_kv_m = m["weights"] + m["activations"] + m["non_torch"] + m["cudagraph"]
        print(
            f"| {row['row']} | {e['max_model_len']} / {e['max_num_batched_tokens']} / "
            f"{e['max_num_seqs']} | {p['weights_gib']:.2f} / {m['weights']:.2f} | "
            f"{p['activations_gib']:.2f} / {m['activations']:.2f} | "
            f"{p['other_gib']:.2f} / {m['non_torch']:.2f} | {non_kv_p:.2f} / {non_kv_m:.2f} "
            f"({non_kv_p / non_kv_m:.2f}) | {p['kv_cache_gib']:.2f} / {m['kv_cache']:.2f} |"
        )


if __name__ == "__main__":
    main()
