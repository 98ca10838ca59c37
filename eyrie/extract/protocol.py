"""The extraction engine's wire protocol and its client; standard library only, so shard clients
stay light.

One JSON line each way per connection over a unix socket. Request `{"shard": path, "out":
path}` (plus `"settings"`, which must equal the engine's own); reply `{"ok": true, "out": path,
"seconds": s}` or `{"ok": false, "error": "<Type>: <message>", "traceback": "..."}`. `request`
waits up to its `EngineSocket`'s `wait_s` for the engine to accept, then for its reply
(docs/extraction.md).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import stat
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from eyrie.core.errors import EngineError

log = logging.getLogger(__name__)


READ_TIMEOUT_S = 60.0  # for a client's request line (clients send it right after connecting)
RETRY_S = 1.0  # client: between attempts to connect
MAX_LINE = 1 << 20  # bytes of one message
SUN_PATH_MAX = 100  # bytes; sockaddr_un.sun_path holds 108 on Linux


@contextlib.contextmanager
def sun_path(path: Path) -> Iterator[str]:
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
    """The reply that tells a client of a failure."""
    return {
        "ok": False,
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": "".join(traceback.format_exception(exc)),
    }


def read_line(conn: socket.socket) -> bytes:
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


def send(conn: socket.socket, obj: dict) -> None:
    conn.sendall((json.dumps(obj) + "\n").encode())


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
                with sun_path(path) as address:
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
                + (f"; engine log: {engine_log}" if engine_log else "")
            )
        time.sleep(max(0.0, min(RETRY_S, deadline - time.monotonic())))


@dataclass(frozen=True)
class EngineSocket:
    """The engine a client asks: its socket, how long to wait for it to accept, and its log (named
    in errors)."""

    path: str | Path
    wait_s: float  # extract.engine_wait_s (its default: the schema's, given by `eyrie extract`)
    log: str | None = None


def request(
    engine: EngineSocket, shard: str | Path, out: str | Path, *, settings: dict | None = None
) -> dict:
    """Have `engine` extract `shard` into `out`; returns its reply.

    Waits up to `engine.wait_s` for the engine to accept, then for the reply as long as the
    connection stays open (the engine may still be loading the target, or serving other shards
    first)."""
    path = Path(engine.path)
    see_log = f"the engine's log {engine.log}" if engine.log else "the engine's log"
    t0 = time.monotonic()
    sock = _connect(path, engine.wait_s, engine.log)
    message = {"shard": os.path.abspath(shard), "out": os.path.abspath(out)}
    if settings is not None:
        message["settings"] = settings
    with sock:
        log.info("sent %s to the engine at %s; waiting for its reply", shard, path)
        try:
            send(sock, message)
            line = read_line(sock)
        except OSError as exc:  # e.g. ECONNRESET: the engine closed while we were queued
            raise EngineError(
                f"the engine at {path} dropped the connection for {shard} "
                f"({type(exc).__name__}: {exc}): it died{last_word(engine.log)}; see {see_log}"
            ) from exc
    reply = _reply(line, f"the engine at {path}", shard, see_log, engine.log)
    log.info(
        "engine wrote %s in %.1f s (%.1f s since this client started)",
        reply.get("out"),
        reply.get("seconds", 0.0),
        time.monotonic() - t0,
    )
    return reply


LAST_WORDS = (" ERROR ", "received", "forcing the exit")  # the engine's failure and stop lines


def last_word(engine_log: str | None) -> str:
    """ " (its last word: <line>)" with the engine log's last error or stop line, for a client
    whose connection closed without a reply: a failure of the engine's own (a full disk), or a
    stop (Snakemake stops a group's jobs when one fails); "" without one."""
    if not engine_log:
        return ""
    try:
        with open(engine_log, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - (64 << 10)))
            tail = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    for line in reversed(tail):
        if any(w in line for w in LAST_WORDS):
            said = line.split(" ERROR ", 1)[-1].split(" INFO ", 1)[-1].split(" WARNING ", 1)[-1]
            return f" (its last word: {said.strip()[:300]})"
    return ""


def _reply(
    line: bytes, engine: str, shard: str | Path, see_log: str, log_path: str | None = None
) -> dict:
    """The engine's reply line as a successful reply; EngineError for anything else."""
    if not line:
        raise EngineError(
            f"{engine} closed the connection without a reply for "
            f"{shard}: it died or was stopped{last_word(log_path)}; see {see_log}"
        )
    try:
        reply = json.loads(line)
    except json.JSONDecodeError as exc:
        raise EngineError(
            f"{engine} sent a reply that is not JSON ({exc}): {line[:200]!r}; see {see_log}"
        ) from exc
    if not reply.get("ok"):
        raise EngineError(
            f"{engine} failed on {shard}: {reply.get('error')} (traceback: {see_log})"
        )
    return reply
