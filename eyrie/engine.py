"""`eyrie extract-engine`: one target load serving many shard extractions over a unix socket.

Loading a large target takes ~18 minutes, so one engine loads it once and extracts a whole group
of shards, while each shard stays its own Snakemake job and output (`eyrie extract --engine S`
is the client; rules/extract.smk, docs/extraction.md). The design follows what was measured with
Snakemake's service() outputs (CLUSTER.md "service()"):

- the socket is bound BEFORE the model loads: consumer jobs wait only `--latency-wait` for their
  input file, and connections made during the load queue in the listen backlog;
- requests run strictly one at a time on the loaded model (main thread; the backlog queues);
- Snakemake never checks a service's exit status, so every failure goes to the client as a reply
  (a failed model load is replied to every client that connects) and the client has timeouts;
- the engine exits after `--idle-exit-s` without a connection once loaded (an engine without
  consumers must not hang the run), first answering any client that connected at that moment,
  and promptly on SIGTERM/SIGINT (forced after STOP_GRACE_S if a library swallows the stop or
  the interpreter's shutdown hangs); an empty placeholder file is left where its socket was.

Protocol: one JSON line each way per connection. Request `{"shard": path, "out": path}` (plus
`"settings"`, which must equal the engine's own). Reply `{"ok": true, "out": path, "seconds": s}`
or `{"ok": false, "error": "<Type>: <message>", "traceback": "..."}`.

This module imports only the standard library at the top: the engine binds its socket before
torch is imported, and clients stay small.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import socket
import stat
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator

from eyrie import EyrieError

log = logging.getLogger(__name__)

DEFAULT_IDLE_EXIT_S = 60.0
DEFAULT_WAIT_S = 3600.0  # extract.engine_wait_s: model loads take ~18 minutes on real clusters
POLL_S = 0.5  # accept() timeout: how often the engine checks its idle clock
READ_TIMEOUT_S = 60.0  # for a client's request line (clients send it right after connecting)
RETRY_S = 1.0  # client: between attempts to connect
STOP_GRACE_S = 5.0  # after SIGTERM/SIGINT: then the exit is forced (a library swallowed the stop,
# or the interpreter's shutdown waits on a thread that will not end)
MAX_LINE = 1 << 20
SUN_PATH_MAX = 100  # bytes; sockaddr_un.sun_path holds 108 on Linux


class EngineError(EyrieError):
    pass


_stop_signum = 0  # set by the signal handler of serve(): a stop in progress (0: none)


def _raise_if_stopping(exc: BaseException | None) -> None:
    """A stop in progress that a library turned into an error (numpy's C init inside `import
    torch` makes it "cannot load module more than once") or swallowed is still a stop."""
    if _stop_signum:
        raise _Stop(_stop_signum) from exc


class _Stop(BaseException):
    """SIGTERM/SIGINT: unwinds whatever the engine is doing (a BaseException, so no request
    handler turns it into a reply)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _sun_path(path: Path) -> Iterator[str]:
    """An address for `path` that fits sockaddr_un: the path itself, or for a long one the same
    file reached through /proc/self/fd of its open folder (Linux)."""
    if len(os.fsencode(str(path))) <= SUN_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def error_reply(exc: BaseException) -> dict:
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(exc))}


def _read_line(conn: socket.socket) -> bytes:
    """Bytes up to the first newline (b"" if the peer closed before sending anything)."""
    buf = b""
    while b"\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_LINE:
            raise EngineError(f"message longer than {MAX_LINE} bytes without a newline")
    return buf.split(b"\n", 1)[0]


def _send(conn: socket.socket, obj: dict) -> None:
    conn.sendall((json.dumps(obj) + "\n").encode())


class Engine:
    """A unix socket bound at construction (before any model load) and the loop that answers it,
    one connection at a time."""

    def __init__(self, socket_path: str | Path, idle_exit_s: float = DEFAULT_IDLE_EXIT_S):
        self.path = Path(socket_path)
        self.idle_exit_s = idle_exit_s
        self.busy = False  # a load or a request is in progress (for the exit status on a signal)
        self.served = self.failed = 0
        if self.path.is_dir() and not self.path.is_symlink():
            raise EngineError(f"--socket {self.path}: is a folder; give a file path")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Whatever is there goes: Snakemake's placeholder file, or the stale socket of a killed run.
        if os.path.lexists(self.path):
            self.path.unlink()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with _sun_path(self.path) as address:
            self.sock.bind(address)
        self.sock.listen(socket.SOMAXCONN)
        self.sock.settimeout(POLL_S)
        self.inode = os.lstat(self.path).st_ino
        log.info("engine: listening on %s (pid %d)", self.path, os.getpid())

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

    def _drain(self, handle: Callable[[dict], dict]) -> None:
        """Idle exit without dropping a client that connected at the last moment: once the
        placeholder has replaced the socket no new connection can arrive, so answering what is
        already queued in the backlog leaves no one to reset when the socket closes."""
        self._vacate()
        self.sock.setblocking(False)
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError, socket.timeout):
                return
            with conn:
                log.info("engine: answering a client that connected as the engine went idle")
                self._answer(conn, handle)

    def serve(self, handle: Callable[[dict], dict]) -> None:
        """Answer connections one at a time with `handle(request) -> reply` until idle."""
        idle_since = time.monotonic()
        while True:
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                _raise_if_stopping(None)  # swallowed somewhere on its way here
                idle = time.monotonic() - idle_since
                if idle >= self.idle_exit_s:
                    self._drain(handle)
                    log.info("engine: idle for %.0f s (--idle-exit-s %g): exiting after %d "
                             "requests (%d failed)", idle, self.idle_exit_s, self.served, self.failed)
                    return
                continue
            with conn:
                self._answer(conn, handle)
            idle_since = time.monotonic()

    def _answer(self, conn: socket.socket, handle: Callable[[dict], dict]) -> None:
        conn.settimeout(READ_TIMEOUT_S)
        self.busy = True  # stays True if a signal unwinds the request (exit status 128 + signal)
        try:
            line = _read_line(conn)
            if not line:
                log.info("engine: a client connected and closed without a request")
                self.busy = False
                return
            request = json.loads(line)
            if not isinstance(request, dict):
                raise EngineError(f"request {line[:200]!r} is not a JSON object")
            reply = handle(request)
        except Exception as exc:  # every failure goes to the client (and the log)
            _raise_if_stopping(exc)
            log.error("engine: request failed: %s: %s\n%s", type(exc).__name__, exc,
                      traceback.format_exc())
            reply = error_reply(exc)
        self.served += 1
        self.failed += not reply.get("ok")
        try:
            _send(conn, reply)
        except OSError as exc:
            log.error("engine: could not reply (the client is gone): %s: %s\n%s",
                      type(exc).__name__, exc, traceback.format_exc())
        self.busy = False


def _extract_handler(extractor, settings: dict) -> Callable[[dict], dict]:
    def handle(request: dict) -> dict:
        missing = [k for k in ("shard", "out") if not isinstance(request.get(k), str)]
        if missing:
            raise EngineError(f"request without a string {missing[0]!r}: send "
                              '{"shard": <tokenized .parquet>, "out": <.h5>}')
        if "settings" in request and request["settings"] != settings:
            raise EngineError("the client's --settings differ from the engine's: its shard would "
                              "not match its rule's params; restart the engine with the same settings")
        t0 = time.monotonic()
        log.info("engine: request %s -> %s", request["shard"], request["out"])
        out = extractor.extract(request["shard"], request["out"])
        return {"ok": True, "out": str(out), "seconds": round(time.monotonic() - t0, 3)}
    return handle


def serve(socket_path: str | Path, target: str | Path, preflight: str | Path, settings: dict,
          idle_exit_s: float = DEFAULT_IDLE_EXIT_S, torch_threads: int | None = None,
          gpu_memory_utilization: float | None = None) -> int:
    """Bind, load the target once, serve until idle or signalled. Returns the exit status.

    `gpu_memory_utilization` (vLLM backend) changes no shard, so it is not part of `settings`
    (which clients must match): it only reaches the backend.
    """
    engine = None
    watchdog: list[threading.Timer] = []

    def force_exit(signum: int) -> None:
        log.error("engine: still running %g s after %s: forcing the exit", STOP_GRACE_S,
                  signal.Signals(signum).name)
        if engine is not None:
            engine.close()
        logging.shutdown()
        os._exit(128 + signum)

    def on_signal(signum, frame) -> None:
        global _stop_signum
        _stop_signum = _stop_signum or signum
        # The stop unwinds the load or the request (temporary files are cleaned on the way);
        # if that has not ended the process within STOP_GRACE_S, the watchdog ends it.
        if not watchdog:
            watchdog.append(threading.Timer(STOP_GRACE_S, force_exit, args=(signum,)))
            watchdog[0].daemon = True
            watchdog[0].start()
        raise _Stop(signum)

    global _stop_signum
    _stop_signum = 0
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        engine = Engine(socket_path, idle_exit_s)
        engine.busy = True
        t0 = time.monotonic()
        try:
            if torch_threads:
                from eyrie.cli import set_torch_threads

                set_torch_threads(torch_threads)
            from eyrie.extract import Extractor

            load_settings = settings
            if gpu_memory_utilization is not None:
                load_settings = {**settings, "vllm": {**(settings.get("vllm") or {}),
                                                      "gpu_memory_utilization": gpu_memory_utilization}}
            extractor = Extractor(target, preflight, load_settings)
        except Exception as exc:
            _raise_if_stopping(exc)
            log.error("engine: loading the target failed: %s: %s\n%s", type(exc).__name__, exc,
                      traceback.format_exc())
            failure = error_reply(exc)
            engine.busy = False
            # Snakemake does not look at a service's exit status: the clients must hear it.
            engine.serve(lambda request: failure)
            return 1
        engine.busy = False
        log.info("engine: loaded target %s in %.1f s (load 1 of this engine)", target,
                 time.monotonic() - t0)
        try:
            engine.serve(_extract_handler(extractor, settings))
        finally:
            extractor.close()
        return 0
    except _Stop as stop:
        busy = engine is not None and engine.busy
        log.info("engine: %s received%s: exiting", stop, " while busy (the work in progress is "
                 "abandoned)" if busy else "")
        return 128 + stop.signum if busy else 0
    finally:
        if engine is not None:
            engine.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _connect(path: Path, wait_s: float, engine_log: str | None) -> socket.socket:
    """Connect to the engine at `path`, retrying while it is missing, a placeholder file or a
    stale socket that refuses connections, for at most `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        state = "nothing is there"
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISSOCK(mode):
            state = "it is still a placeholder file (no engine has bound it)"
        elif mode is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                with _sun_path(path) as address:
                    sock.connect(address)
                return sock
            except OSError as exc:
                sock.close()
                if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                    raise EngineError(f"cannot connect to the engine at {path}: {exc}") from exc
                state = "a stale socket refuses connections (its engine is gone)"
        if time.monotonic() >= deadline:
            raise EngineError(
                f"no engine answered at {path} within {wait_s:g} s ({state}); start one with "
                f"`eyrie extract-engine --socket {path} ...` (in the workflow: the extract_engine "
                "job of this shard's group), or raise extract.engine_wait_s"
                + (f"; engine log: {engine_log}" if engine_log else ""))
        time.sleep(max(0.0, min(RETRY_S, deadline - time.monotonic())))


def request(socket_path: str | Path, shard: str | Path, out: str | Path, settings: dict | None = None,
            wait_s: float = DEFAULT_WAIT_S, engine_log: str | None = None) -> dict:
    """Have the engine at `socket_path` extract `shard` into `out`; returns its reply.

    Waits up to `wait_s` for the engine to accept, then for the reply as long as the connection
    stays open (the engine may still be loading the target, or serving other shards first)."""
    path = Path(socket_path)
    see_log = f"the engine's log {engine_log}" if engine_log else "the engine's log"
    t0 = time.monotonic()
    sock = _connect(path, wait_s, engine_log)
    message = {"shard": os.path.abspath(shard), "out": os.path.abspath(out)}
    if settings is not None:
        message["settings"] = settings
    with sock:
        log.info("sent %s to the engine at %s; waiting for its reply", shard, path)
        try:
            _send(sock, message)
            line = _read_line(sock)
        except OSError as exc:  # e.g. ECONNRESET: the engine closed while we were queued
            raise EngineError(f"the engine at {path} dropped the connection for {shard} "
                              f"({type(exc).__name__}: {exc}): it died; see {see_log}") from exc
    if not line:
        raise EngineError(f"the engine at {path} closed the connection without a reply for "
                          f"{shard}: it died or was stopped; see {see_log}")
    try:
        reply = json.loads(line)
    except json.JSONDecodeError as exc:
        raise EngineError(f"the engine at {path} sent a reply that is not JSON ({exc}): "
                          f"{line[:200]!r}; see {see_log}") from exc
    if not reply.get("ok"):
        raise EngineError(f"the engine at {path} failed on {shard}: {reply.get('error')} "
                          f"(traceback: {see_log})")
    log.info("engine wrote %s in %.1f s (%.1f s since this client started)", reply.get("out"),
             reply.get("seconds", 0.0), time.monotonic() - t0)
    return reply


def add_arguments(parser) -> None:
    from eyrie.cli import settings_arg

    parser.add_argument("--socket", required=True,
                        help="unix socket to serve (whatever is there is replaced)")
    parser.add_argument("--target", required=True, help="Hugging Face model folder of the target")
    parser.add_argument("--preflight", required=True, help="preflight.json that passed for this target")
    parser.add_argument("--settings", required=True, type=settings_arg,
                        help="JSON object with the extract, layers and trust_remote_code settings")
    parser.add_argument("--idle-exit-s", type=float, default=DEFAULT_IDLE_EXIT_S,
                        help="exit after this many seconds without a connection, once loaded "
                             "(default %(default)g)")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch CPU threads, set after the socket is bound (the global "
                             "--threads would import torch before binding)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="vLLM backend: fraction of GPU memory the engine may use (kept out "
                             "of --settings: it changes no shard)")


def run(args) -> int:
    return serve(args.socket, args.target, args.preflight, args.settings,
                 idle_exit_s=args.idle_exit_s, torch_threads=args.torch_threads,
                 gpu_memory_utilization=args.gpu_memory_utilization)
