"""The installed vLLM's facts read by preflight's gatherer, against the same facts kept on disk
(eyrie.vllm.facts_cache): what a job after the first pays for them.

    .venv/bin/python benchmarks/vllm_facts.py [--python .venv-vllm/bin/python ...] [--repeats 3]

For each vLLM environment: `python -m eyrie.preflight.gather` (the subprocess preflight runs) on
the Llama-3.1-8B, DeepSeek-V3 and Kimi-K2.5 configs of the tests, timed without a cache, then
into an empty cache folder (the first job: reads and keeps them), then from it (every later job),
each `--repeats` times (the median is reported). Prints the table and writes
benchmarks/results/vllm-facts-cpu.json; BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eyrie.core.runtime import VLLM_FACTS_CACHE  # noqa: E402
from eyrie.preflight.vllm_env import run_gatherer  # noqa: E402
from tests.support.vllm_helpers import DEEPSEEK, KIMI_K25, LLAMA  # noqa: E402

CONFIGS = {"llama": LLAMA, "deepseek": DEEPSEEK, "kimi": KIMI_K25}


def gather(python: Path, configs: list[dict], cache: Path | None) -> tuple[float, list[dict]]:
    """(seconds, facts) of one gatherer process: preflight's own run_gatherer, with the cache
    folder it inherits set to `cache` (None: no cache)."""
    saved = os.environ.pop(VLLM_FACTS_CACHE, None)
    if cache is not None:
        os.environ[VLLM_FACTS_CACHE] = str(cache)
    try:
        start = time.perf_counter()
        facts = run_gatherer(python, configs)
        return time.perf_counter() - start, facts
    finally:
        os.environ.pop(VLLM_FACTS_CACHE, None)
        if saved is not None:
            os.environ[VLLM_FACTS_CACHE] = saved


def measure(python: Path, repeats: int) -> dict:
    configs = list(CONFIGS.values())
    with tempfile.TemporaryDirectory() as tmp:
        uncached = [gather(python, configs, None) for _ in range(repeats)]
        first, kept = [], []
        for i in range(repeats):
            cache = Path(tmp) / f"cache{i}"
            first.append(gather(python, configs, cache))
            kept.append(gather(python, configs, cache))
    same = all(f == uncached[0][1] for _, f in first + kept)
    return {
        "python": str(python),
        "vllm": uncached[0][1][0].get("version"),
        "configs": list(CONFIGS),
        "no_cache_s": statistics.median(w for w, _ in uncached),
        "first_job_s": statistics.median(w for w, _ in first),
        "kept_s": statistics.median(w for w, _ in kept),
        "same_facts": same,
        "repeats": repeats,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--python",
        nargs="+",
        default=[str(p) for p in sorted(REPO.glob(".venv-vllm*/bin/python"))],
        help="the vLLM environments' Pythons (default: every .venv-vllm*)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = [measure(Path(p), args.repeats) for p in args.python]
    print("| vLLM | no cache | first job (reads, keeps) | later jobs (kept) | same facts |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['vllm']} | {r['no_cache_s']:.1f} s | {r['first_job_s']:.1f} s | "
            f"{r['kept_s']:.2f} s | {r['same_facts']} |"
        )
    out = REPO / "benchmarks" / "results" / "vllm-facts-cpu.json"
    out.write_text(
        json.dumps({"date": str(date.today()), "cpus": os.cpu_count(), "rows": rows}, indent=1)
    )
    print(f"wrote {out}")
    return 0 if all(r["same_facts"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
