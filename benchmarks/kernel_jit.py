"""What the driver's JIT costs for the installed vLLM's PTX-only kernel units on this GPU: each
unit loaded through the driver (eyrie.vllm.fatbin) against the cache as it stands
(CUDA_CACHE_PATH): milliseconds for a unit compiled before (by an engine or an earlier run),
seconds for one compiled now, and the cache's size after. Each unit is labelled by its kernels'
family and first two template arguments (for Marlin: the activation and weight types, as vLLM's
ScalarType ids; named where vllm.scalar_type imports).

    CUDA_CACHE_PATH=DIR python benchmarks/kernel_jit.py --name NAME [--site VLLM_PACKAGE]
        [--lib SUBSTRING] [--match SUBSTRING] [--workers N] [--all]

`--lib`/`--match` keep the units of matching libraries / with a matching kernel label; `--all`
adds the libraries eyrie.vllm.fatbin.SKIP_DIRS leaves out. Prints a row per unit and writes
benchmarks/results/kernel_jit-NAME.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyrie.vllm.fatbin import (  # noqa: E402
    Driver,
    compile_units,
    kernel_names,
    label,
    libraries,
    pending,
    vllm_root,
    workers_for,
)

CACHED_S = 0.5  # a load from the cache takes milliseconds; a compilation seconds


def type_names() -> dict[int, str]:
    """vLLM's ScalarType ids by name, where vllm.scalar_type imports ({} elsewhere)."""
    try:
        from vllm.scalar_type import scalar_types
    except Exception:  # noqa: BLE001 - labels only
        return {}
    found = {}
    for name in dir(scalar_types):
        kind = getattr(scalar_types, name)
        if not name.startswith("_") and hasattr(kind, "id"):
            found.setdefault(kind.id, name)
    return found


def cache_mib() -> float:
    root = Path(os.environ.get("CUDA_CACHE_PATH") or os.path.expanduser("~/.nv/ComputeCache"))
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True, help="the results file's name")
    parser.add_argument("--site", type=Path, help="the vllm package folder (default: found)")
    parser.add_argument("--lib", default="", help="only libraries whose path has this")
    parser.add_argument("--match", default="", help="only units whose label has this")
    parser.add_argument("--workers", type=int, help="processes (default: one per unit, CPUs)")
    parser.add_argument("--all", action="store_true", help="the libraries SKIP_DIRS leaves out")
    args = parser.parse_args()
    root = args.site or vllm_root()
    libs = sorted(root.rglob("*.so")) if args.all else libraries(root)
    arch, types = Driver().arch(), type_names()
    todo = pending(root, arch, [p for p in libs if args.lib in str(p)])
    for unit in todo:
        unit["label"] = label(kernel_names(unit["lib"], unit), types)
    todo = [u for u in todo if args.match in u["label"]]
    workers = workers_for(len(todo), args.workers)
    before = cache_mib()
    start = time.perf_counter()
    seconds = compile_units(todo, workers) if todo else []
    wall = time.perf_counter() - start
    cache = os.environ.get("CUDA_CACHE_PATH")
    print(f"sm_{arch}, cache {cache} ({before:.1f} MiB), {workers} workers")
    print("| library | unit offset | kernels | PTX (MB) | s | from the cache |")
    print("|---|---|---|---|---|---|")
    rows = []
    for unit, s in zip(todo, seconds, strict=True):
        lib = str(Path(unit["lib"]).relative_to(root.parent))
        rows.append(
            {
                "lib": lib,
                "offset": unit["offset"],
                "label": unit["label"],
                "ptx_mb": round(unit["ptx_bytes"] / 1e6, 1),
                "s": round(s, 2),
                "cached": s < CACHED_S,
            }
        )
        r = rows[-1]
        print(
            f"| {lib} | {r['offset']} | {r['label']} | {r['ptx_mb']} | {r['s']} | {r['cached']} |"
        )
    after = cache_mib()
    print(f"wall {wall:.1f} s; cache {before:.1f} -> {after:.1f} MiB")
    out = Path(__file__).resolve().parent / "results" / f"kernel_jit-{args.name}.json"
    result = {
        "arch": arch,
        "command": " ".join(sys.argv),
        "workers": workers,
        "wall_s": round(wall, 1),
        "cache_mib": [round(before, 1), round(after, 1)],
        "units": rows,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
