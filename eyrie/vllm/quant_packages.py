"""A third-party package as the vLLM environment has it: importable or not, its pip package, the
version vLLM's Requires-Dist asks for (importlib.metadata), and `missing_packages`, preflight's
line for each required one it cannot import. Runs in the vLLM environment (standard library only).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re

from eyrie.vllm.quant_imports import WHEN

# import name -> pip package where they differ and the package may be missing (installed ones are
# found through importlib.metadata; vLLM's Requires-Dist names the others by their pip names)
PIP_NAMES = {"humming": "humming-kernels"}


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
