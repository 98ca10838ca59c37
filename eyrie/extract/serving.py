"""The socket side of the extraction engine (eyrie.extract.engine, its entry): `Engine`, a unix
socket bound at construction that answers one connection at a time; `Behind`, the thread that
finishes a shard's close while the next computes; `StopSignals`, SIGTERM/SIGINT turned into
`Stop` with a forced exit STOP_GRACE_S later. Only the standard library at the top: the engine
binds its socket before torch is imported (docs/extraction.md).
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


class Stop(BaseException):
    """SIGTERM/SIGINT: unwinds whatever the engine is doing (a BaseException, so no request
    handler turns it into a reply)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGTERM/SIGINT while `serve` runs: the first raises Stop wherever the main thread is (a
    load or a request unwinds, removing its temporary files) and starts a watchdog that ends
    the process STOP_GRACE_S later if that has not."""

    def __init__(self):
        self.signum = 0  # the stop in progress (0: none)
        self.engine: Engine | None = None  # closed by a forced exit
        self._watchdog: threading.Timer | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
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
            raise Stop(self.signum) from exc

    def _on_signal(self, signum, frame) -> None:
        if not self.signum:  # in the log before any connection closes: a client quotes it
            log.info("engine: %s received: stopping", signal.Signals(signum).name)
        self.signum = self.signum or signum
        if self._watchdog is None:
            self._watchdog = threading.Timer(STOP_GRACE_S, self._force_exit, args=(signum,))
            self._watchdog.daemon = True
            self._watchdog.start()
        raise Stop(signum)

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


stop_signals = StopSignals()


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
                stop_signals.check()  # swallowed somewhere on its way here
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
            stop_signals.check(exc)
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
