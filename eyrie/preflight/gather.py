"""Entry run in the vLLM environment: print the installed vLLM's facts for target configs.

`python -m eyrie.preflight.gather --config config.json [--config ...]` prints one JSON line per
config: `VllmFacts.to_json()` (eyrie.vllm.facts), or {"error": ...} for a model_type without an
adapter. eyrie.preflight.vllm_env runs it as a subprocess. See docs/vllm.md.
"""

from __future__ import annotations

import json
import sys

from eyrie.core.errors import VllmAdapterError
from eyrie.vllm.facts import gather_facts


def main(argv: list[str] | None = None) -> int:
    """`python -m eyrie.preflight.gather --config config.json [--config ...]`: the facts, one JSON
    line per config."""
    import argparse
    import logging

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument(
        "--config",
        required=True,
        action="append",
        help="a target's config.json (repeat it: one JSON line per config, one "
        "vLLM import for all)",
    )
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # vLLM's import-time chatter goes to stderr anyway
    for path in args.config:
        with open(path) as f:
            config = json.load(f)
        try:
            line = gather_facts(config).to_json()
        except VllmAdapterError as exc:
            line = {"error": str(exc)}
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
