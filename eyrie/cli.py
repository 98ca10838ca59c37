"""`eyrie <stage> ...`: one entry per workflow rule. Each stage module provides
`add_arguments(parser)` and `run(args)`; this layer only parses and reports errors: an EyrieError
as one line with its fix (exit 2), anything else with its type and traceback (exit 1)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import socket
import sys
import traceback

from eyrie.errors import EyrieError
from eyrie.runtime import describe, set_torch_threads

# stage name -> module providing add_arguments(parser) and run(args)
STAGES = {
    "demo-conversations": (
        "eyrie.demo.conversations",
        "write the demo conversations (stdlib docstrings)",
    ),
    "demo-target": ("eyrie.demo.target", "build and train the small demo target model"),
    "preflight": ("eyrie.preflight.preflight", "CPU checks that gate every GPU job"),
    "tokenize": ("eyrie.data.tokenize", "render conversations, loss masks, shards and eval split"),
    "vocab": ("eyrie.data.vocab", "draft vocabulary map (d2t/t2d)"),
    "extract": ("eyrie.extract.extract", "target hidden states of one tokenized shard into HDF5"),
    "extract-engine": (
        "eyrie.extract.engine",
        "load the target once, extract the shards sent over a socket",
    ),
    "train": ("eyrie.train.train", "train the EAGLE-3 draft"),
    "export": ("eyrie.train.export", "export the draft in the format vLLM loads"),
    "evaluate": ("eyrie.evaluate.evaluate", "acceptance length by real speculative decoding"),
    "evaluate-vllm": (
        "eyrie.vllm.evaluate_vllm",
        "acceptance length measured by vLLM itself (vLLM environment)",
    ),
}


# Logged at the start of a stage when set: the SLURM job and the GPUs the job saw.
PLACEMENT_VARS = ("SLURM_JOB_ID", "SLURM_NODELIST", "CUDA_VISIBLE_DEVICES")


def build_parser(stage: str | None = None) -> argparse.ArgumentParser:
    """The CLI parser; only `stage`'s module is imported (start-up stays fast)."""
    parser = argparse.ArgumentParser(prog="eyrie", description=__doc__)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (the rule's `threads`; default: torch's own)",
    )
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name, (module, help_text) in STAGES.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        if name == stage:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(next((a for a in argv if a in STAGES), None)).parse_args(argv)
    placement = [f"{k}={os.environ[k]}" for k in PLACEMENT_VARS if k in os.environ]
    if placement:  # where a cluster job ran and which GPUs it was given, first in its log
        logging.getLogger("eyrie.cli").info(
            "eyrie %s on %s: %s", args.stage, socket.gethostname(), " ".join(placement)
        )
    if args.threads:
        set_torch_threads(args.threads)
    try:
        result = importlib.import_module(args._module).run(args)
    except EyrieError as exc:
        # One clear line (plus detail lines, when the error carries several): no traceback.
        print(f"eyrie {args.stage}: error: {describe(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a bug or an environment failure: type + traceback
        logging.getLogger("eyrie.cli").error(
            "eyrie %s: unexpected %s: %s\n%s",
            args.stage,
            type(exc).__name__,
            describe(exc),
            "".join(traceback.format_exception(exc)).rstrip(),
        )
        return 1
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
