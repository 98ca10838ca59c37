"""vLLM architecture adapters and the facts preflight checks them against.

vLLM's internals move every release (the embedding method was renamed, DeepSeek's decoder layer takes
a positional `llama_4_scaling`, the native extraction path captures before or after a layer depending
on the architecture). eyrie keeps what it relies on in ONE registry keyed by the target's model_type
(text_config's for multimodal wrappers) and checks it against the INSTALLED vLLM on a CPU, in
seconds, before any GPU job (eyrie.vllm_preflight), and again inside the worker when the capture
path installs itself (eyrie.vllm_capture).

This module imports nothing from vLLM at import time: `gather_facts` does, in the vLLM environment
(`python -m eyrie.vllm_adapters --config config.json` prints the facts as JSON).

Two ways to get hidden states out of vLLM (docs/vllm.md):
- native: vLLM's own `extract_hidden_states` speculative method + `ExampleHiddenStatesConnector`
  (vLLM >= 0.18), one safetensors file per request;
- capture: a worker extension (eyrie.vllm_capture) that replaces the language model's forward with
  the adapter's loop below and records the residual stream at the chosen ids.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

from eyrie import EyrieError

# vLLM versions eyrie supports: [low, high). Tested ones and how: docs/vllm.md.
SUPPORTED_VLLM = ((0, 18, 0), (0, 23, 0))
TESTED_VLLM = {"0.22.0": "H200: both extraction paths and eagle3 evaluation; CPU: introspection in CI"}
NATIVE_METHOD = "extract_hidden_states"
NATIVE_CONNECTOR = "ExampleHiddenStatesConnector"
EMBED_METHODS = ("embed_input_ids", "get_input_embeddings")  # newest name first (renamed in 0.12)
PATHS = ("auto", "native", "capture")


class VllmAdapterError(EyrieError):
    pass


@dataclass(frozen=True)
class VllmAdapter:
    """How the capture path drives one family's language model in vLLM."""

    family: str
    module: str  # under vllm.model_executor.models
    model_class: str  # the decoder stack: embeddings, layers, final norm
    layer_class: str
    # the decoder layer's forward parameters after self, in order, that the adapter passes
    layer_params: tuple[str, ...]
    call: str  # "keyword" | "positional": how the adapter calls a layer
    # extra per-forward layer arguments (keys of EXTRA_ARGS), passed after the core ones
    extras: tuple[str, ...] = ()
    layers_attr: str = "layers"
    norm_attr: str = "norm"
    # a layer returns (hidden_states, residual); hidden + residual is the residual stream
    returns: str = "pair"
    # config attributes the adapter relies on: attribute -> allowed values (None: any, but present)
    config_requires: tuple[tuple[str, tuple | None], ...] = ()

    @property
    def core_params(self) -> tuple[str, ...]:
        return self.layer_params


LLAMA_PARAMS = ("positions", "hidden_states", "residual")
_DEEPSEEK = VllmAdapter(
    "deepseek", "deepseek_v2", "DeepseekV2Model", "DeepseekV2DecoderLayer",
    ("positions", "hidden_states", "residual", "llama_4_scaling"), "positional",
    extras=("llama_4_scaling",),
    # vLLM builds DeepSeek-style MoE routing from these; a tiny config without them fails to load
    # ("...mlp.gate.e_score_correction_bias", REFERENCE §5)
    config_requires=(("scoring_func", ("sigmoid", "softmax")), ("topk_method", None)),
)
ADAPTERS: dict[str, VllmAdapter] = {
    "llama": VllmAdapter("llama", "llama", "LlamaModel", "LlamaDecoderLayer", LLAMA_PARAMS, "keyword"),
    "mistral": VllmAdapter("mistral", "mistral", "MistralModel", "MistralDecoderLayer", LLAMA_PARAMS,
                           "keyword"),
    "qwen2": VllmAdapter("qwen2", "qwen2", "Qwen2Model", "Qwen2DecoderLayer", LLAMA_PARAMS, "keyword"),
    "qwen3": VllmAdapter("qwen3", "qwen3", "Qwen3Model", "Qwen3DecoderLayer", LLAMA_PARAMS, "keyword"),
    "qwen3_moe": VllmAdapter("qwen3_moe", "qwen3_moe", "Qwen3MoeModel", "Qwen3MoeDecoderLayer",
                             LLAMA_PARAMS, "keyword"),
    "deepseek_v2": _DEEPSEEK,
    "deepseek_v3": _DEEPSEEK,
    "kimi_k2": _DEEPSEEK,  # Kimi-K2 / K2.5's text_config: DeepseekV3-shaped
    "gpt_oss": VllmAdapter("gpt_oss", "gpt_oss", "GptOssModel", "TransformerBlock",
                           ("hidden_states", "positions", "residual"), "keyword"),
}


def supported() -> str:
    return ", ".join(sorted(ADAPTERS))


def adapter_for(model_type: str) -> VllmAdapter:
    try:
        return ADAPTERS[model_type]
    except KeyError:
        raise VllmAdapterError(f"model_type {model_type!r} has no vLLM adapter; supported: "
                               f"{supported()} (docs/vllm.md: adding an architecture)") from None


# ----------------------------------------------------------------------------- extra layer args


def llama_4_scaling(config, positions, module):
    """DeepSeek-family attention scaling: computed by vLLM's own helper when the config asks for it
    (Mistral-Large-3-style configs), None when the config has no `llama_4_scaling` (Kimi-K2.5)."""
    spec = getattr(config, "llama_4_scaling", None)
    if spec is None:
        return None
    helper = getattr(module, "_get_llama_4_scaling")
    return helper(original_max_position_embeddings=spec["original_max_position_embeddings"],
                  scaling_beta=spec["beta"], positions=positions)


EXTRA_ARGS = {"llama_4_scaling": llama_4_scaling}
EXTRA_HELPERS = {"llama_4_scaling": "_get_llama_4_scaling"}  # what each needs from the vLLM module
# the keyword arguments each helper is called with above
EXTRA_HELPER_PARAMS = {"llama_4_scaling": ("original_max_position_embeddings", "scaling_beta", "positions")}


def call_layer(adapter: VllmAdapter, layer, positions, hidden, residual, extras: dict):
    """One decoder layer, called the way the adapter says; returns (hidden, residual)."""
    values = {"positions": positions, "hidden_states": hidden, "residual": residual, **extras}
    if adapter.call == "positional":
        out = layer(*(values[p] for p in adapter.layer_params))
    else:
        out = layer(**{p: values[p] for p in adapter.layer_params})
    if not (isinstance(out, tuple) and len(out) == 2):
        raise VllmAdapterError(f"{type(layer).__name__} returned {type(out).__name__}, expected "
                               "(hidden_states, residual); the adapter's `returns` is wrong for "
                               "this vLLM")
    return out


def request_key(token_ids) -> str:
    """Name of a prompt's capture file: a hash of its token ids (int64)."""
    return hashlib.sha1(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:20]


# ----------------------------------------------------------------------------- facts


@dataclass
class VllmFacts:
    """What the installed vLLM offers for one target (gathered in the vLLM environment)."""

    version: str
    model_type: str
    architecture: str | None  # config.json's architectures[0]
    architecture_class: str | None  # vLLM's class for it (None: vLLM does not know it)
    model_class_found: bool
    layer_class_found: bool
    layer_params: list[str] | None  # decoder layer forward parameters after self
    layer_required: list[str] | None  # those without a default
    embed_method: str | None  # first of EMBED_METHODS the model class has
    helpers: dict[str, bool] = field(default_factory=dict)  # EXTRA_HELPERS name -> present
    native_method: bool = False  # "extract_hidden_states" speculative method exists
    native_connector: bool = False  # the hidden-states KV connector is registered
    eagle3_target: bool = False  # architecture class supports EAGLE-3 aux hidden states
    # which ids the native path captures: "0..N" (after each layer, incl. the last), "1..N-1"
    # (before each layer: no id 0, no id N), or None (no aux-hidden-state capture in the forward)
    native_ids: str | None = None
    worker_extension: bool = False  # LLM(worker_extension_cls=...) + collective_rpc
    # EXTRA_HELPERS name -> the helper's parameter names (None: helper absent)
    helper_params: dict[str, list[str] | None] = field(default_factory=dict)
    quantization_methods: list[str] | None = None  # vLLM's QUANTIZATION_METHODS
    # fields vLLM's speculators "eagle3" converter copies from a draft's config.json (None: unknown)
    eagle3_draft_fields: list[str] | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "VllmFacts":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def parse_version(text: str) -> tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        raise VllmAdapterError(f"cannot read vLLM version {text!r}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def _native_ids(model_cls) -> str | None:
    """How the installed model's forward captures aux hidden states (read from its source)."""
    try:
        src = inspect.getsource(model_cls.forward)
    except (OSError, TypeError):
        return None
    if "_maybe_add_hidden_state" in src:  # EagleModelMixin: id 0, then after layer i -> id i+1
        return "0..N"
    if "aux_hidden_state_layers" in src:  # `if idx in ...` before layer idx: ids 1..N-1 only
        return "1..N-1"
    return None


def layer_signature(layer_cls) -> tuple[list[str], list[str]]:
    """(forward parameters after self, those without a default) of a decoder layer class."""
    params = list(inspect.signature(layer_cls.forward).parameters.values())[1:]
    required = [p.name for p in params if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return [p.name for p in params], required


def inspect_classes(model_cls, layer_cls) -> dict:
    """The VllmFacts fields read from a decoder-stack class and its layer class (either None when
    the module lacks it). Works on any class, so checks can be run on classes built in tests."""
    out: dict = {"model_class_found": model_cls is not None, "layer_class_found": layer_cls is not None,
                 "layer_params": None, "layer_required": None, "embed_method": None,
                 "native_ids": None}
    if layer_cls is not None:
        out["layer_params"], out["layer_required"] = layer_signature(layer_cls)
    if model_cls is not None:
        out["embed_method"] = next((m for m in EMBED_METHODS if hasattr(model_cls, m)), None)
        out["native_ids"] = _native_ids(model_cls)
    return out


def inspect_helpers(module) -> tuple[dict[str, bool], dict[str, list[str] | None]]:
    """(EXTRA_HELPERS name -> present, name -> the helper's parameter names) in a vLLM module."""
    present, params = {}, {}
    for name, helper in EXTRA_HELPERS.items():
        fn = getattr(module, helper, None) if module is not None else None
        present[name] = fn is not None
        params[name] = list(inspect.signature(fn).parameters) if fn is not None else None
    return present, params


def gather_facts(config: dict) -> VllmFacts:
    """Import the installed vLLM and read what it offers for this target config (CPU only).

    Reads only `architectures` and the model_type (text_config's for wrappers) from the config:
    eyrie.vllm_preflight.facts_config sends just those and caches on them (update it when this
    reads more)."""
    import vllm

    text = config.get("text_config") or config
    model_type = text.get("model_type")
    adapter = adapter_for(model_type)
    archs = config.get("architectures") or []
    facts = VllmFacts(version=vllm.__version__, model_type=model_type,
                      architecture=archs[0] if archs else None, architecture_class=None,
                      model_class_found=False, layer_class_found=False, layer_params=None,
                      layer_required=None, embed_method=None)
    try:
        module = importlib.import_module(f"vllm.model_executor.models.{adapter.module}")
    except ImportError:
        module = None
    if module is not None:
        classes = inspect_classes(getattr(module, adapter.model_class, None),
                                  getattr(module, adapter.layer_class, None))
        for key, value in classes.items():
            setattr(facts, key, value)
    facts.helpers, facts.helper_params = inspect_helpers(module)
    from vllm.model_executor.models import ModelRegistry

    lazy = ModelRegistry.models.get(facts.architecture) if facts.architecture else None
    if lazy is not None:
        arch_cls = getattr(importlib.import_module(lazy.module_name), lazy.class_name, None)
        facts.architecture_class = lazy.class_name
        facts.eagle3_target = bool(arch_cls is not None and
                                   hasattr(arch_cls, "set_aux_hidden_state_layers"))
    try:
        import vllm.config.speculative as spec_mod

        facts.native_method = NATIVE_METHOD in inspect.getsource(spec_mod)
    except (ImportError, OSError):
        facts.native_method = False
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        facts.native_connector = NATIVE_CONNECTOR in getattr(KVConnectorFactory, "_registry", {})
    except ImportError:
        facts.native_connector = False
    from vllm.config import ParallelConfig

    facts.worker_extension = "worker_extension_cls" in getattr(ParallelConfig, "__dataclass_fields__", {}) \
        or hasattr(ParallelConfig, "worker_extension_cls")
    try:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

        facts.quantization_methods = sorted(QUANTIZATION_METHODS)
    except ImportError:
        facts.quantization_methods = None
    try:
        from vllm.transformers_utils.configs.speculators import algos

        src = inspect.getsource(algos.SUPPORTED_SPECULATORS_TYPES["eagle3"])
        facts.eagle3_draft_fields = sorted(set(re.findall(r'pre_trained_config\["(\w+)"\]', src)))
    except (ImportError, AttributeError, KeyError, OSError, TypeError):
        facts.eagle3_draft_fields = None
    return facts


# ----------------------------------------------------------------------------- checks


def capture_problems(adapter: VllmAdapter, facts: VllmFacts, config: dict) -> list[str]:
    """Why the capture path cannot drive this target on this vLLM ([] when it can)."""
    where = f"vLLM {facts.version} vllm.model_executor.models.{adapter.module}"
    fix_adapter = "update the adapter in eyrie/vllm_adapters.py for this vLLM (docs/vllm.md) or " \
                  "install a tested vLLM (bash scripts/setup-vllm.sh)"
    out = []
    if not facts.worker_extension:
        out.append(f"vLLM {facts.version}: no worker_extension_cls, so the capture path cannot "
                   f"install itself; {fix_adapter}")
    if not facts.model_class_found:
        out.append(f"{where}: class {adapter.model_class} not found; {fix_adapter}")
    if not facts.layer_class_found:
        out.append(f"{where}: class {adapter.layer_class} not found; {fix_adapter}")
    elif facts.layer_params is not None:
        have = facts.layer_params
        unknown = [p for p in adapter.layer_params if p not in have]
        unfed = [p for p in (facts.layer_required or []) if p not in adapter.layer_params]
        order_ok = adapter.call == "keyword" or have[:len(adapter.layer_params)] == list(adapter.layer_params)
        if unknown or unfed or not order_ok:
            out.append(f"{where}: {adapter.layer_class}.forward{tuple(have)} does not match the "
                       f"adapter's {adapter.call} call {adapter.layer_params}"
                       + (f" (missing {unknown})" if unknown else "")
                       + (f" (required but not passed {unfed})" if unfed else "")
                       + ("" if order_ok else " (positional order differs)") + f"; {fix_adapter}")
    if facts.model_class_found and facts.embed_method is None:
        out.append(f"{where}: {adapter.model_class} has neither of {list(EMBED_METHODS)}; {fix_adapter}")
    text = config.get("text_config") or config
    for extra in adapter.extras:
        if extra == "llama_4_scaling" and text.get("llama_4_scaling") is not None:
            if not facts.helpers.get(extra):
                out.append(f"{where}: config asks for llama_4_scaling but this vLLM has no "
                           f"{EXTRA_HELPERS[extra]}; {fix_adapter}")
            else:
                have_params = (facts.helper_params or {}).get(extra)
                if have_params is not None and not set(EXTRA_HELPER_PARAMS[extra]) <= set(have_params):
                    out.append(f"{where}: {EXTRA_HELPERS[extra]}{tuple(have_params)} does not take "
                               f"the keywords {EXTRA_HELPER_PARAMS[extra]} the adapter passes; "
                               f"{fix_adapter}")
    return out


def config_problems(adapter: VllmAdapter, config: dict) -> list[str]:
    text = config.get("text_config") or config
    where = "config.json: " + ("text_config." if "text_config" in config else "")
    out = []
    for attr, allowed in adapter.config_requires:
        value = text.get(attr)
        if value is None:
            out.append(f"{where}{attr} missing: vLLM's {adapter.family} model needs it to build the "
                       f"MoE routing (use {list(allowed) if allowed else 'the value of the original model'})")
        elif allowed is not None and value not in allowed:
            out.append(f"{where}{attr}={value!r}: vLLM's {adapter.family} model supports {list(allowed)}")
    spec = text.get("llama_4_scaling")
    if "llama_4_scaling" in adapter.extras and spec is not None and not (
            isinstance(spec, dict) and {"original_max_position_embeddings", "beta"} <= set(spec)):
        # vLLM's own forward reads both keys, whichever extraction path runs
        out.append(f"{where}llama_4_scaling={spec!r} needs keys original_max_position_embeddings "
                   "and beta; fix the target's config")
    return out


def native_problems(facts: VllmFacts, layer_ids: list[int], num_layers: int) -> list[str]:
    """Why vLLM's native extraction cannot return `layer_ids` for this target ([] when it can)."""
    v = f"vLLM {facts.version}"
    out = []
    if parse_version(facts.version) < SUPPORTED_VLLM[0]:
        out.append(f"{v}: native extraction needs vLLM >= 0.18")
    if not facts.native_method:
        out.append(f"{v}: speculative method {NATIVE_METHOD!r} not found")
    if not facts.native_connector:
        out.append(f"{v}: KV connector {NATIVE_CONNECTOR} not registered")
    if not facts.eagle3_target:
        out.append(f"{v}: {facts.architecture_class or facts.architecture} does not expose auxiliary "
                   "hidden states (no set_aux_hidden_state_layers)")
    if facts.native_ids is None:
        out.append(f"{v}: the {facts.model_type} model's forward captures no auxiliary hidden states")
    elif facts.native_ids == "1..N-1":
        bad = [i for i in layer_ids if not 1 <= i <= num_layers - 1]
        if bad:
            out.append(f"{v}: the {facts.model_type} model captures states BEFORE each layer "
                       f"(ids 1..{num_layers - 1}), so id {bad[0]}"
                       + (" (the last layer's output, which the training targets need)"
                          if bad[0] == num_layers else "") + " is never returned")
    return out


def choose_path(requested: str, adapter: VllmAdapter, facts: VllmFacts, config: dict,
                layer_ids: list[int], num_layers: int) -> tuple[str | None, list[str]]:
    """(path to use, problems). `auto` prefers native and falls back to capture."""
    if requested not in PATHS:
        return None, [f"vllm.extraction_path={requested!r}: use one of {list(PATHS)}"]
    native = native_problems(facts, layer_ids, num_layers)
    capture = capture_problems(adapter, facts, config)
    if requested == "native":
        return ("native", []) if not native else (None, [
            f"vllm.extraction_path=native: {p}; set vllm.extraction_path to capture or auto"
            for p in native])
    if requested == "capture":
        return ("capture", []) if not capture else (None, capture)
    if not native:
        return "native", []
    if not capture:
        return "capture", []
    return None, [f"neither extraction path works: native: {'; '.join(native)}; capture: "
                  f"{'; '.join(capture)}"]


def version_problems(facts: VllmFacts) -> list[str]:
    low, high = SUPPORTED_VLLM
    v = parse_version(facts.version)
    if not low <= v < high:
        return [f"vLLM {facts.version} is outside the supported range "
                f"[{'.'.join(map(str, low))}, {'.'.join(map(str, high))}); install a tested "
                f"version ({', '.join(TESTED_VLLM)}: bash scripts/setup-vllm.sh) or point "
                "vllm.python at an environment that has one"]
    return []


def main(argv: list[str] | None = None) -> int:
    """`python -m eyrie.vllm_adapters --config config.json [--config ...]`: the facts, one JSON
    line per config."""
    import argparse
    import logging

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--config", required=True, action="append",
                        help="a target's config.json (repeat it: one JSON line per config, one "
                             "vLLM import for all)")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # vLLM's import-time chatter goes to stderr anyway
    for path in args.config:
        with open(path) as f:
            config = json.load(f)
        try:
            line = gather_facts(config).to_json()
        except VllmAdapterError as exc:
            line = {"error": str(exc)}
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
