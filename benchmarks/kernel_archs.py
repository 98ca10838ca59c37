"""Which of the installed vLLM's CUDA kernels a GPU runs from machine code, and which the driver
must first JIT-compile from PTX (the cold cost a rehearsal pays once and `cache.path/cuda` keeps).

    .venv-vllm/bin/python benchmarks/kernel_archs.py [--arch 90] [--site DIR]

Reads the `.nv_fatbin` section of every compiled library of the vLLM package (no GPU needed):
each translation unit's entries, machine code (SASS, an ELF per SM arch) or PTX. A unit with no
SASS the GPU can run (same major arch, minor at most the GPU's) but PTX at or below its arch is
JIT-compiled by the driver when the library is first used on that GPU. Prints a table per
library and writes benchmarks/results/kernel_archs-vllm<version>-sm<arch>.json.
Needs pyelftools (the vLLM environment has it: humming-kernels requires it).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from collections import Counter
from pathlib import Path

from elftools.elf.elffile import ELFFile

FATBIN_MAGIC = 0xBA55ED50
KINDS = {1: "PTX", 2: "SASS"}


def units(path: Path) -> list[list[tuple[str, int, int]]]:
    """Each translation unit's entries of a library's fatbin: (kind, sm arch, bytes)."""
    with open(path, "rb") as f:
        section = ELFFile(f).get_section_by_name(".nv_fatbin")
        data = section.data() if section is not None else b""
    found, off = [], 0
    while off + 16 <= len(data):
        magic, _, head, size = struct.unpack_from("<IHHQ", data, off)
        if magic != FATBIN_MAGIC:
            off += 8  # headers are 8-byte aligned
            continue
        entries, p, end = [], off + head, off + head + size
        while p + 32 <= end:
            kind, _, ehead = struct.unpack_from("<HHI", data, p)
            (esize,) = struct.unpack_from("<Q", data, p + 8)
            (arch,) = struct.unpack_from("<I", data, p + 28)
            entries.append((KINDS.get(kind, str(kind)), arch, esize))
            p += ehead + esize
        found.append(entries)
        off = end
    return found


def runs_natively(entries, arch: int) -> bool:
    """SASS of the GPU's major arch at or below its minor (sm_90 code runs on sm_90 only)."""
    return any(k == "SASS" and a // 10 == arch // 10 and a <= arch for k, a, _ in entries)


def survey(lib: Path, arch: int) -> dict:
    """A library's units: how many, and those the driver must JIT on an sm_`arch` GPU."""
    found = units(lib)
    jit = [u for u in found if not runs_natively(u, arch) and any(k == "PTX" for k, *_ in u)]
    none = [u for u in found if not runs_natively(u, arch) and not any(k == "PTX" for k, *_ in u)]
    return {
        "units": len(found),
        "entries": dict(Counter(f"{k} sm_{a}" for u in found for k, a, _ in u)),
        "jit_units": len(jit),
        "jit_ptx_bytes": sum(s for u in jit for k, _, s in u if k == "PTX"),
        "jit_from": sorted({f"sm_{a}" for u in jit for k, a, _ in u if k == "PTX"}),
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
    print("| library | units | JIT units | PTX to JIT (MB) | from |")
    print("|---|---|---|---|---|")
    for name, row in table.items():
        print(
            f"| {name} | {row['units']} | {row['jit_units']} | "
            f"{row['jit_ptx_bytes'] / 1e6:.1f} | {', '.join(row['jit_from'])} |"
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
