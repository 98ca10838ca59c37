"""Typed settings of the stages that read no run id: the demo's two (conversations, target),
tokenize (`data`), the vocabulary map, the evaluation prompts, evaluate, evaluate-vllm and
preflight, each a frozen object built the one way every section is,
`<Stage>Settings.from_settings(settings, runtime)`: the stage's --settings with its --runtime
merged in (what the workflow reads but does not compare; {} when none), checked by the schema
with its cross-field rules (eyrie.config.schema.load_settings), the autos resolved.

`READS` of each section: the dotted config keys it reads, which tests/config/test_settings.py
holds equal to what the rules table (eyrie.config.rules.TABLE) gives its rules.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from eyrie.chat.samples import MaskSettings
from eyrie.config.schema import load_settings, merge_settings, schema_default, vllm_uses
from eyrie.config.sections import ENGINE_KEYS, VllmSettings, load_with_vllm
from eyrie.core.errors import DataError, DemoError, EvaluateError, PreflightError, VocabError
from eyrie.core.rehearsal import is_rehearsal
from eyrie.core.runtime import auto_device, auto_dtype

TRUST = "target.trust_remote_code"


@dataclass(frozen=True)
class DemoConversationsSettings:
    """What `eyrie demo-conversations` reads: how many conversations, from which seed."""

    seed: int
    num_conversations: int

    READS: ClassVar[tuple[str, ...]] = ("demo.seed", "demo.num_conversations")

    @classmethod
    def from_settings(
        cls, settings: dict, runtime: dict | None = None
    ) -> DemoConversationsSettings:
        """The `demo` section, checked and defaulted by the schema (every problem at once)."""
        demo = load_settings(merge_settings(settings, runtime or {}), ["demo"], DemoError)["demo"]
        return cls(**{f.name: demo[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class DemoTargetSettings:
    """The `demo` section as `eyrie demo-target` reads it: the small Llama and its training.
    `device` as given (cpu | cuda | auto): the stage resolves it once the data are ready."""

    seed: int
    vocab_size: int  # the BPE's size (it may stop below it: the texts have no more merges)
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    train_steps: int
    batch_size: int  # windows of seq_len tokens per step
    seq_len: int
    learning_rate: float  # AdamW's peak (warmup, then cosine decay)
    device: str

    # its fields (below the class)
    READS: ClassVar[tuple[str, ...]]

    @classmethod
    def from_settings(cls, settings: dict, runtime: dict | None = None) -> DemoTargetSettings:
        """The `demo` section, checked and defaulted by the schema, then the shapes a Llama
        needs (every problem at once, each naming its keys)."""
        demo = load_settings(merge_settings(settings, runtime or {}), ["demo"], DemoError)["demo"]
        problems = demo_shape_problems(demo)
        if problems:
            raise DemoError("invalid --settings: " + "; ".join(problems))
        return cls(**{f.name: demo[f.name] for f in fields(cls)})


DemoTargetSettings.READS = tuple(f"demo.{f.name}" for f in fields(DemoTargetSettings))


def demo_shape_problems(demo: dict) -> list[str]:
    """The demo.* keys whose values cannot build a Llama, one line each."""
    hidden, heads, kv = (
        demo["hidden_size"],
        demo["num_attention_heads"],
        demo["num_key_value_heads"],
    )
    problems = []
    if hidden % heads:
        problems.append(
            f"demo.hidden_size={hidden} is not divisible by demo.num_attention_heads={heads}; "
            "change one of them"
        )
    elif (hidden // heads) % 2:
        problems.append(
            f"demo.hidden_size / demo.num_attention_heads = {hidden // heads} must be even "
            "(rotary embeddings)"
        )
    if heads % kv:
        problems.append(
            f"demo.num_attention_heads={heads} is not divisible by demo.num_key_value_heads={kv}; "
            "change one of them"
        )
    return problems


@dataclass(frozen=True)
class DataSettings:
    """The `data` section (and trust_remote_code): what `eyrie tokenize` reads."""

    max_seq_len: int
    num_shards: int
    num_eval: int
    seed: int
    strict: bool
    mask_mode: str
    train_reasoning: bool
    non_text: str
    regenerate: bool
    chat_template_kwargs: dict
    reasoning_parser: str | None
    trust_remote_code: bool = False

    READS: ClassVar[tuple[str, ...]] = (
        "data.max_seq_len",
        "data.num_shards",
        "data.num_eval",
        "data.seed",
        "data.strict",
        "data.mask_mode",
        "data.train_reasoning",
        "data.non_text",
        "data.regenerate",
        "data.chat_template_kwargs",
        "data.reasoning_parser",
        TRUST,
    )

    @classmethod
    def from_settings(cls, settings: dict, runtime: dict | None = None) -> DataSettings:
        """The `data` section, checked and defaulted by the schema (every problem at once)."""
        loaded = load_settings(merge_settings(settings, runtime or {}), ["data"], DataError)
        data = loaded["data"]
        names = [f.name for f in fields(cls) if f.name != "trust_remote_code"]
        return cls(**{n: data[n] for n in names}, trust_remote_code=loaded["trust_remote_code"])

    @property
    def mask(self) -> MaskSettings:
        return MaskSettings(self.mask_mode, self.train_reasoning)


@dataclass(frozen=True)
class VocabSettings:
    """What `eyrie vocab` reads: how many target ids the draft's lm_head predicts."""

    draft_vocab_size: int

    READS: ClassVar[tuple[str, ...]] = ("vocab.draft_vocab_size",)

    @classmethod
    def from_settings(cls, settings: dict, runtime: dict | None = None) -> VocabSettings:
        """The `vocab` section, checked and defaulted by the schema."""
        vocab = load_settings(merge_settings(settings, runtime or {}), ["vocab"], VocabError)
        return cls(vocab["vocab"]["draft_vocab_size"])


@dataclass(frozen=True)
class PromptSettings:
    """What `eyrie eval-prompts` reads: the template switches and trust_remote_code."""

    chat_template_kwargs: dict
    trust_remote_code: bool

    READS: ClassVar[tuple[str, ...]] = ("data.chat_template_kwargs", TRUST)

    @classmethod
    def from_settings(cls, settings: dict, runtime: dict | None = None) -> PromptSettings:
        """Checked by the schema (a reserved switch is refused, as in the dry run)."""
        loaded = load_settings(merge_settings(settings, runtime or {}), (), DataError)
        kwargs = (loaded.get("data") or {}).get("chat_template_kwargs")
        return cls(kwargs or {}, loaded["trust_remote_code"])


@dataclass(frozen=True)
class EvalSettings:
    """The `eval` section as `eyrie evaluate` reads it, the device and dtype resolved."""

    K: int
    max_new_tokens: int
    num_prompts: int
    device: str  # resolved: cpu | cuda
    dtype: str  # resolved: float32 | bfloat16 | float16, the target's and the draft's
    temperature: float  # > 0: also decoded by speculative sampling at it

    READS: ClassVar[tuple[str, ...]] = (
        "eval.num_speculative_tokens",
        "eval.max_new_tokens",
        "eval.num_prompts",
        "eval.device",
        "eval.dtype",
        "eval.temperature",
    )

    @classmethod
    def from_settings(cls, settings: dict, runtime: dict | None = None) -> EvalSettings:
        """The eval settings, checked by the schema (every problem at once, each naming its
        key), with the device resolved."""
        loaded = load_settings(merge_settings(settings, runtime or {}), ["eval"], EvaluateError)
        ev = loaded["eval"]
        device = auto_device("eval.device", ev["device"], EvaluateError)
        dtype = auto_dtype(ev["dtype"], device)
        return cls(
            ev["num_speculative_tokens"],
            ev["max_new_tokens"],
            ev["num_prompts"],
            device,
            dtype,
            float(ev["temperature"]),
        )


@dataclass(frozen=True)
class VllmEvalSettings:
    """The eval settings `eyrie evaluate-vllm` reads, and the vllm section."""

    K: int
    max_new_tokens: int
    num_prompts: int
    vllm: VllmSettings  # vllm.max_model_len None: longest prompt + max_new_tokens + K
    temperature: float = 0.0  # > 0: the speculative engine also samples every prompt at it

    READS: ClassVar[tuple[str, ...]] = (
        "eval.num_speculative_tokens",
        "eval.max_new_tokens",
        "eval.num_prompts",
        "eval.temperature",
        *ENGINE_KEYS,
        "vllm.rehearsal",
    )

    @property
    def rehearsal(self) -> bool:
        """vllm.rehearsal: the target with random weights (docs/rehearsal.md)."""
        return self.vllm.rehearsal

    @classmethod
    def from_settings(cls, settings: dict, runtime: dict | None = None) -> VllmEvalSettings:
        """The eval and vllm settings, checked by the schema (every problem at once, each naming
        its key); `runtime`'s vllm.gpu_memory_utilization is the workflow's (not compared)."""
        merged = merge_settings(settings, runtime or {})
        loaded, vllm = load_with_vllm(merged, ["eval"], EvaluateError)
        ev = loaded["eval"]
        return cls(
            ev["num_speculative_tokens"],
            ev["max_new_tokens"],
            ev["num_prompts"],
            vllm,
            float(ev["temperature"]),
        )


@dataclass(frozen=True)
class PreflightSettings:
    """What `eyrie preflight` reads: the layers to extract, their storage, the tokenizer's
    switches, and what vLLM is used for (its checks read `checked`'s eval and vllm sections)."""

    aux_ids: list[int] | None
    storage_dtype: str
    trust_remote_code: bool
    chat_template_kwargs: dict | None
    rehearsal: bool
    vllm_uses: list[str]  # eyrie.config.schema.vllm_uses: "extract", "eval"
    regenerate_vllm: bool  # regenerate.backend: vllm: the vLLM environment is checked
    checked: dict  # the settings checked and defaulted (eyrie.preflight.vllm_checks reads them)

    # preflight and preflight_regenerate (the same checks before regeneration) between them
    READS: ClassVar[tuple[str, ...]] = (
        "layers.aux_ids",
        "extract.storage_dtype",
        "extract.backend",
        TRUST,
        "data.chat_template_kwargs",
        "regenerate.backend",
        "eval.vllm",
        "eval.num_speculative_tokens",
        "eval.max_new_tokens",
        "vllm.python",
        "vllm.extraction_path",
        "vllm.tensor_parallel_size",
        "vllm.gpu_memory_gib",
        "vllm.gpu_memory_utilization",
        "vllm.max_model_len",
        "vllm.max_num_batched_tokens",
        "vllm.rehearsal",
    )

    @classmethod
    def from_settings(cls, settings: dict, runtime: dict | None = None) -> PreflightSettings:
        """The settings and runtime merged, checked by the schema (every problem at once)."""
        loaded = load_settings(merge_settings(settings, runtime or {}), (), PreflightError)
        extract = loaded.get("extract") or {}
        return cls(
            aux_ids=(loaded.get("layers") or {}).get("aux_ids"),
            storage_dtype=extract.get("storage_dtype", schema_default("extract.storage_dtype")),
            trust_remote_code=loaded["trust_remote_code"],
            chat_template_kwargs=(loaded.get("data") or {}).get("chat_template_kwargs"),
            rehearsal=is_rehearsal(loaded),
            vllm_uses=vllm_uses(loaded),
            regenerate_vllm=(loaded.get("regenerate") or {}).get("backend") == "vllm",
            checked=loaded,
        )
