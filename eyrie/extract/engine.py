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
import json
import logging
import os
import signal
import socket
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from eyrie.core.errors import EngineError
from eyrie.extract.protocol import READ_TIMEOUT_S, error_reply, read_line, send, sun_path

log = logging.getLogger(__name__)

DEFAULT_IDLE_EXIT_S = 60.0
POLL_S = 0.5  # accept() timeout: how often the engine checks its idle clock
# after SIGTERM/SIGINT, the exit is forced this much later (a library swallowed the stop, or the
# interpreter's shutdown waits on a thread that will not end)
STOP_GRACE_S = 5.0


class _Stop(BaseException):
    """SIGTERM/SIGINT: unwinds whatever the engine is doing (a BaseException, so no request
    handler turns it into a reply)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _StopSignals:
    """SIGTERM/SIGINT while `serve` runs: the first raises _Stop wherever the main thread is (a
    load or a request unwinds, removing its temporary files) and starts a watchdog that ends
    the process STOP_GRACE_S later if that has not."""

    def __init__(self):
        self.signum = 0  # the stop in progress (0: none)
        self.engine: Engine | None = None  # closed by a forced exit
        self._watchdog: threading.Timer | None = None
        self._previous: dict = {}

    def __enter__(self) -> _StopSignals:
        self.signum, self.engine, self._watchdog = 0, None, None
        self._previous = {
            s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)
        }
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def check(self, exc: BaseException | None = None) -> None:
        """A stop in progress that a library turned into an error (numpy's C init inside `import
        torch` makes it "cannot load module more than once") or swallowed is still a stop."""
        if self.signum:
            raise _Stop(self.signum) from exc

    def _on_signal(self, signum, frame) -> None:
        self.signum = self.signum or signum
        if self._watchdog is None:
            self._watchdog = threading.Timer(STOP_GRACE_S, self._force_exit, args=(signum,))
            self._watchdog.daemon = True
            self._watchdog.start()
        raise _Stop(signum)

    def _force_exit(self, signum: int) -> None:
        log.error(
            "engine: still running %g s after %s: forcing the exit",
            STOP_GRACE_S,
            signal.Signals(signum).name,
        )
        if self.engine is not None:
            self.engine.close()
        logging.shutdown()
        os._exit(128 + signum)


_stop = _StopSignals()


@dataclass(frozen=True)
class Later:
    """A reply made later, by Behind: `finish()` makes it (a shard's close); `abandon()` undoes
    the work instead if the engine stops before handing it over."""

    finish: Callable[[], dict]
    abandon: Callable[[], None]


# what a request handler returns: the reply now, or Later
Reply = dict | Later


class Behind:
    """Shards finished one behind: `hand(finish, done)` runs `finish()` (a shard's last writes,
    fsync and rename) in a thread of its own and gives `done` its result or its error, once the
    shard handed before it has finished. At most one shard finishes while the caller computes
    the next: the engine's GPU works while the last shard reaches the disk, and what waits for
    the writers (buffers, request files) is held for two shards at most."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="eyrie-finish")
        self.current: Future | None = None

    def hand(self, finish: Callable[[], Any], done: Callable[[Any, Exception | None], None]):
        self.wait()
        self.current = self.pool.submit(self._run, finish, done)

    def busy(self) -> bool:
        return self.current is not None and not self.current.done()

    def wait(self) -> None:
        """Until the shard handed last has finished and its `done` has run."""
        if self.current is not None:
            self.current.result()

    def close(self) -> None:
        self.wait()
        self.pool.shutdown()

    @staticmethod
    def _run(finish: Callable[[], Any], done: Callable[[Any, Exception | None], None]) -> None:
        try:
            result, error = finish(), None
        except Exception as exc:  # the caller's error, for `done` to report
            result, error = None, exc
        try:
            done(result, error)
        except Exception:  # never raised into the next hand(): the engine serves on
            log.exception("engine: reporting a shard's close failed")


class Engine:
    """A unix socket bound at construction (before any model load) and the loop that answers it,
    one connection at a time (a handler may return its reply as `Later`, run by `Behind`)."""

    def __init__(self, socket_path: str | Path, idle_exit_s: float = DEFAULT_IDLE_EXIT_S):
        self.path = Path(socket_path)
        self.idle_exit_s = idle_exit_s
        self._busy = False  # a load or a request is in progress (for the exit status on a signal)
        self.behind = Behind()
        self.served = self.failed = 0
        self._count = threading.Lock()
        if self.path.is_dir() and not self.path.is_symlink():
            raise EngineError(f"--socket {self.path}: is a folder; give a file path")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Whatever is there goes: Snakemake's placeholder file, or the stale socket of a killed run.
        if os.path.lexists(self.path):
            self.path.unlink()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with sun_path(self.path) as address:
            self.sock.bind(address)
        self.sock.listen(socket.SOMAXCONN)
        self.sock.settimeout(POLL_S)
        self.inode = os.lstat(self.path).st_ino
        log.info("engine: listening on %s (pid %d)", self.path, os.getpid())

    @property
    def busy(self) -> bool:
        """A load, a request or a shard's finish is in progress."""
        return self._busy or self.behind.busy()

    def close(self) -> None:
        """Close the socket, leaving an empty placeholder file where it was."""
        self._vacate()
        self.sock.close()

    def _vacate(self) -> None:
        """Put an empty placeholder file where the socket was (only if it is still ours; done
        once). Snakemake touches a service output after its group ends: a removed socket raced
        that touch and failed the run ("shall be touched but does not exist"). Clients wait
        through a placeholder as through a missing socket."""
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(self.path).st_ino == self.inode:
                placeholder = self.path.with_name(f".{self.path.name}.{os.getpid()}")
                placeholder.touch()
                os.replace(placeholder, self.path)

    def _drain(self, handle: Callable[[dict], Reply]) -> None:
        """Idle exit without dropping a client that connected at the last moment: once the
        placeholder has replaced the socket no new connection can arrive, so answering what is
        already queued in the backlog leaves no one to reset when the socket closes."""
        self._vacate()
        self.sock.setblocking(False)
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError, socket.timeout):
                self.behind.wait()
                return
            log.info("engine: answering a client that connected as the engine went idle")
            self._answer(conn, handle)

    def serve(self, handle: Callable[[dict], Reply]) -> None:
        """Answer connections one at a time with `handle(request) -> reply` until idle (not
        counted while a shard finishes)."""
        idle_since = time.monotonic()
        while True:
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                _stop.check()  # swallowed somewhere on its way here
                if self.behind.busy():
                    idle_since = time.monotonic()
                    continue
                idle = time.monotonic() - idle_since
                if idle >= self.idle_exit_s:
                    self._drain(handle)
                    log.info(
                        "engine: idle for %.0f s (--idle-exit-s %g): exiting after %d "
                        "requests (%d failed)",
                        idle,
                        self.idle_exit_s,
                        self.served,
                        self.failed,
                    )
                    return
                continue
            self._answer(conn, handle)
            idle_since = time.monotonic()

    def _answer(self, conn: socket.socket, handle: Callable[[dict], Reply]) -> None:
        """Read one request, answer it and close the connection; a `Later` reply is made by
        `Behind`, which answers and closes once it is."""
        conn.settimeout(READ_TIMEOUT_S)
        self._busy = True  # stays True if a signal unwinds the request (exit status 128 + signal)
        try:
            line = read_line(conn)
            if not line:
                log.info("engine: a client connected and closed without a request")
                conn.close()
                self._busy = False
                return
            request = json.loads(line)
            if not isinstance(request, dict):
                raise EngineError(f"request {line[:200]!r} is not a JSON object")
            reply = handle(request)
        except Exception as exc:  # every failure goes to the client (and the log)
            _stop.check(exc)
            reply = _failed(exc)
        except BaseException:
            conn.close()
            raise
        if isinstance(reply, Later):
            try:  # waits for the shard closing before it: a stop may land here
                self.behind.hand(reply.finish, lambda got, e: self._reply(conn, got or _failed(e)))
            except BaseException:
                reply.abandon()
                conn.close()
                raise
        else:
            self._reply(conn, reply)
        self._busy = False

    def _reply(self, conn: socket.socket, reply: dict) -> None:
        with self._count:
            self.served += 1
            self.failed += not reply.get("ok")
        try:
            with conn:
                send(conn, reply)
        except OSError as exc:
            log.error(
                "engine: could not reply (the client is gone): %s: %s\n%s",
                type(exc).__name__,
                exc,
                traceback.format_exc(),
            )


def _failed(exc: BaseException) -> dict:
    """A failed request's reply, logged with its traceback."""
    log.error(
        "engine: request failed: %s: %s\n%s",
        type(exc).__name__,
        exc,
        "".join(traceback.format_exception(exc)),
    )
    return error_reply(exc)


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
        pending = extractor.start(request["shard"], request["out"])

        def finish() -> dict:
            out = pending.finish()
            return {"ok": True, "out": str(out), "seconds": round(time.monotonic() - t0, 3)}

        return Later(finish, pending.abandon)

    return handle


@dataclass(frozen=True)
class Load:
    """What an engine loads: the target, its passed preflight report and the extraction settings,
    which every client must send alike. `gpu_memory_utilization` (vLLM backend) changes no
    shard, so it stays out of `settings` and only reaches the backend."""

    target: str | Path
    preflight: str | Path
    settings: dict
    torch_threads: int | None = None
    gpu_memory_utilization: float | None = None

    def extractor(self):
        """The loaded Extractor (the one model load)."""
        if self.torch_threads:
            from eyrie.core.runtime import set_torch_threads

            set_torch_threads(self.torch_threads)
        from eyrie.extract.extractor import Extractor

        settings = self.settings
        if self.gpu_memory_utilization is not None:
            vllm = {
                **(settings.get("vllm") or {}),
                "gpu_memory_utilization": self.gpu_memory_utilization,
            }
            settings = {**settings, "vllm": vllm}
        return Extractor(self.target, self.preflight, settings)


def serve(socket_path: str | Path, load: Load, idle_exit_s: float = DEFAULT_IDLE_EXIT_S) -> int:
    """Bind, serve (loading the target once, on the first request) until idle or signalled.
    Returns the exit status."""
    engine = None
    with _stop:
        try:
            engine = _stop.engine = Engine(socket_path, idle_exit_s)
            return _load_and_serve(engine, load)
        except _Stop as stop:
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

    def __init__(self, engine: Engine, load: Load):
        self.engine, self.load = engine, load
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
            _stop.check(exc)
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
    lazy = _Lazy(engine, load)
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
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM backend: fraction of GPU memory the engine may use (kept out "
        "of --settings: it changes no shard)",
    )


def run(args) -> int:
    load = Load(
        args.target,
        args.preflight,
        args.settings,
        torch_threads=args.torch_threads,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    return serve(args.socket, load, idle_exit_s=args.idle_exit_s)
