"""The installed vLLM's CUDA kernels that this GPU can run only from PTX, compiled in parallel into
the driver's JIT cache before an engine starts.

vLLM 0.22-0.26 ship their Marlin MoE kernels (int4 experts: Kimi-K2.5) as sm_80 PTX with no sm_90
machine code, so on an H100 or H200 the driver compiles them on first use, module after module,
inside the engine's initialisation (~80 s; BENCHMARKS.md, issue 38). `start()` launches a process
that loads each such module (a fatbin unit of one of vLLM's libraries, read from the library's
`.nv_fatbin` section) through the driver API in a pool of worker processes, one unit at a time per
worker, the largest first; the driver keeps what it compiles in its cache (CUDA_CACHE_PATH, one of
cache.path's folders), where the engine then finds it. The engine process imports vLLM meanwhile
and calls `finish()` before it builds the engine. A stamp in the cache folder, named for the
libraries, the GPU's arch and the driver, makes every later call a no-op; a lock keeps two engines
of one node from compiling the same units at once. Without an NVIDIA GPU it does nothing; with
CUDA_CACHE_DISABLE=1 or on a failure it logs one line and leaves the engine to compile as before.

    python -m eyrie.vllm.jit_ahead [--site DIR]   (one JSON line: what was compiled, how long)

Imports neither vLLM nor torch: it runs beside `import vllm`, not after it.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import fcntl
import hashlib
import importlib.util
import json
import logging
import multiprocessing
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

FATBIN_MAGIC = 0xBA55ED50
PTX, SASS = 1, 2
# vLLM's libraries whose PTX-only units are compiled ahead: every kernel library but the attention
# back-ends' (vllm_flash_attn: vLLM picks FlashAttention 3, built for sm_90a, on Hopper; FA2's
# sm_80 PTX would be compiled for nothing) and DeepGEMM's (its own JIT, DG_JIT_CACHE_DIR)
SKIP_DIRS = {"vllm_flash_attn", "deep_gemm"}
# the driver's CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
CC_MAJOR, CC_MINOR = 75, 76
STAMP = "eyrie-kernel-jit-{key}.json"
# longer than compiling every unit of vLLM 0.22's libraries one after another on one core
TIMEOUT_S = 900


def fatbin_section(path: Path) -> tuple[int, int]:
    """(file offset, size) of an ELF64 library's `.nv_fatbin` section; (0, 0) without one."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:5] != b"\x7fELF\x02":
            return 0, 0
        (shoff,) = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQ", table, i * shentsize) for i in range(shnum)]
        _, _, _, _, str_off, str_size = sections[shstrndx]
        f.seek(str_off)
        names = f.read(str_size)
    for name, _, _, _, offset, size in sections:
        if names[name : names.index(b"\0", name)] == b".nv_fatbin":
            return offset, size
    return 0, 0


def units(path: Path) -> list[dict]:
    """The fatbin units of a library: each a complete fatbin the driver loads as one module, with
    its file offset, length and entries (kind PTX or SASS, sm arch, bytes stored and bytes once
    decompressed: nvcc stores them compressed)."""
    offset, size = fatbin_section(path)
    if not size:
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    found, off = [], 0
    while off + 16 <= len(data):
        magic, _, head, body = struct.unpack_from("<IHHQ", data, off)
        if magic != FATBIN_MAGIC:
            off += 8  # units are 8-byte aligned
            continue
        entries, p, end = [], off + head, off + head + body
        while p + 32 <= end:
            kind, _, ehead = struct.unpack_from("<HHI", data, p)
            (stored,) = struct.unpack_from("<Q", data, p + 8)
            (arch,) = struct.unpack_from("<I", data, p + 28)
            # the size once decompressed: in headers of 64 bytes (nvcc 11.5 on), else as stored
            (plain,) = struct.unpack_from("<Q", data, p + 56) if ehead >= 64 else (0,)
            plain = plain or stored
            entries.append({"kind": kind, "arch": arch, "bytes": stored, "ptx_bytes": plain})
            p += ehead + stored
        found.append({"offset": offset + off, "length": end - off, "entries": entries})
        off = end
    return found


def runs_natively(entries: list[dict], arch: int) -> bool:
    """Machine code of the GPU's major arch at or below its minor (sm_90 code runs on sm_90)."""
    return any(
        e["kind"] == SASS and e["arch"] // 10 == arch // 10 and e["arch"] <= arch for e in entries
    )


def needs_jit(entries: list[dict], arch: int) -> bool:
    """A unit the driver compiles from PTX on an sm_`arch` GPU: no machine code it runs, PTX it
    can compile (an arch at or below the GPU's)."""
    ptx = any(e["kind"] == PTX and e["arch"] <= arch for e in entries)
    return ptx and not runs_natively(entries, arch)


def libraries(root: Path) -> list[Path]:
    """vLLM's compiled libraries whose units are compiled ahead (see SKIP_DIRS)."""
    return sorted(p for p in root.rglob("*.so") if not SKIP_DIRS & set(p.relative_to(root).parts))


def pending(root: Path, arch: int, libs: list[Path] | None = None) -> list[dict]:
    """Every unit of vLLM's libraries (`root`: the vllm package folder; `libs`: those of
    `libraries(root)` unless given) that an sm_`arch` GPU runs only after the driver compiles its
    PTX, the largest first (each `lib`, `offset`, `length`, `ptx_bytes`)."""
    todo = []
    for lib in libraries(root) if libs is None else libs:
        for unit in units(lib):
            if needs_jit(unit["entries"], arch):
                ptx = max(e["ptx_bytes"] for e in unit["entries"] if e["kind"] == PTX)
                todo.append(
                    {
                        "lib": str(lib),
                        "offset": unit["offset"],
                        "length": unit["length"],
                        "ptx_bytes": ptx,
                    }
                )
    return sorted(todo, key=lambda u: -u["ptx_bytes"])


class Driver:
    """The few CUDA driver calls this needs, through ctypes (libcuda.so.1)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.call("cuInit", 0)

    def call(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise RuntimeError(f"{name} failed: CUDA error {status}")

    def arch(self) -> int:
        """Device 0's compute capability as an sm number (90 for an H100)."""
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.call("cuDeviceGetAttribute", ctypes.byref(major), CC_MAJOR, 0)
        self.call("cuDeviceGetAttribute", ctypes.byref(minor), CC_MINOR, 0)
        return 10 * major.value + minor.value

    def version(self) -> int:
        value = ctypes.c_int()
        self.call("cuDriverGetVersion", ctypes.byref(value))
        return value.value

    def make_current(self) -> None:
        """Device 0's primary context, current in this thread (a module needs one)."""
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
        self.call("cuCtxSetCurrent", ctx)

    def load(self, image: bytes) -> None:
        """Load a fatbin as a module (the driver compiles its PTX, or reads its cache) and unload
        it."""
        module = ctypes.c_void_p()
        buffer = ctypes.create_string_buffer(image, len(image))
        self.call("cuModuleLoadData", ctypes.byref(module), buffer)
        self.call("cuModuleUnload", module)


_driver: Driver | None = None


def _worker_start() -> None:
    global _driver
    _driver = Driver()
    _driver.make_current()


def _compile(unit: dict) -> float:
    """Worker side: load one unit; the seconds it took."""
    with open(unit["lib"], "rb") as f:
        f.seek(unit["offset"])
        image = f.read(unit["length"])
    start = time.perf_counter()
    _driver.load(image)
    return time.perf_counter() - start


def compile_units(todo: list[dict]) -> list[float]:
    """Load each unit in a pool of workers_for(len(todo)) processes (device 0, its primary
    context); the seconds each took (milliseconds where the driver's cache has it)."""
    # spawned, not forked: the caller may have initialised CUDA; a worker whose driver fails
    # breaks the pool (BrokenProcessPool, a RuntimeError) instead of being started again
    with concurrent.futures.ProcessPoolExecutor(
        workers_for(len(todo)),
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_worker_start,
    ) as pool:
        return list(pool.map(_compile, todo))


def cache_folder() -> Path | None:
    """The driver's JIT cache folder (CUDA_CACHE_PATH, else its default); None when the cache is
    off (CUDA_CACHE_DISABLE=1), as then nothing compiled here would last."""
    if os.environ.get("CUDA_CACHE_DISABLE") == "1":
        return None
    path = os.environ.get("CUDA_CACHE_PATH") or os.path.expanduser("~/.nv/ComputeCache")
    return Path(path)


def stamp_key(libs: list[Path], arch: int, driver: int) -> str:
    """What the cache's contents depend on: each library (path, size, mtime), the arch, the
    driver."""
    parts = [f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in libs]
    return hashlib.sha256("\n".join([*parts, str(arch), str(driver)]).encode()).hexdigest()[:16]


def workers_for(n: int) -> int:
    """One worker per unit, at most the CPUs this process may use but one (the engine process
    imports vLLM meanwhile)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(n, (cpus or 1) - 1))


def compile_ahead(root: Path) -> dict:
    """Compile every pending unit of vLLM at `root` into the driver's cache (see the module's
    docstring); what was done, as a dict."""
    cache = cache_folder()
    if cache is None:
        return {"skipped": "CUDA_CACHE_DISABLE=1: the driver keeps nothing it compiles"}
    driver = Driver()
    arch, version = driver.arch(), driver.version()
    libs = libraries(root)
    cache.mkdir(parents=True, exist_ok=True)
    stamp = cache / STAMP.format(key=stamp_key(libs, arch, version))
    with open(cache / "eyrie-kernel-jit.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another engine of this node compiling: wait for it
        if stamp.exists():
            return {"skipped": f"compiled before ({stamp.name})", "arch": arch}
        start = time.perf_counter()
        todo = pending(root, arch)
        done = {
            "arch": arch,
            "driver": version,
            "units": len(todo),
            "ptx_mb": round(sum(u["ptx_bytes"] for u in todo) / 1e6, 1),
        }
        if todo:
            seconds = compile_units(todo)
            done.update(
                workers=workers_for(len(todo)),
                longest_s=round(max(seconds), 1),
                compile_s=round(sum(seconds), 1),
            )
        done["wall_s"] = round(time.perf_counter() - start, 1)
        stamp.write_text(json.dumps(done) + "\n")
        return done


def vllm_root() -> Path | None:
    """The installed vllm package's folder, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def start() -> subprocess.Popen | None:
    """Launch the compilation beside this process (None where there is no vLLM or no GPU)."""
    root = vllm_root()
    if root is None or not Path("/dev/nvidiactl").exists():
        return None
    env = dict(os.environ, CUDA_MODULE_LOADING="EAGER")  # a module compiles whole when loaded
    cmd = [sys.executable, "-m", "eyrie.vllm.jit_ahead", "--site", str(root)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)


def finish(proc: subprocess.Popen | None) -> dict | None:
    """Wait for `start()`'s process; log one line of what it did (or why it failed: the engine
    then compiles the kernels itself, as without it)."""
    if proc is None:
        return None
    start_wait = time.perf_counter()
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\nstopped after {TIMEOUT_S} s"
    waited = time.perf_counter() - start_wait
    try:
        done = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (err.strip().splitlines() or ["no output"])[-1]
        log.warning(
            "kernel JIT ahead failed (exit %s: %s); the engine compiles them", proc.returncode, tail
        )
        return None
    log.info("vLLM kernels compiled ahead from PTX: %s; waited %.1f s for it", done, waited)
    return done
