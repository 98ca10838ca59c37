"""What the installed vLLM offers for one target, read on a CPU in the vLLM environment.

`gather_facts` imports vLLM and fills a `VllmFacts` (JSON-serialisable) that eyrie.vllm.checks
compares with the target's adapter (eyrie.arch.registry). The inspectors work on any class, so
tests run them on classes built to mimic a vLLM release. See docs/vllm.md.
"""

from __future__ import annotations

import importlib
import inspect
import re
import typing
from dataclasses import asdict, dataclass, field

from eyrie.arch.registry import VllmAdapter, adapter_for
from eyrie.errors import VllmAdapterError
from eyrie.vllm import probe, quantization
from eyrie.vllm.adapters import (
    EAGLE3_DEFAULT_LAYERS,
    EMBED_METHODS,
    EXTRA_HELPERS,
    NATIVE_CONNECTOR,
    NATIVE_METHOD,
)


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
    # which ids the native path returns (eyrie.vllm.probe.native_ids): "0..N" (after each
    # layer, incl. the last), "1..N" (before each layer plus the last layer's output), "1..N-1"
    # (before each layer only), "none" (no capture in the forward), None (unknown)
    native_ids: str | None = None
    native_ids_how: str | None = None  # what established it (or why it is unknown)
    worker_extension: bool = False  # LLM(worker_extension_cls=...) + collective_rpc
    # EXTRA_HELPERS name -> the helper's parameter names (None: helper absent)
    helper_params: dict[str, list[str] | None] = field(default_factory=dict)
    quantization_methods: list[str] | None = None  # vLLM's QUANTIZATION_METHODS
    # fields vLLM's speculators "eagle3" converter copies from a draft's config.json (None: unknown)
    eagle3_draft_fields: list[str] | None = None
    # the model runner vLLM picks for this architecture when VLLM_USE_V2_MODEL_RUNNER is unset
    # ("v1" | "v2"; None: no choice in this vLLM or unknown) and what established it
    default_runner: str | None = None
    default_runner_how: str | None = None
    # whether the hidden-states connector reads the right KV-cache group for a hybrid target
    # (several attention kinds); None: unknown
    native_hybrid: bool | None = None
    native_hybrid_how: str | None = None
    # whether the hidden-states connector accepts chunked prefill (None: unknown)
    native_chunked_prefill: bool | None = None
    # the method the architecture class offers for its default EAGLE-3 aux layers (None: none),
    # used by vLLM only when a draft carries no eagle_aux_hidden_state_layer_ids
    eagle3_default_layers: str | None = None
    # the packages the target's quantization method imports (eyrie.vllm.quantization)
    quantization_packages: dict | None = None

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


def layer_signature(layer_cls) -> tuple[list[str], list[str]]:
    """(forward parameters after self, those without a default) of a decoder layer class."""
    params = list(inspect.signature(layer_cls.forward).parameters.values())[1:]
    required = [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    return [p.name for p in params], required


def inspect_classes(model_cls, layer_cls) -> dict:
    """The VllmFacts fields read from a decoder-stack class and its layer class (either None when
    the module lacks it). Works on any class, so checks can be run on classes built in tests."""
    out: dict = {
        "model_class_found": model_cls is not None,
        "layer_class_found": layer_cls is not None,
        "layer_params": None,
        "layer_required": None,
        "embed_method": None,
        "native_ids": None,
        "native_ids_how": None,
    }
    if layer_cls is not None:
        out["layer_params"], out["layer_required"] = layer_signature(layer_cls)
    if model_cls is not None:
        out["embed_method"] = next((m for m in EMBED_METHODS if hasattr(model_cls, m)), None)
        out["native_ids"], out["native_ids_how"] = probe.native_ids(model_cls)
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
    eyrie.vllm.preflight_checks.facts_config sends just those and caches on them (update it when
    this reads more)."""
    import vllm

    text = config.get("text_config") or config
    model_type = text.get("model_type")
    adapter = adapter_for(model_type)
    archs = config.get("architectures") or []
    facts = VllmFacts(
        version=vllm.__version__,
        model_type=model_type,
        architecture=archs[0] if archs else None,
        architecture_class=None,
        model_class_found=False,
        layer_class_found=False,
        layer_params=None,
        layer_required=None,
        embed_method=None,
    )
    _read_adapter_classes(facts, adapter)
    _read_architecture_class(facts)
    facts.native_method = _has_native_method()
    facts.native_connector = _has_native_connector()
    facts.worker_extension = _has_worker_extension()
    facts.quantization_methods = _quantization_methods()
    facts.eagle3_draft_fields, _ = probe.draft_fields()
    facts.default_runner, facts.default_runner_how = probe.default_runner(facts.architecture)
    facts.native_chunked_prefill, _ = probe.chunked_prefill_with_connector()
    facts.native_hybrid, facts.native_hybrid_how = probe.hybrid_groups()
    facts.quantization_packages = quantization.required_packages(config)
    return facts


def _read_adapter_classes(facts: VllmFacts, adapter: VllmAdapter) -> None:
    """The adapter's decoder-stack and layer classes, and its extra helpers, in their module."""
    try:
        module = importlib.import_module(f"vllm.model_executor.models.{adapter.module}")
    except ImportError:
        module = None
    if module is not None:
        classes = inspect_classes(
            getattr(module, adapter.model_class, None), getattr(module, adapter.layer_class, None)
        )
        for key, value in classes.items():
            setattr(facts, key, value)
    facts.helpers, facts.helper_params = inspect_helpers(module)


def _read_architecture_class(facts: VllmFacts) -> None:
    """vLLM's class for config.json's architectures[0], and whether it can feed EAGLE-3."""
    from vllm.model_executor.models import ModelRegistry

    lazy = ModelRegistry.models.get(facts.architecture) if facts.architecture else None
    if lazy is not None:
        arch_cls = getattr(importlib.import_module(lazy.module_name), lazy.class_name, None)
        facts.architecture_class = lazy.class_name
        facts.eagle3_target = bool(
            arch_cls is not None and hasattr(arch_cls, "set_aux_hidden_state_layers")
        )
        facts.eagle3_default_layers = next(
            (m for m in EAGLE3_DEFAULT_LAYERS if hasattr(arch_cls, m)), None
        )


def _has_native_method() -> bool:
    """Whether NATIVE_METHOD is one of the values SpeculativeConfig.method accepts (its type)."""
    try:
        from vllm.config.speculative import SpeculativeConfig
    except ImportError:
        return False
    return NATIVE_METHOD in _literal_values(typing.get_type_hints(SpeculativeConfig).get("method"))


def _literal_values(hint) -> set:
    """Every value of a (nested, optional) typing.Literal."""
    if typing.get_origin(hint) is typing.Literal:
        return {v for a in typing.get_args(hint) for v in (_literal_values(a) or {a})}
    return {v for a in typing.get_args(hint) for v in _literal_values(a)}


def _has_native_connector() -> bool:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        return NATIVE_CONNECTOR in getattr(KVConnectorFactory, "_registry", {})
    except ImportError:
        return False


def _has_worker_extension() -> bool:
    from vllm.config import ParallelConfig

    return "worker_extension_cls" in getattr(ParallelConfig, "__dataclass_fields__", {}) or hasattr(
        ParallelConfig, "worker_extension_cls"
    )


def _quantization_methods() -> list[str] | None:
    try:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

        return sorted(QUANTIZATION_METHODS)
    except ImportError:
        return None
