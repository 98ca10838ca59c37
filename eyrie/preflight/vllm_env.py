"""Preflight's vLLM environment: the Python at vllm.python, asked for the installed vLLM's facts.

`facts_for` runs `python -m eyrie.preflight.gather` there (one subprocess for every config not
asked before, cached per process); `VllmEnvError` says why that environment cannot answer, with
the fix. See docs/vllm.md (What preflight checks).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from eyrie.config.sections import VllmSettings
from eyrie.core.errors import EyrieError

FACTS_TIMEOUT_S = 120.0  # far above what `import vllm` takes on a small machine: past it, it hangs


SETUP_FIX = (
    "run bash scripts/setup-vllm.sh or set vllm.python to the Python of an environment "
    "with vLLM and eyrie"
)


REPO = Path(__file__).resolve().parents[2]


# facts per (vLLM python, config.json content), so a process asks each environment once per config
_FACTS_CACHE: dict[tuple[str, str], dict] = {}


class VllmEnvError(EyrieError):
    """The vLLM environment could not answer (message names vllm.python and the fix)."""


def resolve_python(python: str) -> Path:
    """The vLLM environment's Python: a relative vllm.python is relative to the eyrie checkout
    (the workflow's base directory, where scripts/setup-vllm.sh puts .venv-vllm), as the rules
    read it."""
    p = Path(python).expanduser()
    return p if p.is_absolute() else REPO / p


def run_gatherer(python: Path, configs: list[dict], timeout: float = FACTS_TIMEOUT_S) -> list[dict]:
    """Run `python -m eyrie.preflight.gather` once for all `configs`; one JSON object each
    (facts, or {"error": ...} for a model_type without adapter). Raises VllmEnvError when it
    cannot answer."""
    with tempfile.TemporaryDirectory(prefix="eyrie-vllm-facts-") as tmp:
        args = []
        for i, config in enumerate(configs):
            path = Path(tmp) / f"config_{i}.json"
            path.write_text(json.dumps(config))
            args += ["--config", str(path)]
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
        env.pop("PYTHONPATH", None)  # the training environment's paths must not leak into vLLM's
        try:
            # cwd: an empty folder, so that the eyrie installed in the vLLM environment is imported
            proc = subprocess.run(
                [str(python), "-m", "eyrie.preflight.gather", *args],
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise VllmEnvError(
                f"vllm.python={python}: reading the installed vLLM's facts took more "
                f"than {timeout:.0f} s (does `import vllm` hang?); check that "
                f"environment or {SETUP_FIX}"
            ) from None
        except OSError as exc:
            raise VllmEnvError(
                f"vllm.python={python}: cannot run it ({type(exc).__name__}: {exc}); {SETUP_FIX}"
            ) from None
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        last = lines[-1].strip() if lines else f"exit status {proc.returncode}, no output"
        raise VllmEnvError(
            f"vllm.python={python}: `python -m eyrie.preflight.gather` failed ({last}); {SETUP_FIX}"
        )
    out = []
    for line in proc.stdout.splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue  # anything vLLM prints on stdout at import
        if isinstance(obj, dict) and ("version" in obj or "error" in obj):
            out.append(obj)
    if len(out) != len(configs):
        raise VllmEnvError(
            f"vllm.python={python}: expected {len(configs)} facts line(s) from "
            f"eyrie.preflight.gather, got {len(out)}; {SETUP_FIX}"
        )
    return out


def facts_for(python: Path, configs: list[dict], timeout: float = FACTS_TIMEOUT_S) -> list[dict]:
    """Facts (JSON objects) for each config from the environment of `python`, cached per process
    and config: configs asked for before are not asked again, the others in ONE subprocess. The
    whole config.json goes: vLLM's own config classes parse it there (facts.parse_config)."""
    keys = [(str(python), json.dumps(c, sort_keys=True)) for c in configs]
    todo = sorted({k: i for i, k in enumerate(keys) if k not in _FACTS_CACHE}.values())
    if todo:
        for i, got in zip(todo, run_gatherer(python, [configs[i] for i in todo], timeout)):
            _FACTS_CACHE[keys[i]] = got
    return [dict(_FACTS_CACHE[k]) for k in keys]


def vllm_python(v: VllmSettings) -> Path:
    """The Python of the vLLM environment a `vllm` section names; VllmEnvError when that is not
    an executable file."""
    python = resolve_python(v.python)
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise VllmEnvError(
            f"vllm.python={v.python!r}: no vLLM environment there ({python} "
            f"is not an executable file); {SETUP_FIX}"
        )
    return python
