"""Preflight's reading of a target's config.json by the installed vLLM: what its own config
classes made of it (ModelConfig and the quantization method's class, run by the gatherer:
facts.config_parse, facts.quantization_parse) and the packages its quantization method imports on a
GPU. Each problem names the config key and the fix. See docs/vllm.md (What preflight checks).
"""

from __future__ import annotations

import re
from pathlib import Path

from eyrie.arch.target import fingerprint
from eyrie.vllm.facts import VllmFacts
from eyrie.vllm.quant_packages import missing_packages
from eyrie.vllm.quantization import parse_problem, quantization_config


def quantization_check(
    config: dict, facts: VllmFacts | None
) -> tuple[dict | None, list[str], list[str]]:
    """(what the report says about quantization, problems, warnings). A problem only for what
    vLLM cannot load: a quantization_config without quant_method (vLLM reads
    quant_cfg["quant_method"]), one the method's config class cannot parse (its from_config, run
    by the gatherer: facts.quantization_parse), or a package the method imports on a GPU that
    the vLLM environment cannot import (eyrie.vllm.quant_packages; `report["packages"]`)."""
    key, q = quantization_config(config)
    if not q:
        return None, [], []
    where = f"config.json: {key}"
    method = q.get("quant_method") if isinstance(q, dict) else None
    report = {"quant_method": method, "where": key}
    # None: facts gathered for another config or before the field (eyrie.vllm.quantization)
    packages = getattr(facts, "quantization_packages", None)
    if packages is not None:
        report["packages"] = packages
    if not method:
        return (
            report,
            [
                f"{where} has no quant_method, which vLLM reads to pick the weight loader "
                "(KeyError at load); add the method the checkpoint was quantized with "
                '(e.g. "fp8", "compressed-tensors")'
            ],
            [],
        )
    known = facts.quantization_methods if facts is not None else None
    if known is not None and method not in known:
        return (
            report,
            [],
            [
                f"{where}.quant_method={method!r} is not one of vLLM {facts.version}'s "
                "quantization methods; vLLM will refuse it unless one of its methods "
                "recognises the checkpoint"
            ],
        )
    parse = getattr(facts, "quantization_parse", None)
    if parse and parse.get("parsed") == fingerprint(q):  # else facts of another config
        report["parse"] = parse
    problems = []
    if "parse" in report and parse["ok"] is False:
        problems.append(parse_problem(parse, q, facts.version))
    if packages is None:
        return report, problems, []
    key = f"{where}.quant_method={method!r}"
    if packages.get("modules") is None:
        return (
            report,
            problems,
            [
                f"{key}: the packages vLLM {facts.version} imports for it are unknown "
                f"({packages.get('how')}); a missing one fails only on the GPU"
            ],
        )
    return report, problems + missing_packages(key, packages, facts.version), []


# names vLLM's messages use for a config.json key of another name (transformers 5 reads
# rope_scaling as rope_parameters)
KEY_ALIASES = {"rope_parameters": "rope_scaling"}


def config_parse_problems(target: Path, config: dict, facts: VllmFacts) -> list[str]:
    """One problem when vLLM's ModelConfig cannot read the config (facts.config_parse, run by
    the gatherer on the config.json of the target folder `target`): what vLLM raises at engine
    start, naming the key when the message does."""
    parse = getattr(facts, "config_parse", None)
    if not parse or parse.get("ok") is not False or parse.get("parsed") != fingerprint(config):
        return []
    key = named_key(config, parse["error"])
    fails = f"vLLM {facts.version} cannot read it (vllm.config.ModelConfig fails: {parse['error']})"
    if key is None:
        return [
            f"{target / 'config.json'}: {fails}; compare it with the original "
            "checkpoint's config.json and restore what differs"
        ]
    return [
        f"{target / 'config.json'}: {key}: {fails}; write {key} as the model's publisher "
        "ships it (copy it from the original config.json)"
    ]


def named_key(config: dict, message: str) -> str | None:
    """The config.json key (text_config.<key> for wrappers) an error message names, if any: the
    longest key name among its words, text_config's first."""
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", message))
    words |= {KEY_ALIASES[w] for w in words if w in KEY_ALIASES}
    text = config.get("text_config")
    scopes = [("text_config.", text)] if isinstance(text, dict) else []
    hits = [
        (len(k), prefix == "text_config.", prefix + k)
        for prefix, keys in scopes + [("", config)]
        for k in keys
        if k in words and k != "text_config"
    ]
    return max(hits)[2] if hits else None
