"""Which of the installed vLLM's CUDA kernels a GPU runs from machine code, and which the driver
must first JIT-compile from PTX (the cold cost an engine pays once and `cache.path/cuda` keeps).

    .venv-vllm/bin/python benchmarks/kernel_archs.py [--arch 90] [--site DIR]

Reads the `.nv_fatbin` section of every compiled library of the vLLM package (no GPU needed)
with eyrie.vllm.fatbin: each translation unit's entries, machine code (SASS, per SM
arch) or PTX. A unit with no SASS the GPU can run but PTX at or below its arch is compiled by the
driver when first used on that GPU. Prints a table per library (PTX sizes as stored, compressed,
and as the driver compiles it) and writes
benchmarks/results/kernel_archs-vllm<version>-sm<arch>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyrie.vllm.fatbin import PTX, needs_jit, runs_natively, units  # noqa: E402

KINDS = {1: "PTX", 2: "SASS"}


def survey(lib: Path, arch: int) -> dict:
    """A library's units: how many, and those the driver must JIT on an sm_`arch` GPU."""
    found = [u["entries"] for u in units(lib)]
    jit = [u for u in found if needs_jit(u, arch)]
    none = [u for u in found if not runs_natively(u, arch) and not needs_jit(u, arch)]
    ptx = [e for u in jit for e in u if e["kind"] == PTX and e["arch"] <= arch]
    return {
        "units": len(found),
        "entries": dict(
            Counter(f"{KINDS.get(e['kind'], e['kind'])} sm_{e['arch']}" for u in found for e in u)
        ),
        "jit_units": len(jit),
        "jit_ptx_bytes": sum(e["bytes"] for e in ptx),  # as stored (compressed)
        "jit_ptx_plain_bytes": sum(e["ptx_bytes"] for e in ptx),  # what the driver compiles
        "jit_from": sorted({f"sm_{e['arch']}" for e in ptx}),
        "no_code_units": len(none),  # neither: that unit's kernels cannot run on this GPU
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="the GPU's SM arch (H100/H200: 90)")
    parser.add_argument("--site", type=Path, help="a site folder holding vllm/ (default: import)")
    args = parser.parse_args()
    if args.site:
        root, version = args.site / "vllm", "?"
        meta = sorted(args.site.glob("vllm-*.dist-info"))
        if meta:
            version = meta[0].name.removesuffix(".dist-info").split("-")[1]
    else:
        import vllm

        root, version = Path(vllm.__file__).parent, vllm.__version__
    libs = sorted(p for p in root.rglob("*.so") if "deep_gemm" not in p.parts)
    table = {str(p.relative_to(root.parent)): survey(p, args.arch) for p in libs}
    table = {k: v for k, v in table.items() if v["units"]}
    print(f"vLLM {version}, sm_{args.arch}: units run from SASS / JIT-compiled from PTX")
    print("| library | units | JIT units | PTX to JIT, stored (MB) | PTX to JIT (MB) | from |")
    print("|---|---|---|---|---|---|")
    for name, row in table.items():
        print(
            f"| {name} | {row['units']} | {row['jit_units']} | "
            f"{row['jit_ptx_bytes'] / 1e6:.1f} | {row['jit_ptx_plain_bytes'] / 1e6:.1f} | "
            f"{', '.join(row['jit_from'])} |"
        )
    name = f"kernel_archs-vllm{version}-sm{args.arch}.json"
    out = Path(__file__).resolve().parent / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"vllm": version, "arch": args.arch, "command": " ".join(sys.argv), "libs": table}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
