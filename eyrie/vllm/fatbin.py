"""The CUDA kernels inside the installed vLLM's libraries that a GPU runs only from PTX: found
without a GPU, and compiled through the driver into its JIT cache (CUDA_CACHE_PATH, one of
cache.path's folders) by `eyrie compile-kernels` while the workflow's CPU jobs run.

A library's `.nv_fatbin` section holds one fatbin per translation unit: its entries are machine
code (SASS) per SM arch or PTX, stored zstd-compressed by recent nvcc. A unit without SASS the GPU
runs but with PTX at or below its arch is compiled by the driver, whole and on one thread, when
first loaded. vLLM 0.22-0.26 build the Marlin MoE kernels `8.0+PTX` (no sm_90 code): one unit per
activation x weight type, whose PTX entry points (`kernel_names`, through libzstd) carry vLLM's
ScalarType ids as template arguments. An engine's first forward loads the unit its target needs
(bf16 x uint4b8 for Kimi-K2.5's int4 experts: 52 s on an H100; BENCHMARKS.md); engines take the
compilation lock (`wait_for_compilation`) so that they load it from the cache instead of compiling
it a second time. Imports neither vLLM nor torch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import importlib.util
import multiprocessing
import os
import re
import struct
import time
from collections.abc import Iterator
from pathlib import Path

from eyrie.core.io import file_lock

FATBIN_MAGIC = 0xBA55ED50
PTX, SASS = 1, 2
# libraries left out unless asked for: the attention back-ends' (vllm_flash_attn: vLLM picks
# FlashAttention 3, built for sm_90a, on Hopper) and DeepGEMM's (its own JIT, DG_JIT_CACHE_DIR)
SKIP_DIRS = {"vllm_flash_attn", "deep_gemm"}
# the driver's CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
CC_MAJOR, CC_MINOR = 75, 76


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
    """vLLM's compiled libraries but those of SKIP_DIRS."""
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


def compile_units(todo: list[dict], workers: int) -> list[float]:
    """Load each unit in a pool of `workers` processes (device 0, its primary context), the
    order given; the seconds each took (milliseconds where the driver's cache has it)."""
    # spawned, not forked: the caller may have initialised CUDA; a worker whose driver fails
    # breaks the pool (BrokenProcessPool, a RuntimeError) instead of being started again; eager
    # module loading: a module compiles whole when loaded, not kernel by kernel when first used
    before = os.environ.get("CUDA_MODULE_LOADING")
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"  # the workers inherit it when they start
    try:
        with concurrent.futures.ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_start,
        ) as pool:
            return list(pool.map(_compile, todo))
    finally:
        if before is None:
            os.environ.pop("CUDA_MODULE_LOADING", None)
        else:
            os.environ["CUDA_MODULE_LOADING"] = before


def workers_for(n: int, most: int | None = None) -> int:
    """One worker per unit, at most `most` and the CPUs this process may use."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(n, cpus or 1, most or n))


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def kernel_names(lib: str | Path, unit: dict) -> list[str]:
    """The mangled names of a unit's PTX entry points ([] where its PTX is stored in another
    compression than zstd's)."""
    with open(lib, "rb") as f:
        f.seek(unit["offset"])
        data = f.read(unit["length"])
    (head,) = struct.unpack_from("<H", data, 6)
    p, names = head, []
    while p + 32 <= len(data):
        kind, _, ehead = struct.unpack_from("<HHI", data, p)
        (stored,) = struct.unpack_from("<Q", data, p + 8)
        (plain,) = struct.unpack_from("<Q", data, p + 56) if ehead >= 64 else (stored,)
        payload = data[p + ehead : p + ehead + stored]
        if kind == PTX:
            ptx = _unzstd(payload, plain) if payload[:4] == ZSTD_MAGIC else payload
            names += [m.decode() for m in re.findall(rb"\.entry\s+(\w+)\(", ptx)]
        p += ehead + stored
    return names


def _unzstd(payload: bytes, size: int) -> bytes:
    """One zstd frame (an entry is padded after it) through libzstd."""
    zstd = ctypes.CDLL("libzstd.so.1")
    for fn in (zstd.ZSTD_decompress, zstd.ZSTD_findFrameCompressedSize):
        fn.restype = ctypes.c_size_t
    zstd.ZSTD_isError.argtypes = [ctypes.c_size_t]
    frame = zstd.ZSTD_findFrameCompressedSize(payload, ctypes.c_size_t(len(payload)))
    out = ctypes.create_string_buffer(size)
    n = 0 if zstd.ZSTD_isError(frame) else zstd.ZSTD_decompress(out, size, payload, frame)
    if not n or zstd.ZSTD_isError(n):
        raise RuntimeError("zstd could not decompress a PTX entry")
    return out.raw[:n]


def vllm_root() -> Path | None:
    """The installed vllm package's folder, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def template_ids(name: str) -> list[int]:
    """The integer template arguments of a mangled kernel name, in order."""
    return [int(x) for x in re.findall(r"Ll(\d+)E", name)]


def namespaces(name: str, most: int = 2) -> list[str]:
    """The first `most` components of a mangled name (`_ZN<len><name>...`)."""
    parts, i = [], 3
    while name.startswith("_ZN") and len(parts) < most and i < len(name) and name[i].isdigit():
        digits = re.match(r"\d+", name[i:])[0]
        i += len(digits)
        parts.append(name[i : i + int(digits)])
        i += int(digits)
    return parts


def label(names: list[str], types: dict[int, str] | None = None) -> str:
    """A unit's first kernel: namespace::function<first two template integers>, each integer by
    its ScalarType name where `types` has it."""
    if not names:
        return "?"
    family = "::".join(namespaces(names[0])) or names[0][:40]
    ids = template_ids(names[0])[:2]
    types = types or {}
    return f"{family}<{', '.join(types.get(i, str(i)) for i in ids)}>" if ids else family


LOCK = "eyrie-kernel-jit.lock"


def cache_folder() -> Path | None:
    """The driver's JIT cache folder (CUDA_CACHE_PATH, else its default); None when the cache is
    off (CUDA_CACHE_DISABLE=1): nothing compiled ahead would last."""
    if os.environ.get("CUDA_CACHE_DISABLE") == "1":
        return None
    return Path(os.environ.get("CUDA_CACHE_PATH") or os.path.expanduser("~/.nv/ComputeCache"))


@contextlib.contextmanager
def compilation_lock(exclusive: bool, wait_s: float | None = None) -> Iterator[bool]:
    """The cache folder's lock: exclusive while compile-kernels compiles, shared for an engine
    about to load what it compiled; yields whether it holds it (False: no cache folder, no
    lockable file, or still held by another after `wait_s` seconds)."""
    cache = cache_folder()
    if cache is None:
        yield False
        return
    with file_lock(cache / LOCK, exclusive, wait_s) as held:
        yield held


# an engine waits this long at most (longer than compiling vLLM 0.22's largest PTX-only unit on an
# H100, BENCHMARKS.md), then starts and compiles what it needs itself
WAIT_S = 600


def wait_for_compilation(wait_s: float = WAIT_S) -> float:
    """Wait while compile-kernels compiles this target's kernels into the cache (an engine calls
    this before it starts, then loads them from the cache); the seconds waited."""
    start = time.perf_counter()
    with compilation_lock(exclusive=False, wait_s=wait_s):
        pass
    return time.perf_counter() - start
