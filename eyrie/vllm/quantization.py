"""Which packages the target's quantization method imports on a GPU, read on a CPU from vLLM's code.

Some of vLLM's quantization imports run only on a GPU, so a CPU `import vllm` succeeds without
them: vLLM 0.22's get_quantization_config imports quantization/humming.py for every method, and
that module imports `humming` (pip package humming-kernels) under `if current_platform.is_cuda():`.

`required_packages` parses (ast) the modules of vLLM's quantization package that
get_quantization_config and the method's config class import, with `current_platform.is_*()`
answered as on a CUDA GPU (eyrie.vllm.quant_imports), and looks each third-party package up with
importlib.util.find_spec (eyrie.vllm.quant_packages). One imported at module level (unguarded or
in a CUDA branch) is required; one under try/except ImportError or another condition, checked
with vLLM's has_<package>(), or imported inside a function is optional: reported, not a problem
(quant_packages.missing_packages is preflight's line for a required one). `parse_quantization`
parses the quantization_config with the method's own config class, as vLLM's weight loading
does, so a malformed one fails on a CPU; `parse_problem` is preflight's line for it. Runs in the
vLLM environment (standard library; vllm imported inside the functions). See docs/vllm.md (What
preflight checks).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from eyrie.vllm.quant_imports import QUANT_PACKAGE, SCOPE, imported_packages
from eyrie.vllm.quant_packages import describe


def quantization_config(config: dict) -> tuple[str, dict | None]:
    """(where, quantization_config): text_config's for multimodal wrappers, else the top level's."""
    text = config.get("text_config") or {}
    if text.get("quantization_config"):
        return "text_config.quantization_config", text["quantization_config"]
    return "quantization_config", config.get("quantization_config") or None


def required_packages(config: dict) -> dict | None:
    """The third-party packages the config's quantization method imports in the installed vLLM
    (None: the config is not quantized); `modules` None: the list could not be established
    (`how` says why)."""
    where, q = quantization_config(config)
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    out = {"quant_method": method, "where": where, "python": sys.executable, "modules": None}
    if not method:
        return {**out, "how": "no quant_method, so no vLLM method to read"}
    from vllm.model_executor.layers import quantization

    try:
        cls = quantization.get_quantization_config(method)
    except ValueError:
        return {**out, "how": f"vLLM has no quantization method {method!r}, nothing to read"}
    except ImportError as exc:  # a package that even the CPU import needs
        top = (exc.name or "").split(".")[0]
        modules = {top: describe(top, "import", [QUANT_PACKAGE])} if top else None
        return {
            **out,
            "modules": modules,
            "how": f"get_quantization_config({method!r}) failed on this CPU: "
            f"{type(exc).__name__}: {exc}",
        }
    root = Path(quantization.__file__).resolve().parents[3]  # the vllm package's folder
    try:
        found, read = imported_packages(root, quantization.get_quantization_config, cls)
    except (OSError, SyntaxError, LookupError) as exc:  # vLLM's source moved or unreadable
        return {**out, "how": f"vLLM's quantization source not read ({type(exc).__name__}: {exc})"}
    return {
        **out,
        "modules": {name: describe(name, *found[name]) for name in sorted(found)},
        "how": f"import statements (ast) of the {read} modules of {', '.join(SCOPE)} that "
        f"get_quantization_config({method!r}) -> {cls.__name__} imports (current_platform as "
        "on a CUDA GPU), looked up with importlib.util.find_spec",
    }


def parse_quantization(config: dict, model_config=None) -> dict | None:
    """Parse the config's quantization_config with the installed vLLM's own config class, as
    weight loading does (None: not quantized, or no quant_method to pick a class by): vLLM's
    get_quant_config on `model_config` (vllm.config.ModelConfig of this config) when it could be
    built, else get_quantization_config(quant_method).from_config on the dict get_quant_config
    passes. A malformed config (a config_groups entry without `targets`) fails here on a CPU
    rather than in the GPU job after the model has loaded. `ok` None: not parsed (`how`)."""
    where, q = quantization_config(config)
    method = q.get("quant_method") if isinstance(q, dict) else None
    if not method:
        return None
    from vllm.model_executor.layers import quantization

    loaded = getattr(model_config, "quantization", None)
    out = {"where": where, "quant_method": method, "method": loaded or method, "class": None}
    out |= {"ok": None, "error": None}
    try:
        cls = quantization.get_quantization_config(out["method"])
    except ValueError:
        return {**out, "how": f"vLLM has no quantization method {out['method']!r}"}
    except ImportError as exc:  # a package the CPU import needs: required_packages reports it
        return {**out, "how": f"get_quantization_config failed here: {one_line(exc)}"}
    out["class"] = cls.__name__
    try:
        if loaded:
            from vllm.config import LoadConfig
            from vllm.model_executor.model_loader.weight_utils import get_quant_config

            how = "vLLM's get_quant_config(ModelConfig of this config.json, LoadConfig())"
            get_quant_config(model_config, LoadConfig())
        else:
            how = f"{cls.__name__}.from_config on the dict vLLM's get_quant_config passes"
            cls.from_config(loader_dict(config, q))
    except ImportError as exc:  # a GPU-only package: required_packages reports it
        return {**out, "how": f"{how}: {one_line(exc)}"}
    except Exception as exc:  # whatever vLLM raises at load is what the check reports
        return {**out, "ok": False, "error": one_line(exc), "how": how}
    return {**out, "ok": True, "how": how}


def loader_dict(config: dict, q: dict) -> dict:
    """The quantization_config dict vLLM's get_quant_config hands to from_config: compressed-
    tensors configs with config_groups get the attention head counts (TP-aware scale loading)."""
    q = json.loads(json.dumps(q))  # a copy: from_config may change it
    if q.get("quant_method") == "compressed-tensors" and "config_groups" in q:
        text = config.get("text_config") or config
        heads = text.get("num_attention_heads")
        q["total_num_heads"] = heads
        q["total_num_kv_heads"] = text.get("num_key_value_heads") or heads
    return q


def one_line(exc: BaseException, limit: int = 400) -> str:
    """`ExcType: message` on one line (pydantic's ValidationError: its first error only)."""
    text = str(exc)
    m = re.search(r"Value error, (.*?)(?: \[type=|$)", text, re.S)
    text = " ".join((m[1] if m else text).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


def parse_problem(parse: dict, q: dict, version: str) -> str:
    """The problem line for a quantization_config vLLM's class cannot parse: the key as precisely
    as the exception names it (for a KeyError, the entries of a map such as config_groups that
    lack the key) and the fix."""
    where, error = parse["where"], parse["error"]
    head = f"vLLM {version}'s {parse['class']}.from_config fails: {error}"
    fix = "as the checkpoint's publisher ships them (copy quantization_config from the original "
    fix += "config.json)"
    m = re.fullmatch(r"KeyError: '([^']+)'", error)
    key = m[1] if m else None
    for name, entries in q.items() if key else ():
        if not (isinstance(entries, dict) and entries) or not all(
            isinstance(e, dict) for e in entries.values()
        ):
            continue
        lacking = [e for e, value in entries.items() if key not in value]
        if lacking:
            at = f"{where}.{name}" + (f".{lacking[0]}" if len(lacking) == 1 else "")
            verb = "lacks" if len(lacking) == 1 else "lack"
            return (
                f"config.json: {at}: {head}; give every {name} entry the keys vLLM reads "
                f"({', '.join(lacking)} {verb} {key!r}) {fix}"
            )
    if key and key not in q:
        return f"config.json: {where}: {head}; add {key!r} and the other keys vLLM reads {fix}"
    return f"config.json: {where}: {head}; write its keys {fix}"
