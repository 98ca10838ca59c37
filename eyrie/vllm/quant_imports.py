"""Which third-party packages vLLM's quantization code imports, and when, read from its import
statements (ast) without running them.

`imported_packages` follows the imports of get_quantization_config and of a method's config class
through vLLM's quantization package, with `current_platform.is_*()` answered as on a CUDA GPU: a
package imported at module level (unguarded or in a CUDA branch) is required; one under try/except
ImportError or another condition, checked with vLLM's has_<package>(), or imported inside a
function is optional. Runs in the vLLM environment (standard library only); used by
eyrie.vllm.quantization.required_packages.
"""

from __future__ import annotations

import ast
import functools
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
