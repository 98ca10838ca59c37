"""Compile the installed vLLM's PTX-only kernels into the driver's cache ahead of an engine
(eyrie.vllm.kernel_jit, whose `start()` runs this): one JSON line of what it did; exit 1 with one
line on stderr when it could not (no driver, a driver error).

    python -m eyrie.vllm.jit_ahead [--site VLLM_PACKAGE_FOLDER]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eyrie.vllm.kernel_jit import compile_ahead, vllm_root


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, help="the vllm package folder (default: found)")
    args = parser.parse_args()
    root = args.site or vllm_root()
    try:
        done = compile_ahead(root) if root else {"skipped": "vLLM is not installed"}
    except (OSError, RuntimeError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
