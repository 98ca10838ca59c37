"""A shard's close (last writes, fsync, rename) runs behind the next shard's compute in the
engine (serving.Behind): the next shard starts before the last one is on the disk, each client
hears only once its shard is complete, the bytes are those of one shard at a time, a failed
close reaches its own client and leaves no shard, and at most one shard closes at a time."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from eyrie.core.errors import EngineError
from eyrie.extract import engine as engine_mod
from eyrie.extract.engine import Load
from eyrie.extract.extractor import Extractor
from eyrie.extract.protocol import EngineSocket, request
from eyrie.extract.serving import Behind, Engine
from eyrie.formats import hidden_writer
from tests.support.extract_helpers import build_case, settings, write_tokenized

DATASETS = ("input_ids", "loss_mask", "offsets", "sample_ids", "aux_hidden", "final_hidden")
SLOW_CLOSE_S = 1.5


def shards(tmp: Path, first: Path, ids, masks) -> list[Path]:
    """The case's shard and two more with other samples."""
    more = []
    for k, pick in ((1, lambda x: x[::-1]), (2, lambda x: np.roll(x, 1))):
        path = tmp / f"shard_00{k}.parquet"
        write_tokenized(path, [pick(x) for x in ids], masks)
        more.append(path)
    return [first, *more]


def start_clients(sock: Path, paths: list[Path], cfg: dict) -> tuple[list, dict, dict]:
    """One `request` per shard in a thread of its own, started 0.2 s apart (the backlog is first
    in, first out): (threads, replies: out stem -> reply or EngineError, when each heard)."""
    replies: dict[str, object] = {}
    heard: dict[str, float] = {}

    def client(path: Path) -> None:
        out = path.parent / f"out_{path.stem}.h5"
        try:
            replies[out.stem] = request(EngineSocket(sock, wait_s=60), path, out, settings=cfg)
        except EngineError as exc:
            replies[out.stem] = exc
        heard[out.stem] = time.monotonic()

    threads = []
    for path in paths:
        threads.append(threading.Thread(target=client, args=(path,), daemon=True))
        threads[-1].start()
        time.sleep(0.2)
    return threads, replies, heard


def serve_three(tmp: Path, monkeypatch, fail_close_of: str | None = None):
    """Three clients, connected in order, served by one in-process engine whose shard closes
    (the fsync before the rename) take SLOW_CLOSE_S each; events: (what, shard stem, time)."""
    target, shard0, preflight, ids, masks = build_case(tmp, "llama")
    paths = shards(tmp, shard0, ids, masks)
    cfg = settings(96)
    events: list[tuple[str, str, float]] = []
    real_sync, real_start = hidden_writer.sync_path, Extractor.start

    def slow_sync(path):
        if path.is_dir():
            return real_sync(path)
        stem = Path(path).name.split(".h5")[0].lstrip(".")
        events.append(("close", stem, time.monotonic()))
        time.sleep(SLOW_CLOSE_S)
        if stem == fail_close_of:
            raise OSError(errno.EIO, "Input/output error (injected)", str(path))
        real_sync(path)
        events.append(("closed", stem, time.monotonic()))

    def start(self, shard, out, tokenized=None):
        events.append(("compute", Path(out).stem, time.monotonic()))
        return real_start(self, shard, out, tokenized)

    monkeypatch.setattr(hidden_writer, "sync_path", slow_sync)
    monkeypatch.setattr(Extractor, "start", start)
    sock = tmp / "engine.sock"
    engine = Engine(sock, idle_exit_s=1.0)
    threads, replies, heard = start_clients(sock, paths, cfg)
    rc = engine_mod._load_and_serve(engine, Load(target, preflight, cfg))
    engine.close()
    for t in threads:
        t.join(timeout=60)
    return {
        "rc": rc,
        "engine": engine,
        "events": events,
        "replies": replies,
        "heard": heard,
        "paths": paths,
        "target": target,
        "preflight": preflight,
        "cfg": cfg,
    }


def when(events, what: str, stem: str) -> float:
    return next(t for w, s, t in events if w == what and s == stem)


@pytest.mark.slow
def test_next_shard_computes_while_the_last_one_closes(tmp_path, monkeypatch):
    got = serve_three(tmp_path, monkeypatch)
    ev, names = got["events"], [f"out_{p.stem}" for p in got["paths"]]
    assert got["rc"] == 0
    assert all(isinstance(got["replies"][n], dict) and got["replies"][n]["ok"] for n in names)
    for a, b in zip(names, names[1:]):
        # the next shard started before this one was on the disk ...
        assert when(ev, "compute", b) < when(ev, "closed", a), ev
        # ... closes ran one at a time ...
        assert when(ev, "closed", a) <= when(ev, "close", b), ev
    for n in names:
        # ... and a client heard only once its shard was on the disk under its name
        assert got["heard"][n] >= when(ev, "closed", n)
    assert got["engine"].served == 3 and got["engine"].failed == 0
    # the same bytes as one shard at a time
    with Extractor(got["target"], got["preflight"], got["cfg"]) as ex:
        for path, n in zip(got["paths"], names):
            alone = ex.extract(path, tmp_path / f"alone_{path.stem}.h5")
            with h5py.File(tmp_path / f"{n}.h5", "r") as a, h5py.File(alone, "r") as b:
                for k in DATASETS:
                    assert a[k].dtype == b[k].dtype and np.array_equal(a[k][:], b[k][:]), k


@pytest.mark.slow
def test_a_failed_close_reaches_its_own_client_and_leaves_no_shard(tmp_path, monkeypatch):
    got = serve_three(tmp_path, monkeypatch, fail_close_of="out_shard_000")
    failed = got["replies"]["out_shard_000"]
    assert isinstance(failed, EngineError) and "Input/output error (injected)" in str(failed)
    assert not (tmp_path / "out_shard_000.h5").exists()
    assert not list(tmp_path.glob(".out_shard_000.h5.tmp*"))  # the temporary file is gone
    for n in ("out_shard_001", "out_shard_002"):  # the shards after it were served
        assert got["replies"][n]["ok"] and (tmp_path / f"{n}.h5").exists()
    assert got["engine"].served == 3 and got["engine"].failed == 1


def test_behind_finishes_one_at_a_time_and_hands_errors_to_done():
    behind, running, log = Behind(), [], []
    lock = threading.Lock()

    def finish(k: int):
        def run():
            with lock:
                running.append(k)
                assert len(running) == 1, running  # one finish at a time
            time.sleep(0.2)
            with lock:
                running.remove(k)
            if k == 1:
                raise ValueError("close failed")
            return k

        return run

    t0 = time.monotonic()
    for k in range(3):
        behind.hand(finish(k), lambda got, exc: log.append((got, type(exc).__name__)))
        handed = time.monotonic() - t0
        # the hand of shard k waited for shard k-1's finish, not for its own
        assert 0.2 * k - 0.05 <= handed < 0.2 * k + 0.15, (k, handed)
    assert behind.busy()
    behind.close()
    assert log == [(0, "NoneType"), (None, "ValueError"), (2, "NoneType")]
    assert not behind.busy()


def test_behind_keeps_going_when_a_report_fails(caplog):
    """A `done` that raises (a reply that cannot be sent) is logged; the next hand() works."""
    behind, log = Behind(), []

    def broken(got, exc):
        raise RuntimeError("reply failed")

    behind.hand(lambda: 1, broken)
    behind.hand(lambda: 2, lambda got, exc: log.append(got))
    behind.close()
    assert log == [2] and "reporting a shard's close failed" in caplog.text


@pytest.mark.slow
def test_sigterm_while_a_shard_closes_completes_it_and_leaves_no_other(tmp_path):
    """The real engine process, SIGTERMed while shard 0 closes behind shard 1: shard 0 is
    finished and its client told; shard 1 (computed, waiting to be handed over) is abandoned,
    its temporary file removed; the queued client hears the engine went away; exit 128+15."""
    target, shard0, preflight, ids, masks = build_case(tmp_path, "llama")
    paths = shards(tmp_path, shard0, ids, masks)
    cfg = settings(96)
    sock, log = tmp_path / "e.sock", tmp_path / "engine.log"
    script = f"""
import logging, sys, time
from pathlib import Path
from eyrie.extract import engine
from eyrie.formats import hidden_writer

real = hidden_writer.sync_path
def slow(path):
    if not Path(path).is_dir():
        print("closing", Path(path).name, flush=True)
        time.sleep({SLOW_CLOSE_S * 2})
    real(path)
hidden_writer.sync_path = slow
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
load = engine.Load({str(target)!r}, {str(preflight)!r}, {cfg!r}, torch_threads=1)
sys.exit(engine.serve({str(sock)!r}, load, idle_exit_s=60))
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 60  # bound first: the clients then queue in their order
    while not sock.is_socket() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    threads, replies, _ = start_clients(sock, paths, cfg)
    deadline = time.monotonic() + 60
    while "closing .out_shard_000" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # shard 1 computes meanwhile, then waits for shard 0's close
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    for t in threads:
        t.join(timeout=30)
    text = log.read_text()
    assert rc == 128 + signal.SIGTERM and "SIGTERM received while busy" in text, text[-3000:]
    assert replies["out_shard_000"]["ok"], replies
    with h5py.File(tmp_path / "out_shard_000.h5", "r") as f:
        assert len(f["sample_ids"]) == len(ids)
    assert isinstance(replies["out_shard_001"], EngineError)
    assert isinstance(replies["out_shard_002"], EngineError)
    assert not (tmp_path / "out_shard_001.h5").exists()
    assert not list(tmp_path.glob(".out_shard_*.h5.tmp*")), list(tmp_path.iterdir())
    assert "forcing the exit" not in text
