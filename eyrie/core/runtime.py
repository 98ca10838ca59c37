"""What every stage's process shares: its CPU threads, its --settings and --runtime arguments,
its error lines.

`usable_threads` / `set_torch_threads` cap torch's threads at the CPUs this process may run on;
`settings_arg` parses a stage's `--settings JSON` and `--runtime JSON` (an object each: the CLI
declares both, eyrie.cli); `auto_device` resolves a
`*.device` setting; `describe` gives an exception's message, never an empty one;
`cache_environment` names the compilation caches' folders and `UNUSED_FRAMEWORKS` the frameworks
no stage imports. The CLI and the stage entries use these; none imports a stage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

# What kernels and compiled graphs GPU jobs build on their first run, each in its own folder under
# the config's cache.path, so that the next job and the next run (a rehearsal's cache, then the
# real run's) load them instead of building them again: torch.compile's graphs (training's draft,
# vLLM's), Triton's kernels (vLLM's MoE and attention kernels), vLLM's own compile cache, the
# driver's PTX JIT cache, DeepGEMM's, FlashInfer's and humming's JIT kernels (fp8, MLA and int4
# targets; vLLM 0.22 imports humming, which builds its launcher, in every engine), and
# matplotlib's font list (training's plot builds it on a first run); and the installed vLLM's facts
# (eyrie.vllm.facts_cache), which preflight, extraction and evaluation read.
VLLM_FACTS_CACHE = "EYRIE_VLLM_FACTS_CACHE"
CACHES = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "VLLM_CACHE_ROOT": "vllm",
    "CUDA_CACHE_PATH": "cuda",
    "DG_JIT_CACHE_DIR": "deep_gemm",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "HUMMING_CACHE_DIR": "humming",
    "MPLCONFIGDIR": "matplotlib",
    VLLM_FACTS_CACHE: "vllm-facts",
}

# `datasets` (which speculators imports) imports JAX and TensorFlow when they are installed: ~20 s
# of every training and export job on an image that has JAX, for nothing a stage uses.
UNUSED_FRAMEWORKS = {"USE_JAX": "0", "USE_TF": "0"}


def launch_environment() -> dict[str, str]:
    """The environment this process was started with (Linux: /proc/self/environ), not what a
    library imported since has put in os.environ: `import torch._inductor.config` sets
    TORCHINDUCTOR_CACHE_DIR to /tmp/torchinductor_<user> (the GPU image's Snakemake process
    imports it before the workflow reads cache.path). Elsewhere, os.environ."""
    try:
        raw = open("/proc/self/environ", "rb").read()
    except OSError:
        return dict(os.environ)
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def cache_environment(path: str | os.PathLike) -> dict[str, str]:
    """The environment variables that put each cache of CACHES under `path` (absolute)."""
    root = os.path.abspath(path)
    return {var: os.path.join(root, sub) for var, sub in CACHES.items()}


def usable_threads(asked: int) -> int:
    """At most as many threads as CPUs this process may run on: a scheduler that grants more
    CPUs than the node has (or a rule's `threads` above the machine's) would otherwise
    oversubscribe the cores, which slows torch's CPU kernels many times over."""
    cpus = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    if asked > cpus:
        logging.getLogger("eyrie.cli").info(
            "--threads %d: only %d CPUs are usable here; using %d", asked, cpus, cpus
        )
    return max(1, min(asked, cpus))


def set_torch_threads(asked: int, share: int = 1) -> None:
    """torch's CPU threads: `asked` capped at the usable CPUs, split among `share` processes of
    one node (torchrun's local ranks)."""
    import torch

    torch.set_num_threads(max(1, usable_threads(asked) // share))


NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def cuda_visible() -> bool:
    """Whether a CUDA device is visible, asked through NVML (PYTORCH_NVML_BASED_CUDA_CHECK):
    torch's default check initialises the CUDA driver, after which a forked child cannot use
    CUDA, so vLLM's engine core would have to be spawned, importing vLLM again (docs/vllm.md)."""
    import torch

    before = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"
    try:
        return torch.cuda.is_available()
    finally:
        if before is None:
            del os.environ[NVML_CHECK]
        else:
            os.environ[NVML_CHECK] = before


def auto_device(key: str, value: str, error: type[Exception]) -> str:
    """A `*.device` setting as cpu or cuda: auto takes cuda when one is visible (cuda_visible);
    cuda without one raises `error` naming `key`."""
    if value == "auto":
        return "cuda" if cuda_visible() else "cpu"
    if value == "cuda" and not cuda_visible():
        raise error(
            f"{key}=cuda but no CUDA device is visible; run on a GPU node or set {key} to auto/cpu"
        )
    return value


def auto_dtype(value: str, device: str) -> str:
    """A compute-dtype setting (`extract.dtype`, `eval.dtype`) as a torch dtype name: auto takes
    bfloat16 on CUDA (what a GPU serves the target in) and float32 on the CPU (where bfloat16
    matmuls are slow and round differently)."""
    if value == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return value


def describe(exc: BaseException) -> str:
    """An exception's message, never empty: `raise RuntimeError()` or `assert x` carry none, and a
    blank log line is what users then report."""
    text = str(exc).strip()
    return text if text else f"{type(exc).__name__} (no message)"


def settings_arg(text: str) -> dict:
    """argparse type of `--settings` and `--runtime`: a JSON object (argparse's error names the
    flag: `argument --runtime: not JSON: ...`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
