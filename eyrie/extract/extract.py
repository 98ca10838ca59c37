"""`eyrie extract`: one tokenized shard into one HDF5 hidden-state shard.

With `--engine SOCKET` this is a light client: it sends the shard to a running `eyrie
extract-engine` and waits for its reply (eyrie.extract.protocol; no torch, h5py or pyarrow is
imported). Without it, the target is loaded here for this one shard (eyrie.extract.extractor).
With the output store (EYRIE_STORE), a shard made before from the same inputs is restored
instead, and a new one is kept. docs/extraction.md, docs/store.md.
"""

from __future__ import annotations

from pathlib import Path

from eyrie.core.io import file_sha256, remove_stale_temporaries
from eyrie.extract import protocol
from eyrie.formats import report
from eyrie.store import store


def add_arguments(parser) -> None:
    from eyrie.config.schema import schema_default

    parser.add_argument("--target", required=True, help="Hugging Face model folder of the target")
    parser.add_argument("--shard", required=True, help="tokenized shard (.parquet)")
    parser.add_argument(
        "--preflight", required=True, help="preflight.json that passed for this target"
    )
    parser.add_argument("--out", required=True, help="hidden-state shard to write (.h5)")
    parser.add_argument(
        "--engine",
        default=None,
        metavar="SOCKET",
        help="send the shard to the `eyrie extract-engine` at this unix socket "
        "instead of loading the target here",
    )
    parser.add_argument(
        "--engine-wait-s",
        type=float,
        default=schema_default("extract.engine_wait_s"),
        help="with --engine: how long to wait for the engine's socket to accept "
        "(extract.engine_wait_s; default %(default)g)",
    )
    parser.add_argument(
        "--engine-log", default=None, help="with --engine: the engine's log, named in errors"
    )


def store_key(shard: str, preflight: str, settings: dict) -> tuple[str, dict]:
    """The output store's key of a hidden-state shard: the tokenized shard's bytes, what in the
    preflight report determines the states (the target's content, the layer ids, the vLLM path)
    and the extraction settings."""
    material = {
        "tokenized": file_sha256(shard),
        "preflight": report.identity(report.read_report(preflight)),
        "settings": settings,
    }
    return store.key("hidden", material), material


def run(args) -> int:
    # what a killed engine left beside the shard: no writer of this shard runs yet, and a
    # restore from the store would leave it for good
    remove_stale_temporaries(args.out)
    kept = store.Store.from_env()
    if kept is not None:
        key, material = store_key(args.shard, args.preflight, args.settings)
        if kept.restore("hidden", key, {"shard.h5": Path(args.out)}):
            return 0  # made before from the same inputs: no engine asked, no target loaded
    if args.engine:
        engine = protocol.EngineSocket(args.engine, wait_s=args.engine_wait_s, log=args.engine_log)
        protocol.request(engine, args.shard, args.out, settings=args.settings)
    else:
        from eyrie.extract.extractor import extract_shard

        extract_shard(args.target, args.shard, args.preflight, args.out, args.settings)
    if kept is not None:
        kept.put("hidden", key, {"shard.h5": Path(args.out)}, material)
    return 0
