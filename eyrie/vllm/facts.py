"""What the installed vLLM offers for one target, read on a CPU in the vLLM environment.

`read_facts` imports vLLM and fills a `VllmFacts` (JSON-serialisable) that eyrie.vllm.checks
compares with the target's adapter (eyrie.arch.registry). The inspectors work on any class, so
tests run them on classes built to mimic a vLLM release. `parse_config` reads the target's
config.json with vLLM's own config classes, so what they would raise at engine start is found on
the CPU. `gather_facts` returns the facts a job kept for this environment (facts_cache), else
reads them. See docs/vllm.md.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import re
import typing
from dataclasses import asdict, dataclass, field

from eyrie.arch.registry import VllmAdapter, adapter_for
from eyrie.arch.target import fingerprint
from eyrie.core.errors import VllmAdapterError
from eyrie.vllm import draft_probe, facts_cache, probe, quantization
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
    # transformer_layer_config.model_type of each draft kind eyrie exports -> the class vLLM
    # serves it with (its speculators converter's choice, inspected by its registry); None:
    # refused or unknown
    eagle3_draft_classes: dict[str, str | None] | None = None
    # block drafters (BLOCK_METHODS): method -> {"class": the class vLLM serves it with (None:
    # no converter, or vLLM's registry lacks the class), "reads": the draft config.json fields
    # its speculators converter reads (None: no converter)}
    block_drafts: dict[str, dict] | None = None
    # the model runner vLLM picks for this architecture when VLLM_USE_V2_MODEL_RUNNER is unset
    # ("v1" | "v2"; None: no choice in this vLLM or unknown) and what established it
    default_runner: str | None = None
    default_runner_how: str | None = None
    # what vLLM's own check of the environment raises at engine start for the environment eyrie's
    # engines get (the user's: eyrie sets no VLLM_ variable of its own); None: accepted
    engine_env_refused: str | None = None
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
    # the config read by vLLM's own classes (parse_config): {"ok": True | False | None (not
    # parsed), "error": "ExcType: message", "how": ..., "parsed": fingerprint of the config};
    # None: not read (facts from before the field)
    config_parse: dict | None = None
    # its quantization_config parsed by the method's config class, the same keys (and "where",
    # "quant_method", "method", "class": eyrie.vllm.quantization.parse_quantization; "parsed":
    # fingerprint of the quantization_config); None: not quantized or not read
    quantization_parse: dict | None = None

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
    """What the installed vLLM offers for this target config: kept facts (facts_cache) where a
    job read them before in this very environment (or is reading them now), else read_facts."""
    kept = facts_cache.load(config)
    if kept is None:
        with facts_cache.reading(config):  # another job reading them now: wait, then load
            kept = facts_cache.load(config)
            if kept is None:
                facts = read_facts(config)
                facts_cache.store(config, facts.to_json())
                return facts
    return VllmFacts.from_json(kept)


def read_facts(config: dict) -> VllmFacts:
    """Import the installed vLLM and read what it offers for this target config (CPU only).

    Reads the whole config: vLLM's own config classes parse it (parse_config), so
    eyrie.preflight.vllm_env.facts_for sends all of it and caches on it."""
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
    facts.eagle3_draft_fields, _ = draft_probe.draft_fields()
    facts.eagle3_draft_classes = _read_draft_classes()
    facts.block_drafts = _read_block_drafts()
    facts.default_runner, facts.default_runner_how = probe.default_runner(facts.architecture)
    facts.engine_env_refused = probe.environment_refusal({})
    facts.native_chunked_prefill, _ = probe.chunked_prefill_with_connector()
    facts.native_hybrid, facts.native_hybrid_how = probe.hybrid_groups()
    facts.quantization_packages = quantization.required_packages(config)
    facts.config_parse, facts.quantization_parse = parse_config(config)
    return facts


# what vLLM's ModelConfig is given here: no tokenizer, as eyrie's engines run it
# (eyrie.extract.vllm_backend), and no code from the checkpoint (preflight runs none)
MODEL_CONFIG_ARGS = {"skip_tokenizer_init": True, "trust_remote_code": False}


def parse_config(config: dict) -> tuple[dict, dict | None]:
    """(config_parse, quantization_parse): the config read as vLLM reads it at engine start,
    on a CPU: vllm.config.ModelConfig on a folder holding only this config.json (the HF config,
    architecture, quantization method, context length, dtype), then the quantization_config
    through the method's class (eyrie.vllm.quantization.parse_quantization). What these raise,
    vLLM raises in the GPU job; here it is found before any. A config that needs the
    checkpoint's own code is not parsed (`ok` None): preflight runs none."""
    import tempfile
    from pathlib import Path

    from vllm.config import ModelConfig

    params = inspect.signature(ModelConfig).parameters
    kwargs = {k: v for k, v in MODEL_CONFIG_ARGS.items() if k in params}
    if config.get("text_config") and "language_model_only" in params:
        kwargs["language_model_only"] = True  # as the engines run wrappers (adapters.text_only)
    how = f"vllm.config.ModelConfig(model=<config.json's folder>, {_args(kwargs)})"
    model_config, parse = None, {"ok": True, "error": None, "how": how}
    with tempfile.TemporaryDirectory(prefix="eyrie-vllm-config-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        try:
            with _inspect_in_process():
                model_config = ModelConfig(model=tmp, tokenizer=tmp, **kwargs)
        except Exception as exc:  # what vLLM raises at engine start is what preflight reports
            error = quantization.one_line(exc).replace(f"{tmp}/", "").replace(tmp, "<target>")
            remote = "trust_remote_code" in error
            parse = {"ok": None if remote else False, "error": error, "how": how}
            if remote:
                parse["how"] += ": the config needs the checkpoint's own code, not run here"
        quant = quantization.parse_quantization(config, model_config)
    parse["parsed"] = fingerprint(config)  # the check uses a parse of this very config only
    if quant is not None:
        quant["parsed"] = fingerprint(quantization.quantization_config(config)[1])
    return parse, quant


@contextlib.contextmanager
def _inspect_in_process():
    """ModelConfig inspects the architecture's class in a fresh Python process (another
    `import vllm`) unless vLLM's cache holds it for this exact vLLM; gather_facts has imported
    the class already, so it is inspected in this process instead (same function, same result)."""
    from vllm.model_executor.models import registry

    original = getattr(registry, "_run_in_subprocess", None)
    if original is None:  # another vLLM layout: leave it as it is
        yield
        return
    registry._run_in_subprocess = lambda fn: fn()
    try:
        yield
    finally:
        registry._run_in_subprocess = original


def _args(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


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


def _read_draft_classes() -> dict[str, str | None]:
    """vLLM's class for each draft kind the export writes (DRAFT_ARCHS): the name its speculators
    "eagle3" converter gives a draft config of that kind, inspected by vLLM's registry. The
    inspection is what the evaluation's ModelConfig does for the draft, in a fresh Python process
    unless vLLM keeps its result (VLLM_CACHE_ROOT/modelinfos, under cache.path): done here, in
    this process, the evaluation's engine reads it kept (BENCHMARKS.md)."""
    from vllm.model_executor.models import ModelRegistry

    from eyrie.formats.draft import DRAFT_ARCHS

    return {
        kind: _inspected(draft_probe.eagle3_draft_class(kind), ModelRegistry)
        for kind in DRAFT_ARCHS
    }


def _inspected(name: str | None, registry) -> str | None:
    """`name` when vLLM's registry has the class and inspects it (in this process, kept under
    VLLM_CACHE_ROOT as _read_draft_classes says), else None."""
    lazy = registry.models.get(name) if name else None
    if lazy is None:
        return None
    try:
        with _inspect_in_process():
            lazy.inspect_model_cls()
    except Exception:  # noqa: BLE001 - a class this vLLM cannot inspect is one it cannot serve
        return None
    return name


def _read_block_drafts() -> dict[str, dict]:
    """The block_drafts fact: each BLOCK_METHODS converter run on a stand-in draft config
    (draft_probe.block_draft) and the class it names inspected as _read_draft_classes does."""
    from vllm.model_executor.models import ModelRegistry

    from eyrie.arch.methods import BLOCK_METHODS

    out = {}
    for method in BLOCK_METHODS:
        name, reads, _ = draft_probe.block_draft(method)
        out[method] = {"class": _inspected(name, ModelRegistry), "reads": reads}
    return out


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
