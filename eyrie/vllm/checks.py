"""Whether the installed vLLM can extract from a target, as lists of problems ([] when it can).

Each check compares the target's adapter (eyrie.arch.registry) and config.json with the
`VllmFacts` of the installed vLLM (eyrie.vllm.facts); `choose_path` picks the extraction path.
A problem names what differs and the fix. See docs/vllm.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from eyrie.arch.registry import VllmAdapter
from eyrie.vllm.adapters import (
    EMBED_METHODS,
    EXTRA_HELPER_PARAMS,
    EXTRA_HELPERS,
    GPU_TESTED_VLLM,
    NATIVE_CONNECTOR,
    NATIVE_METHOD,
    PATHS,
    SUPPORTED_VLLM,
    TESTED_VLLM,
)
from eyrie.vllm.facts import VllmFacts, parse_version

FIX_ADAPTER = (
    "update the adapter in eyrie/arch/registry.py for this vLLM (docs/vllm.md) or "
    "install a tested vLLM (bash scripts/setup-vllm.sh)"
)


def capture_problems(adapter: VllmAdapter, facts: VllmFacts, config: dict) -> list[str]:
    """Why the capture path cannot drive this target on this vLLM ([] when it can)."""
    where = f"vLLM {facts.version} vllm.model_executor.models.{adapter.module}"
    out = []
    if not facts.worker_extension:
        out.append(
            f"vLLM {facts.version}: no worker_extension_cls, so the capture path cannot "
            f"install itself; {FIX_ADAPTER}"
        )
    if not facts.model_class_found:
        out.append(f"{where}: class {adapter.model_class} not found; {FIX_ADAPTER}")
    if not facts.layer_class_found:
        out.append(f"{where}: class {adapter.layer_class} not found; {FIX_ADAPTER}")
    elif facts.layer_params is not None:
        out += _layer_problems(adapter, facts, where)
    if facts.model_class_found and facts.embed_method is None:
        out.append(
            f"{where}: {adapter.model_class} has neither of {list(EMBED_METHODS)}; {FIX_ADAPTER}"
        )
    text = config.get("text_config") or config
    for extra in adapter.extras:
        if extra == "llama_4_scaling" and text.get("llama_4_scaling") is not None:
            out += _helper_problems(extra, facts, where)
    return out


def _layer_problems(adapter: VllmAdapter, facts: VllmFacts, where: str) -> list[str]:
    """The decoder layer's forward against the parameters and call style of the adapter."""
    have = facts.layer_params
    unknown = [p for p in adapter.layer_params if p not in have]
    unfed = [p for p in (facts.layer_required or []) if p not in adapter.layer_params]
    order_ok = adapter.call == "keyword" or have[: len(adapter.layer_params)] == list(
        adapter.layer_params
    )
    if not (unknown or unfed or not order_ok):
        return []
    return [
        f"{where}: {adapter.layer_class}.forward{tuple(have)} does not match the "
        f"adapter's {adapter.call} call {adapter.layer_params}"
        + (f" (missing {unknown})" if unknown else "")
        + (f" (required but not passed {unfed})" if unfed else "")
        + ("" if order_ok else " (positional order differs)")
        + f"; {FIX_ADAPTER}"
    ]


def _helper_problems(extra: str, facts: VllmFacts, where: str) -> list[str]:
    """The vLLM helper an extra layer argument needs: present, and taking the keywords passed."""
    helper = EXTRA_HELPERS[extra]
    if not facts.helpers.get(extra):
        return [f"{where}: config asks for {extra} but this vLLM has no {helper}; {FIX_ADAPTER}"]
    have_params = (facts.helper_params or {}).get(extra)
    if have_params is not None and not set(EXTRA_HELPER_PARAMS[extra]) <= set(have_params):
        return [
            f"{where}: {helper}{tuple(have_params)} does not take the keywords "
            f"{EXTRA_HELPER_PARAMS[extra]} the adapter passes; {FIX_ADAPTER}"
        ]
    return []


def config_problems(adapter: VllmAdapter, config: dict) -> list[str]:
    """The config.json attributes vLLM's model of this family needs, and their values."""
    text = config.get("text_config") or config
    where = "config.json: " + ("text_config." if "text_config" in config else "")
    out = []
    for attr, allowed in adapter.config_requires:
        value = text.get(attr)
        if value is None:
            use = list(allowed) if allowed else "the value of the original model"
            out.append(
                f"{where}{attr} missing: vLLM's {adapter.family} model needs it to build the "
                f"MoE routing (use {use})"
            )
        elif allowed is not None and value not in allowed:
            out.append(
                f"{where}{attr}={value!r}: vLLM's {adapter.family} model supports {list(allowed)}"
            )
    spec = text.get("llama_4_scaling")
    if (
        "llama_4_scaling" in adapter.extras
        and spec is not None
        and not (
            isinstance(spec, dict) and {"original_max_position_embeddings", "beta"} <= set(spec)
        )
    ):
        # vLLM's own forward reads both keys, whichever extraction path runs
        out.append(
            f"{where}llama_4_scaling={spec!r} needs keys original_max_position_embeddings "
            "and beta; fix the target's config"
        )
    return out


def attention_kinds(config: dict) -> list[str]:
    """The target's distinct layer kinds (config's layer_types, text_config's for wrappers):
    more than one puts its layers in several KV-cache groups."""
    text = config.get("text_config") or config
    return sorted(set(text.get("layer_types") or []))


def native_problems(
    facts: VllmFacts, layer_ids: list[int], num_layers: int, config: dict | None = None
) -> list[str]:
    """Why vLLM's native extraction cannot return `layer_ids` for this target ([] when it can)."""
    v = f"vLLM {facts.version}"
    out = []
    kinds = attention_kinds(config or {})
    if len(kinds) > 1 and not facts.native_hybrid:
        state = "reads them wrongly" if facts.native_hybrid is False else "is unknown"
        out.append(
            f"{v}: this target's layers are of several kinds ({', '.join(kinds)}), and whether "
            f"the hidden-states connector reads their states from the right KV-cache group "
            f"{state} ({facts.native_hybrid_how})"
        )
    if parse_version(facts.version) < SUPPORTED_VLLM[0]:
        out.append(f"{v}: native extraction needs vLLM >= 0.18")
    if not facts.native_method:
        out.append(f"{v}: speculative method {NATIVE_METHOD!r} not found")
    if not facts.native_connector:
        out.append(f"{v}: KV connector {NATIVE_CONNECTOR} not registered")
    if not facts.eagle3_target:
        out.append(
            f"{v}: {facts.architecture_class or facts.architecture} does not expose auxiliary "
            "hidden states (no set_aux_hidden_state_layers)"
        )
    if facts.native_ids is None:
        out.append(
            f"{v}: which ids the {facts.model_type} model's forward returns is unknown "
            f"({facts.native_ids_how}); run tests/support/vllm_gpu_check.py on a GPU for this "
            "family (docs/vllm.md) before using the native path"
        )
    elif facts.native_ids == "none":
        out.append(
            f"{v}: the {facts.model_type} model's forward captures no auxiliary hidden states"
        )
    else:
        low, high = native_range(facts.native_ids, num_layers)
        bad = [i for i in layer_ids if not low <= i <= high]
        if bad:
            when = "BEFORE each layer" if high < num_layers else "at ids"
            out.append(
                f"{v}: the {facts.model_type} model captures states {when} "
                f"(ids {low}..{high}), so id {bad[0]}"
                + (
                    " (the last layer's output, which the training targets need)"
                    if bad[0] == num_layers
                    else ""
                )
                + " is never returned"
            )
    return out


def native_range(native_ids: str, num_layers: int) -> tuple[int, int]:
    """The ids a VllmFacts.native_ids range ("0..N", "1..N-1", ...) means for a target."""
    low, high = native_ids.split("..")
    return int(low), num_layers - (1 if high == "N-1" else 0)


@dataclass(frozen=True)
class ExtractLayers:
    """The layer ids extraction asks for (the aux layers', then the final layer's) and the target's
    number of decoder layers, which bounds them."""

    ids: list[int]
    num_layers: int


def choose_path(
    requested: str,
    adapter: VllmAdapter,
    facts: VllmFacts,
    config: dict,
    layers: ExtractLayers,
) -> tuple[str | None, list[str]]:
    """(path to use, problems). `auto` prefers native and falls back to capture."""
    if requested not in PATHS:
        return None, [f"vllm.extraction_path={requested!r}: use one of {list(PATHS)}"]
    native = native_problems(facts, layers.ids, layers.num_layers, config)
    capture = capture_problems(adapter, facts, config)
    if requested == "native":
        if native:
            fix = "set vllm.extraction_path to capture or auto"
            return None, [f"vllm.extraction_path=native: {p}; {fix}" for p in native]
        return "native", []
    if requested == "capture":
        return ("capture", []) if not capture else (None, capture)
    if not native:
        return "native", []
    if not capture:
        return "capture", []
    return None, [
        f"neither extraction path works: native: {'; '.join(native)}; capture: {'; '.join(capture)}"
    ]


def version_problems(facts: VllmFacts) -> list[str]:
    """The installed vLLM against the supported range."""
    low, high = SUPPORTED_VLLM
    v = parse_version(facts.version)
    if not low <= v < high:
        return [
            f"vLLM {facts.version} is outside the supported range "
            f"[{'.'.join(map(str, low))}, {'.'.join(map(str, high))}); install a tested "
            f"version ({', '.join(TESTED_VLLM)}: bash scripts/setup-vllm.sh [VERSION]) or "
            "point vllm.python at an environment that has one"
        ]
    return []


def version_warnings(facts: VllmFacts) -> list[str]:
    """A version in the range that eyrie has not tested, or tested on a CPU only."""
    if version_problems(facts):
        return []
    if facts.version not in TESTED_VLLM:
        return [
            f"vLLM {facts.version} is in the supported range but untested (tested: "
            f"{', '.join(TESTED_VLLM)}); docs/vllm.md says what to check on a GPU first"
        ]
    if facts.version not in GPU_TESTED_VLLM:
        return [
            f"vLLM {facts.version} is tested on a CPU only (its facts, in CI), not run on a GPU "
            f"by eyrie (GPU-tested: {', '.join(GPU_TESTED_VLLM)}); run the GPU check "
            "(docs/vllm.md) before a long job"
        ]
    return []


def block_draft_problems(method: str, facts: VllmFacts, draft: dict, where: str) -> list[str]:
    """Why this vLLM would not serve a block drafter (`method`: dflash, dspark) whose config.json
    is `draft` as it was trained ([] when it would): no converter or class for the method, or a
    draft that samples from its anchor (speculators' DSpark default) on a converter that does not
    read sample_from_anchor and so serves the anchor as a bonus token (vLLM 0.22's DFlash, 0.26's
    DSpark: `block_drafts` in docs/vllm.md), or sliding_window_non_causal false on a converter that
    reads it (0.26's DFlash and later: every layer causal, unlike training). `where`: the draft's
    config.json, for the line."""
    known = (facts.block_drafts or {}).get(method)
    if known is None:  # facts from before the field: nothing known to check
        return []
    if known["class"] is None:
        return [
            f"{where}: vLLM {facts.version} serves no {method} draft (no speculators "
            f"{method!r} converter or class); install a vLLM that does (docs/vllm.md's "
            "version table; bash scripts/setup-vllm.sh VERSION)"
        ]
    if draft.get("sample_from_anchor") and "sample_from_anchor" not in (known["reads"] or []):
        return [
            f"{where}: sample_from_anchor is true (the block's first slot drafts the token after "
            f"the anchor), but vLLM {facts.version}'s {method} converter does not read it and "
            "serves the anchor as a bonus token: the draft would run with the other convention; "
            "install vLLM 0.33 or later, or train with sample_from_anchor false"
        ]
    if "sliding_window_non_causal" in (known["reads"] or []) and not draft.get(
        "sliding_window_non_causal"
    ):
        return [
            f"{where}: sliding_window_non_causal is false, and vLLM {facts.version}'s {method} "
            "converter reads it as `causal` for every draft layer, but speculators trains full "
            "attention layers bidirectional within the block: the draft would run another "
            "network; re-export it with eyrie (which sets it true)"
        ]
    return []
