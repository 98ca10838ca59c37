"""eyrie extract-engine: one target load serves many shards, with the same bytes as standalone
`eyrie extract`; errors (a bad shard, a failed load, a dead engine, no engine) reach the client
with their type; the engine exits when idle or signalled and leaves a placeholder file
where its socket was."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from eyrie.cli import main as cli_main
from eyrie.core.errors import EngineError
from eyrie.extract.protocol import EngineSocket, request
from eyrie.extract.serving import STOP_GRACE_S, Engine
from tests.support.extract_helpers import build_case, extract_args, settings, write_tokenized
from tests.support.stages import eyrie_cmd, run_stage

DATASETS = ("input_ids", "loss_mask", "offsets", "sample_ids", "aux_hidden", "final_hidden")


def placeholder_left(path) -> bool:
    """The engine closed: an empty regular file where its socket was (nothing to connect to)."""
    return stat.S_ISREG(os.lstat(path).st_mode) and os.path.getsize(path) == 0


def start_engine(
    sock: Path, target: Path, preflight: Path, log: Path, cfg: dict, idle_exit_s: float
) -> subprocess.Popen:
    """The real CLI, as the extract_engine rule runs it (one torch thread, like the tests)."""
    cmd = eyrie_cmd(
        "extract-engine",
        socket=sock,
        target=target,
        preflight=preflight,
        settings=cfg,
        idle_exit_s=idle_exit_s,
        torch_threads=1,
    )
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)


def client(
    sock: Path, target: Path, shard: Path, preflight: Path, out: Path, cfg: dict, log: Path
) -> subprocess.Popen:
    """`eyrie extract --engine` as the extract_hidden_states rule runs it."""
    cmd = eyrie_cmd("extract", engine=sock, engine_wait_s=60, engine_log=log)
    cmd += extract_args(target, shard, preflight, out, cfg)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_socket(path: Path, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not (path.is_socket() or proc.poll() is not None or time.monotonic() > deadline):
        time.sleep(0.05)
    assert path.is_socket(), f"no socket at {path} (engine exit status {proc.poll()})"


def datasets(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {k: f[k][:] for k in DATASETS}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One engine process serving: two shards from two concurrent CLI clients, a missing shard,
    a request with other settings, then one more shard; it then exits when idle."""
    tmp = tmp_path_factory.mktemp("engine")
    target, shard0, preflight, ids, masks = build_case(tmp, "llama")
    shard1 = tmp / "shard_001.parquet"  # other samples, other lengths
    write_tokenized(
        shard1, [x[::-1] for x in ids[:5]], masks[:5], [f"other.jsonl:{i}" for i in range(5)]
    )
    cfg = settings(96)
    sock, log = tmp / "engine_000.sock", tmp / "engine.log"
    sock.touch()  # the workflow's placeholder: replaced by the engine's socket
    t0 = time.monotonic()
    engine = start_engine(sock, target, preflight, log, cfg, idle_exit_s=4)
    clients = [
        client(sock, target, s, preflight, tmp / f"engine_{s.stem}.h5", cfg, log)
        for s in (shard0, shard1)
    ]
    outputs = [c.communicate(timeout=120)[0] for c in clients]
    assert [c.returncode for c in clients] == [0, 0], outputs
    missing = client(sock, target, tmp / "missing.parquet", preflight, tmp / "missing.h5", cfg, log)
    missing_out = missing.communicate(timeout=60)[0]
    other = settings(64)
    with pytest.raises(EngineError) as mismatch:
        request(EngineSocket(sock, wait_s=10), shard0, tmp / "mismatch.h5", settings=other)
    last = request(EngineSocket(sock, wait_s=10), shard1, tmp / "again.h5", settings=cfg)
    rc = engine.wait(timeout=60)
    engine_s = time.monotonic() - t0
    # the same shards, standalone: one model load each, in this process
    for s in (shard0, shard1):
        out = tmp / f"alone_{s.stem}.h5"
        assert run_stage("extract", *extract_args(target, s, preflight, out, cfg)) == 0
    return {
        "tmp": tmp,
        "sock": sock,
        "log": log.read_text(),
        "rc": rc,
        "engine_s": engine_s,
        "missing": (missing.returncode, missing_out),
        "mismatch": str(mismatch.value),
        "last": last,
        "shards": (shard0, shard1),
    }


@pytest.mark.slow
def test_two_shards_one_load_same_bytes_as_standalone(served):
    tmp, log = served["tmp"], served["log"]
    assert log.count("engine: loaded target") == 1 and "(load 1 of this engine)" in log
    assert log.count("engine: request /") == 4  # the settings mismatch is refused before
    for s in served["shards"]:
        a, b = datasets(tmp / f"engine_{s.stem}.h5"), datasets(tmp / f"alone_{s.stem}.h5")
        for name in DATASETS:
            assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name
    # the shard served after two failed requests equals the first one served
    again, first = datasets(tmp / "again.h5"), datasets(tmp / "engine_shard_001.h5")
    assert all(np.array_equal(again[k], first[k]) for k in DATASETS)
    assert served["last"]["ok"] is True and served["last"]["seconds"] >= 0


@pytest.mark.slow
def test_bad_shard_error_reaches_client_with_type_and_engine_keeps_serving(served):
    rc, out = served["missing"]
    assert rc == 2
    assert (
        "failed on" in out
        and "ExtractError: " in out
        and "missing.parquet: unreadable parquet" in out
    )
    assert str(served["tmp"] / "engine.log") in out  # names the engine's log
    # the engine logged it with type and traceback, then served the next requests
    log = served["log"]
    assert (
        "engine: request failed: ExtractError:" in log
        and "Traceback (most recent call last)" in log
    )
    assert "EngineError: the client's --settings differ from the engine's" in served["mismatch"]
    assert (
        not (served["tmp"] / "missing.h5").exists() and not (served["tmp"] / "mismatch.h5").exists()
    )


@pytest.mark.slow
def test_engine_exits_when_idle_and_leaves_a_placeholder(served):
    assert served["rc"] == 0
    assert (
        "engine: idle for" in served["log"]
        and "exiting after 5 requests (2 failed)" in served["log"]
    )
    # no socket left to connect to, but a file for Snakemake's touch of the service output
    mode = os.lstat(served["sock"]).st_mode
    assert stat.S_ISREG(mode) and os.path.getsize(served["sock"]) == 0


@pytest.mark.slow
def test_client_waits_through_placeholder_and_stale_socket(tmp_path):
    sock = tmp_path / "e.sock"
    sock.touch()  # placeholder
    replies: list = []
    t0 = time.monotonic()
    waiter = threading.Thread(
        target=lambda: replies.append(
            request(EngineSocket(sock, wait_s=30), tmp_path / "s.parquet", tmp_path / "o.h5")
        )
    )
    waiter.start()
    time.sleep(1.0)
    sock.unlink()  # a stale socket: bound by a process that is gone, refuses connections
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))
    stale.close()
    time.sleep(1.0)
    assert waiter.is_alive() and sock.is_socket()
    engine = Engine(sock, idle_exit_s=5)  # > the client's retry interval, with room for a busy CI
    served = threading.Thread(
        target=engine.serve, args=(lambda req: {"ok": True, "out": req["out"], "seconds": 0.0},)
    )
    served.start()
    waiter.join(timeout=20)
    served.join(timeout=20)
    engine.close()
    assert replies and replies[0]["out"] == str(tmp_path / "o.h5")
    assert time.monotonic() - t0 >= 2.0
    assert placeholder_left(sock)


def test_idle_exit_answers_a_client_that_connects_at_the_last_moment(tmp_path, monkeypatch):
    """A client that connects just as the idle clock runs out must not have its queued
    connection reset by the socket's close. Here the client connects inside the idle exit
    itself, after the last accept() timed out and before the socket is replaced."""
    sock = tmp_path / "e.sock"
    engine = Engine(sock, idle_exit_s=0)
    vacate = engine._vacate
    late = {}

    def connect_then_vacate():
        if "conn" not in late:
            late["conn"] = socket.socket(socket.AF_UNIX)
            late["conn"].connect(str(sock))
            late["conn"].sendall(b'{"shard": "s.parquet", "out": "late.h5"}\n')
        vacate()

    monkeypatch.setattr(engine, "_vacate", connect_then_vacate)
    engine.serve(lambda req: {"ok": True, "out": req["out"], "seconds": 0.0})
    engine.close()
    with late["conn"] as conn:
        conn.settimeout(5)
        reply = json.loads(conn.recv(65536))
    assert reply == {"ok": True, "out": "late.h5", "seconds": 0.0}
    assert engine.served == 1 and placeholder_left(sock)


@pytest.mark.slow
@pytest.mark.parametrize("library", ["converts", "swallows"])
def test_a_sigterm_a_library_catches_still_ends_the_engine(tmp_path, library):
    """A SIGTERM that lands in numpy's C init inside `import torch` becomes "ImportError: cannot
    load module more than once per process"; taken for a failed load, it would be served to
    clients until the idle exit. A stop turned into an error is still a stop; one swallowed
    outright is ended by the watchdog STOP_GRACE_S later."""
    sock, log = tmp_path / "e.sock", tmp_path / "engine.log"
    script = f"""
import logging, sys, time
import eyrie.extract.extractor
from eyrie.extract import engine

class Stubborn:
    def __init__(self, *args):
        print("loading", flush=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                time.sleep(0.05)
            except BaseException:
                print("caught", flush=True)
                if {library!r} == "converts":
                    raise ImportError("cannot load module more than once per process")

eyrie.extract.extractor.Extractor = Stubborn
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
sys.exit(engine.serve({str(sock)!r}, engine.Load("t", "p.json", {{}}), idle_exit_s=60))
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    wait_for_socket(sock, proc)
    # the load starts with the first request: a client that connects and waits
    client = threading.Thread(
        target=lambda: pytest.raises(
            EngineError, request, EngineSocket(sock, wait_s=10), "s.parquet", tmp_path / "o.h5"
        ),
        daemon=True,
    )
    client.start()
    deadline = time.monotonic() + 30
    while "loading" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    took = time.monotonic() - t0
    client.join(timeout=30)
    text = log.read_text()
    assert rc == 128 + signal.SIGTERM and "caught" in text
    assert "loading the target failed" not in text  # no client is told of a made-up load error
    if library == "converts":
        assert "SIGTERM received while busy" in text and "forcing" not in text and took < 10
    else:
        assert "forcing the exit" in text and STOP_GRACE_S <= took < STOP_GRACE_S + 10
    assert placeholder_left(sock)


@pytest.mark.slow
@pytest.mark.parametrize("state", ["placeholder", "stale socket", "nothing"])
def test_client_gives_up_after_engine_wait_s(tmp_path, capsys, state):
    sock = tmp_path / "e.sock"
    if state == "placeholder":
        sock.touch()
    elif state == "stale socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(sock))
        s.close()
    t0 = time.monotonic()
    rc = cli_main(
        [
            "extract",
            "--engine",
            str(sock),
            "--engine-wait-s",
            "1.5",
            "--engine-log",
            "logs/e.log",
            "--target",
            "t",
            "--shard",
            "s.parquet",
            "--preflight",
            "p.json",
            "--out",
            str(tmp_path / "o.h5"),
            "--settings",
            "{}",
        ]
    )
    waited = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 2 and 1.5 <= waited < 5
    assert f"no engine answered at {sock} within 1.5 s" in err and "extract.engine_wait_s" in err
    assert {
        "placeholder": "placeholder file",
        "stale socket": "stale socket",
        "nothing": "nothing is there",
    }[state] in err
    assert "logs/e.log" in err and err.count("\n") == 1


@pytest.mark.slow
def test_failed_model_load_reaches_every_client(tmp_path):
    target, shard, preflight, _, _ = build_case(tmp_path, "llama")
    (target / "model.safetensors").write_bytes(b"not safetensors")  # config.json is intact
    sock, log = tmp_path / "e.sock", tmp_path / "engine.log"
    engine = start_engine(sock, target, preflight, log, settings(96), idle_exit_s=1)
    errors = []
    for out in ("a.h5", "b.h5"):
        with pytest.raises(EngineError) as err:
            request(EngineSocket(sock, wait_s=60, log=str(log)), shard, tmp_path / out)
        errors.append(str(err.value))
    assert engine.wait(timeout=60) == 1
    for e in errors:
        # "<Type>: <message>" of the load's exception, and where its traceback is
        assert "failed on" in e and str(log) in e
        assert "ExtractError: " in e and "cannot load the target with transformers" in e
    text = log.read_text()
    assert "engine: loading the target failed: ExtractError:" in text and "Traceback" in text
    assert placeholder_left(sock)


def test_sigterm_during_load_exits_promptly_and_the_client_hears_it(tmp_path):
    target, shard, preflight, _, _ = build_case(tmp_path, "llama")
    sock, log = tmp_path / "e.sock", tmp_path / "engine.log"
    engine = start_engine(sock, target, preflight, log, settings(96), idle_exit_s=60)
    wait_for_socket(sock, engine)
    errors = []

    def ask():
        try:
            request(EngineSocket(sock, wait_s=10, log=str(log)), shard, tmp_path / "o.h5")
        except EngineError as exc:
            errors.append(str(exc))

    waiter = threading.Thread(target=ask)
    waiter.start()
    deadline = time.monotonic() + 30  # the first request starts the load
    while "engine: loading target" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # into the load
    t0 = time.monotonic()
    engine.send_signal(signal.SIGTERM)
    rc = engine.wait(timeout=30)
    waiter.join(timeout=30)
    assert time.monotonic() - t0 < 10
    assert rc == 128 + signal.SIGTERM  # interrupted while busy (loading)
    # unwound at once, or (when the signal lands in a C extension's init inside `import torch`,
    # which swallows it) ended by the watchdog STOP_GRACE_S later: 4 of 10 loaded runs here
    text = log.read_text()
    assert "SIGTERM received while busy" in text or "forcing the exit" in text
    assert placeholder_left(sock)
    assert errors and ("without a reply" in errors[0] or "dropped the connection" in errors[0])
    assert str(log) in errors[0]
    # its own cause, from the engine's log: the stop (Snakemake stops a group's other jobs so)
    assert "(its last word: engine: " in errors[0]
    assert "SIGTERM received" in errors[0] or "forcing the exit" in errors[0], errors[0]


def test_long_socket_path_binds_and_connects(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    sock = deep / "engine_000.sock"
    assert len(str(sock)) > 108  # longer than sockaddr_un allows
    engine = Engine(sock, idle_exit_s=0.5)
    served = threading.Thread(
        target=engine.serve, args=(lambda req: {"ok": True, "out": req["out"], "seconds": 0.0},)
    )
    served.start()
    reply = request(EngineSocket(sock, wait_s=5), "s.parquet", "o.h5")
    served.join(timeout=10)
    engine.close()
    assert reply["ok"] and placeholder_left(sock)


def test_the_vllm_engine_gets_its_memory_share_in_runtime_without_the_interpreter():
    from eyrie.config.rules import vllm_stage_runtime
    from eyrie.config.schema import validate_config

    config = validate_config({"target": {"name": "t"}, "extract": {"backend": "vllm"}})
    share = config["vllm"]["gpu_memory_utilization"]
    assert vllm_stage_runtime(config, "extract_engine") == {
        "vllm": {"gpu_memory_utilization": share}
    }
    config = validate_config({"target": {"name": "t"}})  # the hf engine reads nothing more
    assert vllm_stage_runtime(config, "extract_engine") == {}
    # the engine's command line as the rule writes it: --runtime parsed into what Load passes on
    from eyrie import cli

    argv = ["--socket", "e.sock", "--target", "t", "--preflight", "p.json", "--settings", "{}"]
    runtime = '{"vllm": {"gpu_memory_utilization": 0.5}}'
    args = cli.build_parser("extract-engine").parse_args(
        ["extract-engine", *argv, "--runtime", runtime]
    )
    assert args.runtime == {"vllm": {"gpu_memory_utilization": 0.5}}
