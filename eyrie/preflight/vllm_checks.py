"""Preflight's vLLM part: will the installed vLLM load this target and return its hidden states?

Runs on a CPU in seconds whenever `extract.backend: vllm` or `eval.vllm: true`, before any GPU job:
the vLLM environment (`vllm.python`) answers `python -m eyrie.preflight.gather` with the installed
vLLM's facts; then the version range, the adapter against those facts, the config and its
quantization, the extraction path (chosen exactly as the backend will), tensor parallelism and
the weights' memory are checked. `vllm_checks` returns the problems (each with its fix), the
warnings and preflight.json's `vllm` object. Its parts: vllm_env (the environment and its facts),
vllm_config (the config as vLLM's own classes read it), vllm_sizing (memory, tensor parallelism).
See docs/vllm.md (What preflight checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from eyrie.arch.registry import adapter_for
from eyrie.arch.target import TargetInfo, read_config
from eyrie.config.schema import vllm_uses
from eyrie.config.sections import VllmSettings
from eyrie.core.errors import PreflightError, VllmAdapterError
from eyrie.preflight.vllm_config import config_parse_problems, quantization_check
from eyrie.preflight.vllm_env import VllmEnvError, facts_for, vllm_python
from eyrie.preflight.vllm_memory import batch_problem, misfit, predict
from eyrie.preflight.vllm_sizing import memory_check, parallel_problems
from eyrie.vllm.adapters import SUPPORTED_VLLM, TESTED_VLLM
from eyrie.vllm.checks import (
    ExtractLayers,
    choose_path,
    config_problems,
    native_problems,
    version_problems,
    version_warnings,
)
from eyrie.vllm.engine import bounds
from eyrie.vllm.facts import VllmFacts


@dataclass(frozen=True)
class VllmTarget:
    """The target the vLLM checks read: its folder, what inspect_target found there, and the
    resolved layer ids (`aux_ids` empty: they did not resolve)."""

    folder: Path
    info: TargetInfo
    aux_ids: list[int]
    final_id: int
    # the longest sequence of each engine the run starts ("extraction", "evaluation"), from the
    # tokenized data; empty: not known (preflight without a tokenize report)
    longest: dict[str, int] = field(default_factory=dict)


@dataclass
class VllmCheck:
    """One check of the vLLM checks: what they read and what they found so far."""

    target: Path
    info: TargetInfo
    config: dict  # the target's config.json
    vllm: VllmSettings
    used: list[str]  # vllm_uses(settings)
    aux_ids: list[int]  # empty: the layer ids did not resolve
    final_id: int
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    report: dict = field(default_factory=dict)


def base_report(used: list[str], tp: int) -> dict:
    """preflight.json's `vllm` object before any check fills it in."""
    return {
        "used_for": used,
        "python": None,
        "version": None,
        "supported": f"[{'.'.join(map(str, SUPPORTED_VLLM[0]))}, "
        f"{'.'.join(map(str, SUPPORTED_VLLM[1]))})",
        "tested": sorted(TESTED_VLLM),
        "adapter": None,
        "extraction_path": None,
        "quantization": None,
        "tensor_parallel_size": tp,
        "memory": None,
        "engine": {},
        "facts": None,
    }


def check_adapter(check: VllmCheck):
    """The adapter from eyrie's registry (needs no vLLM) and what it requires of the config."""
    try:
        adapter = adapter_for(check.info.model_type)
    except VllmAdapterError as exc:  # its message lists the supported model types
        check.problems.append(f"{check.target / 'config.json'}: {exc}")
        return None
    check.report["adapter"] = adapter.family
    check.problems += config_problems(adapter, check.config)
    return adapter


def installed_facts(check: VllmCheck) -> VllmFacts | None:
    """The installed vLLM's facts, asked of the environment at vllm.python."""
    try:
        python = vllm_python(check.vllm)
        check.report["python"] = str(python)
        got = facts_for(python, [check.config])[0]
    except VllmEnvError as exc:
        check.problems.append(str(exc))
        return None
    if "error" in got:
        check.problems.append(f"{check.target / 'config.json'}: {got['error']}")
        return None
    return VllmFacts.from_json(got)


def check_facts(check: VllmCheck, facts: VllmFacts) -> None:
    """The version range, and whether vLLM knows the architecture (as an EAGLE-3 target when
    evaluation runs through vLLM)."""
    check.report["version"] = facts.version
    check.report["facts"] = facts.to_json()
    check.problems += version_problems(facts)
    check.warnings += version_warnings(facts)
    if facts.engine_env_refused:  # vLLM's own check at every engine's start
        check.problems.append(
            f"vLLM {facts.version} refuses the environment its engines would start in: "
            f"{facts.engine_env_refused} (the jobs inherit the environment snakemake runs in: "
            "unset the variable there, or in the profile's env)"
        )
    config_json = check.target / "config.json"
    if facts.architecture is None:
        check.problems.append(
            f"{config_json}: no architectures entry; vLLM picks the model "
            "class from architectures[0]: add it (e.g. from the original model)"
        )
    elif facts.architecture_class is None:
        check.problems.append(
            f"{config_json}: architectures[0]={facts.architecture!r} is not "
            f"a model vLLM {facts.version} knows; use a vLLM that supports it"
        )
    elif "eval" in check.used and not facts.eagle3_target:
        check.problems.append(
            f"eval.vllm: vLLM {facts.version}'s {facts.architecture_class} cannot be an "
            "EAGLE-3 target (no set_aux_hidden_state_layers, so the draft gets no "
            "hidden states); set eval.vllm: false or use a vLLM that supports it"
        )
    if facts.architecture_class is not None:  # else reported above, and vLLM fails on it
        check.problems += config_parse_problems(check.target, check.config, facts)


PATH_RETURNS = {
    "native": "vLLM's extract_hidden_states method + ExampleHiddenStatesConnector: one "
    "safetensors file per request",
    "capture": "eyrie.extract.capture worker extension (eager): the residual stream at each id",
}


def check_extraction_path(check: VllmCheck, adapter, facts: VllmFacts) -> None:
    """The extraction path, chosen exactly as eyrie.extract.vllm_backend will choose it."""
    requested = check.vllm.extraction_path
    layer_ids = list(check.aux_ids) + [check.final_id]
    num_layers = check.info.num_hidden_layers
    layers = ExtractLayers(layer_ids, num_layers)
    path, path_problems = choose_path(requested, adapter, facts, check.config, layers)
    check.problems += path_problems
    refused = native_problems(facts, layer_ids, num_layers, check.config)
    check.report["extraction_path"] = {
        "requested": requested,
        "chosen": path,
        "layer_ids": layer_ids,
        "native_refused": refused if path != "native" else [],
        "returns": None
        if path is None
        else PATH_RETURNS["native" if path == "native" else "capture"],
    }


def vllm_checks(target: VllmTarget, settings: dict, *, facts: VllmFacts | None = None) -> dict:
    """{"problems": [...], "warnings": [...], "report": preflight.json's `vllm` object}.

    `facts`: the installed vLLM's facts; None runs `vllm.python -m eyrie.preflight.gather` for them.
    `target.aux_ids` empty means the layer ids did not resolve (reported elsewhere): no path is
    chosen.
    """
    v = VllmSettings.from_section(settings.get("vllm"), PreflightError)
    folder, info, aux_ids = target.folder, target.info, target.aux_ids
    used = vllm_uses(settings)
    check = VllmCheck(folder, info, read_config(folder), v, used, aux_ids, target.final_id)
    check.report = base_report(check.used, v.tensor_parallel_size)
    adapter = check_adapter(check)
    if facts is None and adapter is not None:
        facts = installed_facts(check)
    if facts is not None:
        check_facts(check, facts)
    if "extract" in check.used and adapter is not None and facts is not None and aux_ids:
        check_extraction_path(check, adapter, facts)
    check.report["quantization"], problems, warnings = quantization_check(check.config, facts)
    check.problems += problems
    check.warnings += warnings
    check.problems += parallel_problems(info, v.tensor_parallel_size)
    check.report["memory"], problems, warnings = memory_check(folder, check.config, v, info)
    check.problems += problems
    check.warnings += warnings
    if not problems:  # weights that do not fit are the one line to fix first
        check_engines(check, target.longest)
    return {"problems": check.problems, "warnings": check.warnings, "report": check.report}


SOURCES = {
    "extraction": "the longest tokenized sample",
    "evaluation": "the longest held-out prompt + eval.max_new_tokens + eval.num_speculative_tokens",
}


def check_engines(check: VllmCheck, longest: dict[str, int]) -> None:
    """Each engine's lengths (eyrie.vllm.engine.bounds: preflight.json's `vllm.engine`, which the
    extraction engine starts with) and the memory it will ask for (`vllm.memory.<engine>`)."""
    memory = check.report["memory"] or {}
    engines = {}
    for stage, longest_tokens in longest.items():
        engine = bounds(
            check.vllm, longest_tokens, chunked=stage != "extraction", source=SOURCES[stage]
        )
        engines[stage] = engine
        if stage == "extraction" and (line := batch_problem(stage, engine)):
            check.problems.append(line)
            continue
        if memory.get("bytes") is None:
            continue
        per_gpu = memory["bytes"] / check.vllm.tensor_parallel_size
        got = memory[stage] = predict(check.config, check.vllm, engine, per_gpu)
        if not got["fits"]:
            min_tp = memory.get("min_tensor_parallel_size")
            line = misfit(stage, engine, longest_tokens, got, check.vllm, min_tp)
            (check.warnings if memory.get("upper_bound") else check.problems).append(line)
    check.report["engine"] = engines


def verdict(report: dict) -> str:
    """One line for the log: version, adapter and the path extraction will use."""
    path = report.get("extraction_path") or {}
    text = f"vLLM {report.get('version')} ({report.get('adapter')} adapter)"
    if path.get("chosen"):
        text += f": extraction through the {path['chosen']} path"
        if path["chosen"] != "native" and path.get("native_refused"):
            text += f" (native refused: {path['native_refused'][0]})"
    if "eval" in report.get("used_for", []):
        text += "; evaluation through vLLM"
    mem = report.get("memory") or {}
    if mem.get("bytes") is not None:
        per_gpu = report.get("tensor_parallel_size", 1) > 1
        per_gpu = f" (~{mem['weights_per_gpu_gib']:.1f} GiB per GPU)" if per_gpu else ""
        text += f"; weights ~{mem['weights_gib']:.1f} GiB{per_gpu} of {mem['budget_gib']:.1f} GiB"
    return text
