"""Which packages the target's quantization method imports on a GPU, read on a CPU from vLLM's code.

Some of vLLM's quantization imports run only on a GPU, so a CPU `import vllm` succeeds without
them: vLLM 0.22's get_quantization_config imports quantization/humming.py for every method, and
that module imports `humming` (pip package humming-kernels) under `if current_platform.is_cuda():`.

`required_packages` parses (ast) the modules of vLLM's quantization package that
get_quantization_config and the method's config class import, with `current_platform.is_*()`
answered as on a CUDA GPU, and looks each third-party package up with importlib.util.find_spec.
One imported at module level (unguarded or in a CUDA branch) is required; one under try/except
ImportError or another condition, checked with vLLM's has_<package>(), or imported inside a
function is optional: reported, not a problem. `parse_quantization` parses the
quantization_config with the method's own config class, as vLLM's weight loading does, so a
malformed one fails on a CPU; `parse_problem` is preflight's line for it. Runs in the vLLM
environment (standard library; vllm imported inside the functions). See docs/vllm.md (What
preflight checks).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import json
import re
import sys
from collections import deque
from pathlib import Path

QUANT_PACKAGE = "vllm.model_executor.layers.quantization"

# the vLLM modules read: the quantization package, where every method's config class, its
# schemes and their GPU-only imports live. The kernels it imports from elsewhere
# (vllm.model_executor.layers.fused_moe, vllm.model_executor.kernels) are left out: ~2x the
# source to parse (seconds) for optional packages only (deep_gemm, aiter, ...) in 0.22-0.33
SCOPE = (QUANT_PACKAGE,)

# vLLM's helpers that say whether an optional package is there (has_humming() -> "humming")
IMPORT_UTILS = "vllm.utils.import_utils"

# import name -> pip package where they differ and the package may be missing (installed ones are
# found through importlib.metadata; vLLM's Requires-Dist names the others by their pip names)
PIP_NAMES = {"humming": "humming-kernels"}

# what vLLM's current_platform.is_*() answers on the GPU node (a CUDA GPU)
CUDA_PLATFORM = {"is_cuda": True, "is_cuda_alike": True} | dict.fromkeys(
    ("is_rocm", "is_xpu", "is_cpu", "is_tpu", "is_out_of_tree", "is_unspecified"), False
)

# when an import statement runs, most certain first: at module import, at module import on a CUDA
# GPU only, after vLLM checks for the package (has_<package>()), under another guard, inside a
# function; the first two make a package required
KINDS = ("import", "cuda", "checked", "guarded", "call")
WHEN = {
    "import": "at module import",
    "cuda": "at module import on a CUDA GPU",
    "checked": "after checking for it with vLLM's has_<package>() (vllm.utils.import_utils)",
    "guarded": "under try/except ImportError or a condition other than the platform",
    "call": "inside a function, by the code paths that call it",
}

IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


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


def imported_packages(
    root: Path, get_config, cls: type
) -> tuple[dict[str, tuple[str, list[str]]], int]:
    """({top-level package: (most certain kind, the chain of vLLM modules to it)}, modules read),
    from the import statements in vLLM's get_quantization_config (`get_config`; they run for every
    method) and the config class's module on."""
    module = get_config.__module__
    path = module_file(root, module)
    if path is None:
        raise LookupError(f"no source file for {module}")
    function = next(
        (
            n
            for n in ast.parse(path.read_text(), str(path)).body
            if isinstance(n, ast.FunctionDef) and n.name == get_config.__name__
        ),
        None,
    )
    if function is None:
        raise LookupError(f"{get_config.__name__} is not defined at the top of {path}")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    seeds = [*_walk(function.body, package, "import"), (cls.__module__, "import")]
    todo = deque((target, kind, ["get_quantization_config"]) for target, kind in seeds)
    found: dict[str, tuple[str, list[str]]] = {}
    seen: dict[str, str] = {}  # module -> the most certain kind it was reached with
    read = set()
    while todo:
        module, ctx, chain = todo.popleft()  # breadth first: the shortest chain is kept
        if module in seen and rank(seen[module]) <= rank(ctx):
            continue
        seen[module] = ctx
        if not module.startswith(SCOPE) or module_file(root, module) is None:
            continue
        read.add(module)
        chain = [*chain, module]
        for target, kind in module_imports(root, module):
            kind = weaker(ctx, kind)
            top = target.split(".")[0]
            if top == "vllm":
                todo += [(m, kind, chain) for m in with_parents(root, target)]
            elif is_third_party(top) and (top not in found or rank(kind) < rank(found[top][0])):
                found[top] = (kind, chain)
    return found, len(read)


@functools.cache
def module_imports(root: Path, module: str) -> list[tuple[str, str]]:
    """(imported module, kind) for the import statements of vLLM module `module`, and
    (package, "checked") for each package it checks for with a has_<x>() helper (cached: the
    configs of one gatherer run share them)."""
    path = module_file(root, module)
    text = path.read_text()
    tree = ast.parse(text, str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = list(_walk(tree.body, package, "import"))
    has = has_helpers(root)
    if any(helper in text for helper in has):  # walking every tree would cost seconds
        out += [(name, "checked") for name in _has_calls(tree, has)]
    return out


@functools.cache
def has_helpers(root: Path) -> dict[str, list[str]]:
    """vLLM's has_<x>() helpers (vllm/utils/import_utils.py) -> the packages each looks for."""
    path = module_file(root, IMPORT_UTILS)
    out: dict[str, list[str]] = {}
    if path is None:
        return out
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("has_"):
            names = [
                c.args[0].value.split(".")[0]
                for c in ast.walk(node)
                if isinstance(c, ast.Call)
                and getattr(c.func, "id", getattr(c.func, "attr", None)) == "_has_module"
                and c.args
                and isinstance(c.args[0], ast.Constant)
                and isinstance(c.args[0].value, str)
            ]
            names = [n for n in names if is_third_party(n)]
            if names:
                out[node.name] = names
    return out


def _has_calls(tree: ast.Module, has: dict[str, list[str]]) -> list[str]:
    """The packages a module checks for with vLLM's has_<x>() helpers."""
    return [
        name
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for name in has.get(getattr(node.func, "id", getattr(node.func, "attr", None)), [])
    ]


def rank(kind: str) -> int:
    return KINDS.index(kind)


def weaker(a: str, b: str) -> str:
    return KINDS[max(rank(a), rank(b))]


def with_parents(root: Path, name: str) -> list[str]:
    """`name` and the packages above it (importing a.b.c imports a and a.b) that are modules."""
    parts = name.split(".")
    return [
        ".".join(parts[:i])
        for i in range(1, len(parts) + 1)
        if module_file(root, ".".join(parts[:i]))
    ]


@functools.cache
def module_file(root: Path, name: str) -> Path | None:
    """The source file of vLLM module `name` (None: not a vLLM module with Python source)."""
    parts = name.split(".")
    if parts[0] != "vllm":
        return None
    base = root.joinpath(*parts[1:])
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def is_third_party(top: str) -> bool:
    """Neither vLLM, torch (which `import vllm` needs), nor the standard library."""
    return top not in sys.stdlib_module_names and top not in ("__future__", "vllm", "torch")


def _walk(body: list, package: str, kind: str):
    """(imported module, kind) for the import statements in `body`; from-imports also yield
    package.name for each name (module_file tells whether it is a submodule)."""
    for node in body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, kind
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            if base is not None:
                yield base, kind
                yield from ((f"{base}.{a.name}", kind) for a in node.names if a.name != "*")
        elif isinstance(node, ast.If):
            value = _condition(node.test)
            if value == "typing":  # if TYPE_CHECKING: annotations only
                yield from _walk(node.orelse, package, kind)
            elif isinstance(value, bool):
                branch = node.body if value else node.orelse
                yield from _walk(branch, package, weaker(kind, "cuda"))
            else:
                yield from _walk(node.body + node.orelse, package, weaker(kind, "guarded"))
        elif isinstance(node, ast.Try):
            guarded = any(_catches_import_error(h) for h in node.handlers)
            inner = weaker(kind, "guarded") if guarded else kind
            yield from _walk(node.body + node.orelse, package, inner)
            for handler in node.handlers:
                yield from _walk(handler.body, package, weaker(kind, "guarded"))
            yield from _walk(node.finalbody, package, kind)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _walk(node.body, package, "call")
        elif isinstance(node, (ast.ClassDef, ast.With, ast.AsyncWith, ast.For, ast.While)):
            yield from _walk(node.body, package, kind)


def _absolute(node: ast.ImportFrom, package: str) -> str | None:
    """The absolute module of a (relative) from-import in `package`."""
    if not node.level:
        return node.module
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        return None
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def _condition(test: ast.expr):
    """True/False for a condition on current_platform.is_*() as on a CUDA GPU, "typing" for
    TYPE_CHECKING, None for anything else."""
    if getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING":
        return "typing"
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Attribute) and not test.args:
        owner = test.func.value
        if getattr(owner, "id", getattr(owner, "attr", None)) == "current_platform":
            return CUDA_PLATFORM.get(test.func.attr)
        return None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        value = _condition(test.operand)
        return (not value) if isinstance(value, bool) else None
    if isinstance(test, ast.BoolOp):
        values = [_condition(v) for v in test.values]
        decisive = isinstance(test.op, ast.Or)  # True decides an `or`, False an `and`
        if decisive in values:
            return decisive
        return (not decisive) if all(v is (not decisive) for v in values) else None
    return None


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(getattr(t, "id", getattr(t, "attr", None)) in IMPORT_ERRORS for t in types)


def missing_packages(key: str, packages: dict, version: str) -> list[str]:
    """One line per module of `packages` (required_packages's answer) that the method needs (not
    optional) and the vLLM environment cannot import: the module, its pip package, which vLLM
    module imports it and when, and the fix. `key` names the config key in the message."""
    out = []
    for name, m in sorted((packages.get("modules") or {}).items()):
        if m["importable"] or m["optional"]:
            continue
        package = m["package"]
        what = f"the module {name!r}" + (f" (pip package {package})" if package else "")
        by = f" ({m['imported_by'][-1]} imports it {m['when']})" if m["imported_by"] else ""
        install = (
            f"pip install '{m['requirement'] or package}'"
            if package
            else f"pip install the package that provides {name!r}"
        )
        out.append(
            f"{key}: vLLM {version} needs {what}, which the vLLM environment at "
            f"{packages['python']} cannot import{by}; install it there ({install}) or re-run "
            "bash scripts/setup-vllm.sh"
        )
    return out


def describe(name: str, kind: str, chain: list[str]) -> dict:
    """One top-level module: importable here, its pip package, the version vLLM requires, whether
    it is optional, and the chain of vLLM modules that imports it."""
    try:
        importable = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a finder that refuses it, a broken package
        importable = False
    package = pip_package(name)
    requirement, spec = vllm_requirement(package) if package else (None, None)
    return {
        "importable": importable,
        "package": package,
        "required": spec,
        "requirement": requirement,
        "optional": kind not in ("import", "cuda"),
        "when": WHEN[kind],
        "imported_by": chain,
    }


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def _distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # reads every RECORD: ~1 s


def pip_package(name: str) -> str | None:
    """The pip package of import name `name` (None: unknown): the installed distribution of that
    name, vLLM's requirement of that name, PIP_NAMES, else the installed distribution that
    provides it."""
    try:
        return importlib.metadata.distribution(name).metadata["Name"]
    except importlib.metadata.PackageNotFoundError:
        pass
    same = [req for req, _, _ in vllm_requires() if _normal(req) == _normal(name)]
    if same or name in PIP_NAMES:
        return same[0] if same else PIP_NAMES[name]
    dists = _distributions().get(name)
    return dists[0] if dists else None


@functools.cache
def vllm_requires() -> list[tuple[str, str, str | None]]:
    """(name, requirement without its marker, version spec) of vLLM's Requires-Dist, leaving out
    those of its extras."""
    out = []
    for line in importlib.metadata.requires("vllm") or []:
        req, _, marker = line.partition(";")
        if re.search(r"\bextra\s*==", marker):
            continue
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*\(?([^)]*)\)?", req)
        if m:
            out.append((m[1], req.strip(), m[3].strip() or None))
    return out


def vllm_requirement(package: str) -> tuple[str | None, str | None]:
    """(vLLM's requirement of `package` as written, its version spec); (None, None): none."""
    for name, req, spec in vllm_requires():
        if _normal(name) == _normal(package):
            return req, spec
    return None, None


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
