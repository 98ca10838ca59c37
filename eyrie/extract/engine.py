"""`eyrie extract-engine`: one target load serving many shard extractions over a unix socket
(`eyrie extract --engine SOCKET` is the client, eyrie.extract.protocol the wire format).

The contract with Snakemake's service() jobs (docs/extraction.md):
- the socket is bound first; the model loads on the first request (a group whose shards the
  output store restores loads nothing), and clients that connect during the load wait in the
  listen backlog;
- requests run one at a time on the loaded model, in the main thread; a shard's last writes,
  fsync and rename run in a thread behind it (`Behind`), so the next shard computes meanwhile,
  and its client hears once the shard is complete;
- every failure reaches the client as a reply (a failed load is the reply to every client that
  connects), since Snakemake never checks a service's exit status;
- the engine exits after `--idle-exit-s` without a connection (first answering any
  client that connected at that moment), and promptly on SIGTERM/SIGINT (forced STOP_GRACE_S
  later if the stop is swallowed), leaving an empty placeholder file where its socket was.
Only the standard library is imported at the top: the socket is bound before torch is imported.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from eyrie.core.errors import EngineError, ExtractError, os_error_text
from eyrie.extract.protocol import error_reply
from eyrie.extract.serving import (
    DEFAULT_IDLE_EXIT_S,
    Engine,
    Later,
    Reply,
    Stop,
    stop_signals,
)

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _named_disk_errors(out: str):
    """A full, read-only or forbidden disk while a shard is written, as a line naming the
    shard, the free space and the fix (the writer's own error names a temporary file, or
    nothing: HDF5's)."""
    try:
        yield
    except Exception as exc:
        text = os_error_text(exc, out, out)
        if text is None:
            raise
        raise ExtractError(text) from exc


def _extract_handler(extractor, settings: dict) -> Callable[[dict], Reply]:
    """Each request's shard computed now; its close, and the reply, left to Behind."""

    def handle(request: dict) -> Reply:
        missing = [k for k in ("shard", "out") if not isinstance(request.get(k), str)]
        if missing:
            raise EngineError(
                f"request without a string {missing[0]!r}: send "
                '{"shard": <tokenized .parquet>, "out": <.h5>}'
            )
        if "settings" in request and request["settings"] != settings:
            raise EngineError(
                "the client's --settings differ from the engine's: its shard would "
                "not match its rule's params; restart the engine with the same settings"
            )
        t0 = time.monotonic()
        log.info("engine: request %s -> %s", request["shard"], request["out"])
        with _named_disk_errors(request["out"]):
            pending = extractor.start(request["shard"], request["out"])

        def finish() -> dict:
            with _named_disk_errors(request["out"]):
                out = pending.finish()
            return {"ok": True, "out": str(out), "seconds": round(time.monotonic() - t0, 3)}

        return Later(finish, pending.abandon)

    return handle


@dataclass(frozen=True)
class Load:
    """What an engine loads: the target, its passed preflight report and the extraction settings,
    which every client must send alike. `runtime` (--runtime: the vLLM backend's
    gpu_memory_utilization) changes no shard, so it stays out of `settings` and only reaches the
    backend."""

    target: str | Path
    preflight: str | Path
    settings: dict
    torch_threads: int | None = None
    runtime: dict | None = None

    def extractor(self):
        """The loaded Extractor (the one model load)."""
        if self.torch_threads:
            from eyrie.core.runtime import set_torch_threads

            set_torch_threads(self.torch_threads)
        from eyrie.extract.extractor import Extractor

        return Extractor(self.target, self.preflight, self.settings, self.runtime)


def serve(socket_path: str | Path, load: Load, idle_exit_s: float = DEFAULT_IDLE_EXIT_S) -> int:
    """Bind, serve (loading the target once, on the first request) until idle or signalled.
    Returns the exit status."""
    engine = None
    with stop_signals:
        try:
            engine = stop_signals.engine = Engine(socket_path, idle_exit_s)
            return _load_and_serve(engine, load)
        except Stop as stop:
            busy = engine is not None and engine.busy
            log.info(
                "engine: %s received%s: exiting",
                stop,
                " while busy (the work in progress is abandoned)" if busy else "",
            )
            return 128 + stop.signum if busy else 0
        finally:
            if engine is not None:
                engine.close()


class _Lazy:
    """The request handler that loads the target on the first request: a group whose shards
    the output store restores asks nothing and loads nothing (docs/store.md). A failed load is
    the reply to that request and every later one."""

    def __init__(self, load: Load):
        self.load = load
        self.extractor = None
        self.handle: Callable[[dict], Reply] | None = None
        self.failed = False

    def __call__(self, request: dict) -> Reply:
        if self.handle is None:
            self.handle = self._load()
        return self.handle(request)

    def _load(self) -> Callable[[dict], Reply]:
        log.info("engine: loading target %s for the first request", self.load.target)
        t0 = time.monotonic()
        try:
            self.extractor = self.load.extractor()
        except Exception as exc:
            stop_signals.check(exc)
            log.error(
                "engine: loading the target failed: %s: %s\n%s",
                type(exc).__name__,
                exc,
                traceback.format_exc(),
            )
            self.failed = True
            failure = error_reply(exc)
            # Snakemake does not look at a service's exit status: the clients must hear it.
            return lambda request: failure
        log.info(
            "engine: loaded target %s in %.1f s (load 1 of this engine)",
            self.load.target,
            time.monotonic() - t0,
        )
        return _extract_handler(self.extractor, self.load.settings)


def _load_and_serve(engine: Engine, load: Load) -> int:
    """0 after serving shards until idle; 1 after serving a failed load's error until idle."""
    lazy = _Lazy(load)
    try:
        engine.serve(lazy)
    finally:
        engine.behind.close()  # a shard finishing completes (on a signal: within STOP_GRACE_S)
        if lazy.extractor is not None:
            lazy.extractor.close()
    if lazy.handle is None:
        log.info("engine: no request came (the store held every shard?): nothing was loaded")
    return 1 if lazy.failed else 0


def add_arguments(parser) -> None:
    parser.add_argument(
        "--socket", required=True, help="unix socket to serve (whatever is there is replaced)"
    )
    parser.add_argument("--target", required=True, help="Hugging Face model folder of the target")
    parser.add_argument(
        "--preflight", required=True, help="preflight.json that passed for this target"
    )
    parser.add_argument(
        "--idle-exit-s",
        type=float,
        default=DEFAULT_IDLE_EXIT_S,
        help="exit after this many seconds without a connection (default %(default)g)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch CPU threads, set after the socket is bound (the global "
        "--threads would import torch before binding)",
    )


def run(args) -> int:
    load = Load(
        args.target,
        args.preflight,
        args.settings,
        torch_threads=args.torch_threads,
        runtime=args.runtime,
    )
    return serve(args.socket, load, idle_exit_s=args.idle_exit_s)
