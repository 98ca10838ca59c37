"""How long each PTX-only unit of the installed vLLM takes to load on this GPU with the driver's
JIT cache as it stands (CUDA_CACHE_PATH): milliseconds for a unit compiled before (by an engine or
by eyrie.vllm.kernel_jit ahead of it), seconds for one compiled now. Run on a copy of a cold
rehearsal's `cache.path/cuda`, it tells which units the engines needed that kernel_jit did not
compile ahead (with --all, the libraries it skips too); on an empty cache, what compiling them all
costs, in parallel as kernel_jit does.

    CUDA_CACHE_PATH=DIR python benchmarks/kernel_jit.py [--site VLLM_PACKAGE] [--all] --name NAME

Prints a table per library and writes benchmarks/results/kernel_jit-NAME.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyrie.vllm.kernel_jit import (  # noqa: E402
    Driver,
    compile_units,
    libraries,
    pending,
    vllm_root,
    workers_for,
)

CACHED_S = 0.5  # a load from the cache takes milliseconds; a compilation seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, help="the vllm package folder (default: found)")
    parser.add_argument("--all", action="store_true", help="every library, the skipped ones too")
    parser.add_argument("--name", required=True, help="the results file's name")
    args = parser.parse_args()
    root = args.site or vllm_root()
    libs = sorted(root.rglob("*.so")) if args.all else libraries(root)
    arch = Driver().arch()
    todo = pending(root, arch, libs)
    start = time.perf_counter()
    seconds = compile_units(todo)
    wall = time.perf_counter() - start
    rows: dict[str, dict] = {}
    for unit, s in zip(todo, seconds, strict=True):
        row = rows.setdefault(
            str(Path(unit["lib"]).relative_to(root.parent)),
            {
                "units": 0,
                "cached": 0,
                "compiled": 0,
                "ptx_mb": 0.0,
                "seconds": 0.0,
                "longest_s": 0.0,
            },
        )
        row["units"] += 1
        row["cached" if s < CACHED_S else "compiled"] += 1
        row["ptx_mb"] += unit["ptx_bytes"] / 1e6
        row["seconds"] += s
        row["longest_s"] = max(row["longest_s"], s)
    print(f"sm_{arch}, cache {os.environ.get('CUDA_CACHE_PATH')}, {workers_for(len(todo))} workers")
    print("| library | units | from the cache | compiled now | PTX (MB) | s (sum) | longest s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['units']} | {r['cached']} | {r['compiled']} | {r['ptx_mb']:.1f} | "
            f"{r['seconds']:.1f} | {r['longest_s']:.1f} |"
        )
    print(f"wall {wall:.1f} s")
    out = Path(__file__).resolve().parent / "results" / f"kernel_jit-{args.name}.json"
    result = {"arch": arch, "command": " ".join(sys.argv), "wall_s": round(wall, 1), "libs": rows}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
