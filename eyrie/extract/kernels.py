"""`eyrie compile-kernels`: compile, on this GPU, the vLLM kernels the target's engines will load
from PTX only, into the driver's JIT cache (cache.path/cuda), while the workflow's CPU jobs
(tokenization, preflight) run. vLLM 0.22-0.26 ship the Marlin MoE kernels of int4 experts without
sm_90 code; the driver compiles the target's unit on one thread when the first engine's first
forward loads it (52 s for Kimi-K2.5's on an H100: the cold rehearsal's extraction engine waited
for it). Engines take the cache's lock before they start (eyrie.vllm.fatbin.wait_for_compilation)
and load the unit compiled here. Writes what it compiled, or why nothing, to --out; a target that
runs no Marlin kernel, a machine without a GPU or an engine that needs another unit than chosen
here cost nothing but this job: the engine compiles what it needs, as without it. Runs in the
vLLM environment (it reads vLLM's ScalarType ids and libraries). docs/rehearsal.md.

Beside the compilation it reads the installed vLLM's facts for the target into cache.path, as
preflight's probe would (the same subprocess, so the same cache entry), holding their lock:
preflight, which starts once tokenization is done, then loads them instead of importing vLLM
itself (16-22 s of the rehearsal's chain on an H100).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import threading
import time
from pathlib import Path

from eyrie.core.io import write_json
from eyrie.preflight.vllm_env import facts_for, resolve_python
from eyrie.vllm import fatbin
from eyrie.vllm.quantization import quantization_config

log = logging.getLogger(__name__)

# the weight types of vLLM's Marlin kernels by (bits, symmetric): GPTQ-style symmetric ints carry a
# bias (uint4b8: 4-bit values minus 8), asymmetric ones a zero point beside them (uint4)
WEIGHT_TYPES = {(4, True): "uint4b8", (4, False): "uint4", (8, True): "uint8b128"}
ACTIVATIONS = {"bfloat16": "bfloat16", "float16": "float16"}


def marlin_types(config: dict) -> tuple[str, str] | str:
    """(activation, weight) ScalarType names of the Marlin kernels a target of this config.json
    runs in vLLM (weight-only int4/int8: compressed-tensors, GPTQ, AWQ), else why none."""
    where, q = quantization_config(config)
    if not q:
        return "the target is not quantized"
    text = config.get("text_config") or config
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype")
    method = q.get("quant_method")
    if method == "compressed-tensors":
        groups = list((q.get("config_groups") or {}).values())
        if not groups or any(g.get("input_activations") for g in groups):
            return f"{where}: not a weight-only scheme"
        weights = groups[0].get("weights") or {}
        if weights.get("type") != "int":
            return f"{where}: {weights.get('type')} weights"
        bits, symmetric = weights.get("num_bits"), weights.get("symmetric", True)
    elif method in ("gptq", "awq"):
        bits = q.get("bits") or q.get("w_bit")
        symmetric = method == "gptq" and q.get("sym", True)
    else:
        return f"{where}: quant_method {method!r}"
    weight, act = WEIGHT_TYPES.get((bits, bool(symmetric))), ACTIVATIONS.get(str(dtype))
    if weight is None or act is None:
        return f"{where}: {bits}-bit weights with {dtype} activations"
    return act, weight


def is_moe(config: dict) -> bool:
    text = config.get("text_config") or config
    return any(text.get(k) for k in ("n_routed_experts", "num_experts", "num_local_experts"))


def scalar_types(root: Path):
    """vLLM's `scalar_types` (the ids its kernels' names carry), read from `root`/scalar_type.py
    alone: that module needs only the standard library (vLLM 0.22-0.34), while importing the
    vllm package first takes 6-10 s the compilation, on the way to the extraction engine, would
    wait for. A vLLM whose module needs more is imported as usual."""
    name = "eyrie_vllm_scalar_type"
    try:
        spec = importlib.util.spec_from_file_location(name, root / "scalar_type.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up by name
        spec.loader.exec_module(module)
        return module.scalar_types
    except Exception:  # another layout or imports of its own: the package's way
        from vllm.scalar_type import scalar_types as types

        return types
    finally:
        sys.modules.pop(name, None)


def chosen_units(root: Path, arch: int, config: dict) -> tuple[list[dict], str]:
    """The units of vLLM at `root` (PTX only on an sm_`arch` GPU) whose Marlin kernels the target
    runs: its MoE kernels (namespace marlin_moe_*) for a mixture of experts, else the dense ones;
    and what was chosen, in words."""
    types = marlin_types(config)
    if isinstance(types, str):
        return [], f"no Marlin kernel: {types}"
    known = scalar_types(root)
    ids = [getattr(known, name).id for name in types]
    moe = is_moe(config)
    chosen = []
    for unit in fatbin.pending(root, arch):
        names = fatbin.kernel_names(unit["lib"], unit)
        family = fatbin.namespaces(names[0]) if names else []
        if family[-1:] != ["Marlin"] or ("moe" in family[0]) != moe:
            continue
        if fatbin.template_ids(names[0])[:2] == ids:
            chosen.append({**unit, "label": fatbin.label(names, dict(zip(ids, types)))})
    return chosen, f"{'MoE' if moe else 'dense'} Marlin kernels for {types[0]} x {types[1]}"


def compile_kernels(target: str | Path, python: str | None = None) -> dict:
    """Compile the target's PTX-only kernels into the driver's cache, reading the vLLM facts of
    `python` (the vLLM environment's, as the rules name it) beside it; what was done."""
    config = json.loads((Path(target) / "config.json").read_text())
    facts = FactsReader(python, config)
    done = compile_units(config)
    done["facts"] = facts.result()
    return done


def compile_units(config: dict) -> dict:
    root, cache = fatbin.vllm_root(), fatbin.cache_folder()
    if root is None or cache is None or not Path("/dev/nvidiactl").exists():
        why = "no vLLM" if root is None else "no driver cache" if cache is None else "no GPU"
        return {"compiled": [], "why": f"nothing to compile: {why} here"}
    arch = fatbin.Driver().arch()
    units, chosen = chosen_units(root, arch, config)
    done = {"arch": arch, "cache": str(cache), "why": chosen, "compiled": []}
    start = time.perf_counter()
    with fatbin.compilation_lock(exclusive=True):
        seconds = fatbin.compile_units(units, len(units)) if units else []
    for unit, s in zip(units, seconds, strict=True):
        lib = str(Path(unit["lib"]).relative_to(root.parent))
        done["compiled"].append(
            {
                "lib": lib,
                "kernels": unit["label"],
                "ptx_mb": round(unit["ptx_bytes"] / 1e6, 1),
                "s": round(s, 1),
                "from_cache": s < 0.5,
            }
        )
    done["wall_s"] = round(time.perf_counter() - start, 1)
    return done


class FactsReader:
    """preflight's facts probe for `config`, started now on a thread (the child does the work);
    `result()` waits for it and says what happened. Its failure is preflight's to report."""

    def __init__(self, python: str | None, config: dict):
        self.outcome: dict = {"read": False, "why": "no --python given"}
        self.thread = threading.Thread(target=self._read, args=(python, config), daemon=True)
        if python:
            self.thread.start()

    def _read(self, python: str, config: dict) -> None:
        start = time.perf_counter()
        try:
            got = facts_for(resolve_python(python), [config])[0]
        except Exception as exc:  # preflight reads them again and says why, with the fix
            self.outcome = {"read": False, "why": f"{type(exc).__name__}: {exc}"}
            return
        why = got.get("error") or f"vLLM {got.get('version')}, kept for preflight"
        self.outcome = {"read": "error" not in got, "why": why}
        self.outcome["s"] = round(time.perf_counter() - start, 1)

    def result(self) -> dict:
        if self.thread.ident is not None:  # started
            self.thread.join()
        return self.outcome


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="the target folder (its config.json)")
    parser.add_argument("--out", required=True, help="kernels.json: what was compiled")
    parser.add_argument(
        "--python",
        help="the vLLM environment's Python as vllm.python names it: its facts for the target are "
        "read into cache.path beside the compilation, for preflight",
    )


def run(args: argparse.Namespace) -> int:
    done = compile_kernels(args.target, args.python)
    log.info(
        "compile-kernels: vLLM facts: %s; %s; %s",
        done["facts"]["why"],
        done["why"],
        ", ".join(
            f"{u['kernels']} ({u['ptx_mb']} MB of PTX) in {u['s']} s" for u in done["compiled"]
        )
        or "none compiled",
    )
    write_json(args.out, done)
    return 0
