"""Preflight's vLLM part: will the installed vLLM load this target and return its hidden states?

Runs on a CPU in seconds whenever `extract.backend: vllm` or `eval.vllm: true`, before any GPU job:
the vLLM environment (`vllm.python`) answers `python -m eyrie.preflight.gather` with the installed
vLLM's facts; then the version range, the adapter against those facts, the config and its
quantization, the extraction path (chosen exactly as the backend will), tensor parallelism and
the weights' memory are checked. `vllm_checks` returns the problems (each with its fix), the
warnings and preflight.json's `vllm` object. See docs/vllm.md (What preflight checks).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from eyrie.arch.registry import adapter_for
from eyrie.arch.target import TargetInfo, fingerprint, read_config
from eyrie.config.schema import vllm_setting, vllm_uses
from eyrie.core.errors import EyrieError, VllmAdapterError
from eyrie.vllm.adapters import SUPPORTED_VLLM, TESTED_VLLM
from eyrie.vllm.checks import (
    ExtractLayers,
    choose_path,
    config_problems,
    native_problems,
    version_problems,
    version_warnings,
)
from eyrie.vllm.facts import VllmFacts
from eyrie.vllm.quantization import missing_packages, parse_problem

FACTS_TIMEOUT_S = 120.0  # far above what `import vllm` takes on a small machine: past it, it hangs


# The weights may take this fraction of tp x gpu_memory_gib x gpu_memory_utilization; the rest is
# left for activations, the KV cache and CUDA graphs (extraction runs prompts of max_model_len).
WEIGHT_FRACTION = 0.80


GIB = 1024**3


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


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


def _moe_layers(text: dict, num_layers: int) -> int:
    """How many decoder layers have routed experts (DeepSeek: first_k_dense_replace and
    moe_layer_freq; Qwen3-MoE: decoder_sparse_step and mlp_only_layers)."""
    first_dense = int(text.get("first_k_dense_replace") or 0)
    freq = int(text.get("moe_layer_freq") or text.get("decoder_sparse_step") or 1)
    dense_only = set(text.get("mlp_only_layers") or [])
    return sum(
        1
        for i in range(num_layers)
        if i >= first_dense and (i + 1) % freq == 0 and i not in dense_only
    )


def parameter_groups(text: dict) -> dict[str, int]:
    """Parameters of the language model described by a config (text_config for wrappers), by
    group: embeddings, lm_head, attention (MLA when kv_lora_rank is set), dense MLPs, routed and
    shared experts, routers. Biases and norms are left out (< 0.1%); vision towers too."""
    H, L, V = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    nh = text["num_attention_heads"]
    nkv = text.get("num_key_value_heads") or nh
    if text.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)
        qr, kr = text.get("q_lora_rank"), text["kv_lora_rank"]
        dn, dr, dv = text["qk_nope_head_dim"], text["qk_rope_head_dim"], text["v_head_dim"]
        q = H * qr + qr * nh * (dn + dr) if qr else H * nh * (dn + dr)
        attn = q + H * (kr + dr) + kr * nh * (dn + dv) + nh * dv * H
    else:
        hd = text.get("head_dim") or H // nh
        attn = H * nh * hd + 2 * H * nkv * hd + nh * hd * H
    experts = (
        text.get("n_routed_experts") or text.get("num_experts") or text.get("num_local_experts")
    )
    moe = _moe_layers(text, L) if experts else 0
    size = (text.get("moe_intermediate_size") or text["intermediate_size"]) if experts else 0
    shared = int(text.get("n_shared_experts") or 0)
    return {
        "embed_tokens": V * H,
        "lm_head": 0 if text.get("tie_word_embeddings") else V * H,
        "attention": L * attn,
        "dense_mlp": (L - moe) * 3 * H * text["intermediate_size"],
        "experts": moe * (experts or 0) * 3 * H * size,
        "shared_experts": moe * shared * 3 * H * size,
        "router": moe * H * (experts or 0),
    }


def count_parameters(text: dict) -> int:
    """All parameters of parameter_groups."""
    return sum(parameter_groups(text).values())


# a module of each group of Linear layers as checkpoints name them: a quantization config's
# ignore list (names, or "re:" patterns matched from the start) is tested against these
GROUP_MODULES = {
    "lm_head": "lm_head",
    "attention": "model.layers.3.self_attn.o_proj",
    "dense_mlp": "model.layers.0.mlp.down_proj",
    "experts": "model.layers.3.mlp.experts.0.down_proj",
    "shared_experts": "model.layers.3.mlp.shared_experts.down_proj",
}


def quantized_bits(q: dict) -> tuple[float, list[str]] | None:
    """Bits per parameter of a checkpoint's quantized Linear weights (their scales included) and
    the modules left unquantized; None for a method this does not know."""
    method = q.get("quant_method")
    if method == "compressed-tensors":
        group = next(iter((q.get("config_groups") or {}).values()), None) or {}
        weights = group.get("weights") or {}
        bits, size = weights.get("num_bits"), weights.get("group_size")
        if not isinstance(bits, int):
            return None
        return bits + (16 / size if size else 0), list(q.get("ignore") or [])
    if method == "fp8":
        block = q.get("weight_block_size") or [128, 128]
        skip = q.get("ignored_layers") or q.get("modules_to_not_convert") or []
        return 8 + 32 / (block[0] * block[1]), list(skip)
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin"):
        bits, size = q.get("bits") or q.get("w_bit"), q.get("group_size") or q.get("q_group_size")
        if not isinstance(bits, int):
            return None
        return bits + (16 + bits) / size if size else bits, list(
            q.get("modules_to_not_convert") or []
        )
    return None


def _ignored(module: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif module == pattern or module.endswith("." + pattern):
            return True
    return False


def architecture_bytes(config: dict) -> dict:
    """The weights' bytes from the architecture: parameters x bytes per parameter, quantized
    Linear groups at their quantization's bits (the ignore list's groups and the rest at the
    checkpoint dtype); `upper_bound` when the quantization method is unknown."""
    text = config.get("text_config") or config
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16"
    per = DTYPE_BYTES.get(str(dtype), 2)
    groups = parameter_groups(text)
    q = text.get("quantization_config") or config.get("quantization_config")
    quant = quantized_bits(q) if isinstance(q, dict) else None
    total = 0.0
    for group, n in groups.items():
        module = GROUP_MODULES.get(group)
        if quant is not None and module is not None and not _ignored(module, quant[1]):
            total += n * quant[0] / 8
        else:
            total += n * per
    params = sum(groups.values())
    how = f"{params / 1e9:.2f} B parameters, {dtype}"
    if quant is not None:
        how += f", {q['quant_method']} at {quant[0]:g} bits"
    elif q:
        how += f"; quantized ({q.get('quant_method')}), so this is an upper bound"
    return {
        "bytes": int(total),
        "parameters": params,
        "how": how,
        "upper_bound": bool(q) and not quant,
    }


# the *.safetensors' bytes against the architecture's: below PARTIAL_SHARE they are taken for a
# copy in progress (the architecture's figure is used); below COMPLETE_SHARE they are used, with a
# warning (a partial copy, or a quantization config.json does not declare)
PARTIAL_SHARE, COMPLETE_SHARE = 0.1, 0.5


def weight_bytes(target: Path, config: dict) -> dict:
    """Bytes of the weights vLLM loads: the *.safetensors files as stored, or, with no files (a
    rehearsal while the weights download) or far fewer bytes than the architecture needs, the
    architecture's own figure (architecture_bytes). `mismatch`: a warning when the two disagree."""
    files = sorted(Path(target).glob("*.safetensors"))
    stored = sum(f.stat().st_size for f in files)
    try:
        arch = architecture_bytes(config)
    except (KeyError, TypeError) as exc:
        if not files:
            return {
                "bytes": None,
                "upper_bound": True,
                "source": f"no *.safetensors in {target} and config.json lacks {exc} to count "
                "parameters",
            }
        arch = None
    share = stored / arch["bytes"] if arch and arch["bytes"] else 1.0
    if files and share >= PARTIAL_SHARE:
        out = {
            "bytes": stored,
            "source": f"{len(files)} *.safetensors file(s) in {target}",
            "upper_bound": False,
        }
    else:
        out = {
            "bytes": arch["bytes"],
            "parameters": arch["parameters"],
            "upper_bound": arch["upper_bound"],
            "source": f"the architecture in config.json ({arch['how']})",
        }
    if arch is not None:
        out["architecture_bytes"] = arch["bytes"]
    if files and share < COMPLETE_SHARE and not arch["upper_bound"]:
        used = "the architecture's" if share < PARTIAL_SHARE else "the files'"
        out["mismatch"] = (
            f"{target}: its *.safetensors hold {stored / GIB:.1f} GiB of the "
            f"~{arch['bytes'] / GIB:.1f} GiB the architecture in config.json needs "
            f"({arch['how']}): a copy in progress, or a quantization config.json does not "
            f"declare; the memory check uses {used} figure"
        )
    return out


def memory_check(
    target: Path, config: dict, v: dict, info: TargetInfo | None = None
) -> tuple[dict, list[str], list[str]]:
    """(estimate, problems, warnings): weights against WEIGHT_FRACTION of the GPUs' budget. The
    suggested tensor_parallel_size is the smallest that fits and that the heads allow (`info`)."""
    tp = int(vllm_setting(v, "tensor_parallel_size"))
    gib = float(vllm_setting(v, "gpu_memory_gib"))
    util = float(vllm_setting(v, "gpu_memory_utilization"))
    w = weight_bytes(target, config)
    budget = tp * gib * util * GIB
    allowed = WEIGHT_FRACTION * budget
    if w["bytes"] is None:
        return (
            {**w, "budget_gib": round(budget / GIB, 3), "fits": None},
            [],
            [f"weight memory not estimated: {w['source']}"],
        )
    notes = [w["mismatch"]] if w.get("mismatch") else []
    need = max(1, math.ceil(w["bytes"] / (WEIGHT_FRACTION * gib * util * GIB)))
    if info is not None:  # None: no tensor_parallel_size the attention heads allow is enough
        need = next((t for t in range(need, need + 4096) if not parallel_problems(info, t)), None)
    est = {
        **w,
        "weights_gib": round(w["bytes"] / GIB, 3),
        "weights_per_gpu_gib": round(w["bytes"] / tp / GIB, 3),
        "budget_gib": round(budget / GIB, 3),
        "weight_fraction": WEIGHT_FRACTION,
        "fits": w["bytes"] <= allowed,
        "min_tensor_parallel_size": need,
    }
    if est["fits"]:
        return est, [], notes
    text = (
        f"{target}: the weights need ~{w['bytes'] / GIB:.1f} GiB ({w['source']}) but "
        f"vllm.tensor_parallel_size={tp} x vllm.gpu_memory_gib={gib:g} x "
        f"vllm.gpu_memory_utilization={util:g} = {budget / GIB:.1f} GiB leaves "
        f"{allowed / GIB:.1f} GiB for them ({WEIGHT_FRACTION:.0%}; the rest is for activations "
        "and the KV cache); "
        + (
            f"use vllm.tensor_parallel_size={need} (GPUs of that memory) or larger GPUs "
            "(vllm.gpu_memory_gib)"
            if need is not None
            else "no tensor_parallel_size the attention heads allow is enough: use GPUs with more "
            "memory (vllm.gpu_memory_gib)"
        )
    )
    return (est, [], [*notes, text]) if w["upper_bound"] else (est, [text], notes)


def parallel_problems(info: TargetInfo, tp: int) -> list[str]:
    """vLLM's rules: attention heads % tp == 0; KV heads split (kv % tp == 0) or replicated
    (tp % kv == 0)."""
    where = "config.json: " + ("text_config." if info.wrapper_model_type else "")
    out = []
    heads = info.text_config.get("num_attention_heads")
    kv = info.text_config.get("num_key_value_heads")
    if isinstance(heads, int) and heads % tp:
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        out.append(
            f"vllm.tensor_parallel_size={tp} does not divide {where}num_attention_heads="
            f"{heads}; use one of {ok[:12]}"
        )
    if isinstance(kv, int) and kv > 0 and kv % tp and tp % kv:
        out.append(
            f"vllm.tensor_parallel_size={tp}: {where}num_key_value_heads={kv} can be neither "
            f"split ({kv} % {tp} != 0) nor replicated ({tp} % {kv} != 0) across the GPUs; use "
            "a tensor_parallel_size that divides or is a multiple of it"
        )
    return out


def quantization_check(
    config: dict, facts: VllmFacts | None
) -> tuple[dict | None, list[str], list[str]]:
    """(what the report says about quantization, problems, warnings). A problem only for what
    vLLM cannot load: a quantization_config without quant_method (vLLM reads
    quant_cfg["quant_method"]), one the method's config class cannot parse (its from_config, run
    by the gatherer: facts.quantization_parse), or a package the method imports on a GPU that
    the vLLM environment cannot import (eyrie.vllm.quantization; `report["packages"]`)."""
    text = config.get("text_config") or {}
    where, q = (
        ("config.json: text_config.quantization_config", text["quantization_config"])
        if text.get("quantization_config")
        else ("config.json: quantization_config", config.get("quantization_config"))
    )
    if not q:
        return None, [], []
    method = q.get("quant_method") if isinstance(q, dict) else None
    report = {"quant_method": method, "where": where.split(": ", 1)[1]}
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


@dataclass(frozen=True)
class VllmTarget:
    """The target the vLLM checks read: its folder, what inspect_target found there, and the
    resolved layer ids (`aux_ids` empty: they did not resolve)."""

    folder: Path
    info: TargetInfo
    aux_ids: list[int]
    final_id: int


@dataclass
class VllmCheck:
    """One check of the vLLM checks: what they read and what they found so far."""

    target: Path
    info: TargetInfo
    config: dict  # the target's config.json
    vllm: dict  # the vllm settings
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


def vllm_python(v: dict) -> Path:
    """The Python of the vLLM environment a `vllm` section names; VllmEnvError when that is not
    an executable file."""
    python = resolve_python(str(vllm_setting(v, "python")))
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise VllmEnvError(
            f"vllm.python={v.get('python')!r}: no vLLM environment there ({python} "
            f"is not an executable file); {SETUP_FIX}"
        )
    return python


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
        check.problems += config_parse_problems(check, facts)


# names vLLM's messages use for a config.json key of another name (transformers 5 reads
# rope_scaling as rope_parameters)
KEY_ALIASES = {"rope_parameters": "rope_scaling"}


def config_parse_problems(check: VllmCheck, facts: VllmFacts) -> list[str]:
    """One problem when vLLM's ModelConfig cannot read the config (facts.config_parse, run by
    the gatherer on this config.json): what vLLM raises at engine start, naming the key when the
    message does."""
    parse = getattr(facts, "config_parse", None)
    if (
        not parse
        or parse.get("ok") is not False
        or parse.get("parsed") != fingerprint(check.config)
    ):
        return []
    key = named_key(check.config, parse["error"])
    fails = f"vLLM {facts.version} cannot read it (vllm.config.ModelConfig fails: {parse['error']})"
    if key is None:
        return [
            f"{check.target / 'config.json'}: {fails}; compare it with the original "
            "checkpoint's config.json and restore what differs"
        ]
    return [
        f"{check.target / 'config.json'}: {key}: {fails}; write {key} as the model's publisher "
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


PATH_RETURNS = {
    "native": "vLLM's extract_hidden_states method + ExampleHiddenStatesConnector: one "
    "safetensors file per request",
    "capture": "eyrie.extract.capture worker extension (eager): the residual stream at each id",
}


def check_extraction_path(check: VllmCheck, adapter, facts: VllmFacts) -> None:
    """The extraction path, chosen exactly as eyrie.extract.vllm_backend will choose it."""
    requested = str(vllm_setting(check.vllm, "extraction_path"))
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
    v = dict(settings.get("vllm") or {})
    folder, info, aux_ids = target.folder, target.info, target.aux_ids
    used = vllm_uses(settings)
    check = VllmCheck(folder, info, read_config(folder), v, used, aux_ids, target.final_id)
    tp = int(vllm_setting(v, "tensor_parallel_size"))
    check.report = base_report(check.used, tp)
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
    check.problems += parallel_problems(info, tp)
    check.report["memory"], problems, warnings = memory_check(folder, check.config, v, info)
    check.problems += problems
    check.warnings += warnings
    return {"problems": check.problems, "warnings": check.warnings, "report": check.report}


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
