"""Import boundaries of the eyrie package, read statically (ast) from every module, imports inside
functions included:

- an entry module (a stage of eyrie/cli.py's STAGES, or a module run by `python -m`) is imported
  by no eyrie module: entries are leaves, only the dispatcher reaches them, by name;
- the library folders (LIBRARY, in order: core < arch < formats < store < chat < config < vllm)
  import no stage folder, and none imports a folder after it in that order (imports inside
  functions and under TYPE_CHECKING included): the imports between folders point one way, down;
- no module that runs in the vLLM environment (VLLM_ENV: eyrie.vllm, the stages the rules run
  with vllm.python, the modules vLLM loads by name) reaches eyrie.train code;
- the shard client (`eyrie extract`) and the extraction engine start without torch, numpy, h5py,
  pyarrow or transformers; the engine's module-level imports reach only the standard library;
- module-level imports between eyrie modules, those under TYPE_CHECKING, and the modules a table
  names for import by name (extract.backend's BACKENDS), form no cycle.

and the layout of the tests: every folder of the package has its test folder, tests/<folder>/.

A failure names the importing file and line of each offending import.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO

PACKAGE = REPO / "eyrie"
DISPATCHERS = {"eyrie.cli", "eyrie.__main__"}  # they reach the entries by name (STAGES)
HEAVY = ("torch", "numpy", "h5py", "pyarrow", "transformers")
LIGHT_CLIENTS = ("eyrie.extract.extract", "eyrie.extract.engine")
STDLIB_ONLY = "eyrie.extract.engine"  # binds its socket before torch is imported


@dataclass(frozen=True)
class Import:
    """One import statement's edge: `source` imports `target` at `path:line`."""

    source: str
    target: str
    path: str
    line: int
    module_level: bool  # runs when `source` is imported (not in a function, not TYPE_CHECKING)
    by_name: bool = False  # named in a table of modules imported when asked ("eyrie.x:Class")
    typing_only: bool = False  # under `if TYPE_CHECKING:` (outside any function)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} imports {self.target}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def eyrie_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = eyrie_modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, in_function: bool = False, typing_only: bool = False):
    """(node, in_function, typing_only) for every node under `node`: whether it is inside a
    function (runs when called) or under `if TYPE_CHECKING:` (read by type checkers only)."""
    for child in ast.iter_child_nodes(node):
        func = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        typing = typing_only or _is_type_checking(child)
        yield child, func, typing
        yield from _walk(child, func, typing)


def _absolute(source: str, node: ast.ImportFrom) -> str:
    """The absolute module of a `from X import ...`, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = source.split(".")
    if MODULES[source].name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(source: str, node: ast.AST) -> list[str]:
    """Modules an import node imports: a `from pkg import name` is pkg.name when that is a
    module; `importlib.import_module("literal")` counts as an import of the literal."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _absolute(source, node)
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
        return subs if len(subs) == len(node.names) else [base, *subs]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, (ast.Attribute, ast.Name))
        and getattr(node.func, "attr", getattr(node.func, "id", None))
        in ("import_module", "__import__")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def _by_name(tree: ast.Module) -> list[tuple[str, int]]:
    """(module, line) of each "eyrie.x" or "eyrie.x:attr" string in a module that imports by
    name (importlib.import_module): a table of modules it imports when asked."""
    if not any(isinstance(n, ast.Attribute) and n.attr == "import_module" for n in ast.walk(tree)):
        return []
    return [
        (node.value.split(":")[0], node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.split(":")[0] in MODULES
    ]


def imports_of(source: str) -> list[Import]:
    path = str(MODULES[source].relative_to(REPO))
    edges = [
        Import(source, target, path, node.lineno, not func and not typing, typing_only=typing)
        for node, func, typing in _walk(TREES[source])
        for target in _targets(source, node)
    ]
    named = [Import(source, t, path, line, False, True) for t, line in _by_name(TREES[source])]
    return edges + named


IMPORTS = [edge for name in MODULES for edge in imports_of(name)]


def _parents(module: str) -> list[str]:
    """The packages whose __init__ runs before `module` (eyrie.a.b: eyrie, eyrie.a)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def closure(start: str, module_level_only: bool = False) -> dict[str, Import | None]:
    """Every module (eyrie or not) that importing `start` can reach through eyrie modules,
    mapped to the import that first reached it (or its submodule; None for `start`'s own
    packages)."""
    reached: dict[str, Import | None] = {start: None}
    queue = [start]
    while queue:
        module = queue.pop(0)
        for parent in _parents(module):
            if parent in MODULES and parent not in reached:
                reached[parent] = reached[module]  # imported along with `module`
                queue.append(parent)
        for edge in IMPORTS:
            if edge.source != module or (module_level_only and not edge.module_level):
                continue
            if edge.target not in reached:
                reached[edge.target] = edge
                if edge.target in MODULES:
                    queue.append(edge.target)
    return reached


def chain(reached: dict[str, Import | None], module: str) -> str:
    """The imports that lead from the closure's start to `module`, one per line."""
    steps = []
    while (edge := reached.get(module)) is not None:
        steps.append(str(edge))
        module = edge.source
    return "\n    ".join(reversed(steps))


def stages() -> dict[str, str]:
    """eyrie/cli.py's STAGES, read without importing it: stage -> entry module."""
    for node in TREES["eyrie.cli"].body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "STAGES" for t in node.targets
        ):
            return {stage: spec[0] for stage, spec in ast.literal_eval(node.value).items()}
    raise AssertionError("eyrie/cli.py: no STAGES table")


def _main_guarded(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        and any(
            isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators
        )
        for node in tree.body
    )


def _run_with_m() -> set[str]:
    """Eyrie modules some module runs as `python -m <module>` (a "-m" literal, then its name)."""
    found = set()
    for tree in TREES.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.List, ast.Tuple)):
                for a, b in zip(node.elts, node.elts[1:]):
                    if (
                        isinstance(a, ast.Constant)
                        and a.value == "-m"
                        and isinstance(b, ast.Constant)
                        and b.value in MODULES
                    ):
                        found.add(b.value)
    return found


def entry_modules() -> set[str]:
    guarded = {name for name, tree in TREES.items() if _main_guarded(tree)}
    return (set(stages().values()) | guarded | _run_with_m()) - DISPATCHERS


def fail_if(bad: list[str], header: str) -> None:
    """Fail listing each offending import (no assertion rewriting around the list)."""
    if bad:
        pytest.fail(header + "\n  " + "\n  ".join(bad), pytrace=False)


def test_stages_name_existing_modules():
    missing = [f"{stage}: {m}" for stage, m in stages().items() if m not in MODULES]
    fail_if(missing, "eyrie/cli.py STAGES names modules that do not exist:")


def test_entry_modules_are_imported_by_no_eyrie_module():
    entries = entry_modules()
    assert {"eyrie.preflight.gather", "eyrie.evaluate.vllm_eval"} <= entries, sorted(entries)
    bad = [
        str(edge)
        for edge in IMPORTS
        if edge.target in entries and edge.source not in DISPATCHERS and edge.target != edge.source
    ]
    fail_if(bad, "entry modules are leaves: move what these imports need into a library module:")


def test_every_package_folder_has_its_test_folder():
    """tests/ mirrors eyrie/: the tests of eyrie/<folder> live in tests/<folder>/ (a package, as
    every test folder is, with at least one test module)."""
    tests = REPO / "tests"
    missing = [
        f"eyrie/{p.name}: no tests/{p.name}/ with __init__.py and a test_*.py"
        for p in sorted(PACKAGE.iterdir())
        if p.is_dir()
        and p.name != "__pycache__"
        and not (
            (tests / p.name / "__init__.py").is_file() and any((tests / p.name).glob("test_*.py"))
        )
    ]
    fail_if(missing, "package folders without their test folder:")


# the library folders, each importing only the ones before it (and itself)
LIBRARY = ("core", "arch", "formats", "store", "chat", "config", "vllm")
STAGE_FOLDERS = (
    "data",
    "demo",
    "regenerate",
    "preflight",
    "extract",
    "train",
    "export",
    "evaluate",
)


def folder(module: str) -> str:
    """The folder of eyrie.<folder>.<module> ('' for eyrie itself and its top-level modules)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LIBRARY) else ""


def test_library_folders_import_no_stage_folder():
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        *LIBRARY,
        *STAGE_FOLDERS,
    }
    bad = [
        str(edge)
        for edge in IMPORTS
        if folder(edge.source) in LIBRARY
        and edge.target.startswith("eyrie.")
        and folder(edge.target) in STAGE_FOLDERS
    ]
    fail_if(bad, "library folders import stage folders (move the shared code down):")


# stages the rules run with vllm.python (rules/*.smk), and what runs inside vLLM's processes: the
# facts gatherer (`python -m`) and the capture worker extension (named in LLM(...))
VLLM_STAGES = ("regenerate-vllm", "extract-engine", "evaluate-vllm", "compile-kernels")
VLLM_ENV = sorted(
    {m for m in MODULES if m.startswith("eyrie.vllm.")}
    | {stages()[s] for s in VLLM_STAGES}
    | {"eyrie.preflight.gather", "eyrie.extract.capture", "eyrie.extract.vllm_backend"}
)


def test_vllm_stages_are_the_ones_the_rules_run_with_vllm_python():
    rules = "".join(p.read_text() for p in sorted((REPO / "rules").glob("*.smk")))
    ran = set(re.findall(r"VLLM_PYTHON_ARG\} -m eyrie\.cli ([a-z-]+)", rules))
    ran |= set(re.findall(r"\{params\.python\} -m eyrie\.cli ([a-z-]+)", rules))
    assert ran == set(VLLM_STAGES), sorted(ran)


@pytest.mark.parametrize("module", VLLM_ENV)
def test_vllm_environment_reaches_no_training_code(module):
    reached = closure(module)
    bad = [
        f"{m}, through:\n    {chain(reached, m)}"
        for m in reached
        if m == "eyrie.train" or m.startswith("eyrie.train.")
    ]
    fail_if(bad, f"{module} reaches training code (it runs in the vLLM environment):")


# Run in the child: records, for the first import of each heavy package, the eyrie lines on the
# stack (the eyrie imports that pulled it in), then imports the module under test.
PROBE = r"""
import sys, traceback
HEAVY, ROOT = {heavy!r}, {root!r}
seen = {{}}
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name in HEAVY and name not in seen:
            seen[name] = [f"{{f.filename[len(ROOT):]}}:{{f.lineno}}: {{f.line}}"
                          for f in traceback.extract_stack() if f.filename.startswith(ROOT)]
        return None
sys.meta_path.insert(0, Spy())
import {module}
for name in HEAVY:
    if name in sys.modules:
        print(name + ", through:\n    " + "\n    ".join(seen.get(name, ["?"])))
"""


@pytest.mark.parametrize("module", LIGHT_CLIENTS)
def test_extraction_clients_start_without_heavy_packages(module):
    probe = PROBE.format(heavy=HEAVY, root=str(PACKAGE.parent) + "/", module=module)
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    bad = re.split(r"\n(?! )", proc.stdout.strip()) if proc.stdout.strip() else []
    fail_if(bad, f"`import {module}` imports heavy packages (import them where they are used):")


def test_engine_imports_only_the_standard_library_at_module_level():
    reached = closure(STDLIB_ONLY, module_level_only=True)
    bad = [
        f"{m}, through:\n    {chain(reached, m)}"
        for m in reached
        if m.split(".")[0] not in ("eyrie", *sys.stdlib_module_names)
    ]
    fail_if(bad, f"{STDLIB_ONLY} imports only the standard library at module level:")


def _cycle_from(start: str, graph: dict[str, list[Import]]) -> list[Import] | None:
    """A cycle through `start` (depth-first over module-level eyrie imports), or None."""
    stack: list[tuple[str, list[Import]]] = [(start, [])]
    visited: set[str] = set()
    while stack:
        module, path = stack.pop()
        for edge in graph.get(module, []):
            if edge.target == start:
                return [*path, edge]
            if edge.target not in visited:
                visited.add(edge.target)
                stack.append((edge.target, [*path, edge]))
    return None


def test_library_folders_import_only_the_folders_before_them():
    rank = {name: i for i, name in enumerate(LIBRARY)}
    bad = [
        f"{edge} ({folder(edge.source)} is before {folder(edge.target)} in {' < '.join(LIBRARY)})"
        for edge in IMPORTS
        if edge.target.startswith("eyrie.")
        and folder(edge.source) in rank
        and folder(edge.target) in rank
        and rank[folder(edge.target)] > rank[folder(edge.source)]
    ]
    fail_if(bad, "library folders import a folder after them (move the shared code down):")


def test_no_import_cycles_between_eyrie_modules():
    graph: dict[str, list[Import]] = {}
    for edge in IMPORTS:
        if (
            (edge.module_level or edge.typing_only or edge.by_name)
            and edge.target in MODULES
            and edge.target != edge.source
        ):
            graph.setdefault(edge.source, []).append(edge)
    cycles, seen = [], set()
    for module in sorted(MODULES):
        cycle = _cycle_from(module, graph)
        if cycle and frozenset(e.source for e in cycle) not in seen:
            seen.add(frozenset(e.source for e in cycle))
            cycles.append("\n    ".join(str(e) for e in cycle))
    fail_if(cycles, "import cycles between eyrie modules (module level or by name):")
