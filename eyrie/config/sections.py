"""Typed config sections: `train` (the training settings), `vllm` (every vLLM engine's) and
`regenerate` (the regeneration stage's) and `extract` (the extraction stage's, with `layers`),
each a frozen object built as every stage's is (eyrie.config.stages):
`<Stage>Settings.from_settings(settings, runtime)`, `READS` the dotted keys it reads.

config/schema.yaml checks types, ranges and defaults, and eyrie.config.schema.load_settings the
cross-field rules (the dry run's); this module resolves the autos. TrainSettings' fields in order
make the run id (docs/training.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from eyrie.config.drafts import block_positions
from eyrie.config.schema import (
    added_later,
    flag_problems,
    load_settings,
    merge_settings,
    schema_default,
)
from eyrie.core.errors import ConfigError, DataError, ExtractError, EyrieError
from eyrie.core.runtime import auto_device, auto_dtype

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


# Settings that do not change the trained weights (left out of the run id).
NOT_IN_RUN_ID = ("log_every", "checkpoint_every", "verify_shards", "report_to", "fsdp")
# train.learning_rate: auto: AdamW's peak rate for a draft of the target's width, lr = REF_LR x
# (REF_HIDDEN / hidden) ** LR_WIDTH_EXPONENT (REF_LR up to REF_HIDDEN), to one digit. Through the
# two measured optima: 3e-3 at hidden 128 (the demo) and 1e-3 at hidden 512 (the larger target,
# where 3e-3 trained a draft of 0.57x the AL). BENCHMARKS.md "Learning rate and width".
REF_HIDDEN, REF_LR, LR_WIDTH_EXPONENT = 128, 3.0e-3, 0.8


def implied_before() -> dict:
    """Settings added after runs recorded their run ids (the schema's `added: true`), with the
    value those runs trained with (the default): left out of the run id at that value, so that
    their checkpoints still resume."""
    names = [f.name for f in dataclasses.fields(TrainSettings)]
    return {
        n: schema_default(f"train.{n}")
        for n in names
        if n not in NOT_IN_RUN_ID and added_later(f"train.{n}")
    }


@dataclass(frozen=True)
class TrainSettings:
    """The `train` section; config/schema.yaml checks and defaults it (field order: run id)."""

    seed: int
    device: str
    epochs: int
    learning_rate: float | str  # "auto" until resolved_for(hidden_size)
    weight_decay: float
    warmup_steps: int
    max_grad_norm: float
    max_tokens_per_batch: int
    packs_per_step: int
    ttt_steps: int
    ttt_step_loss_decay: float
    loss: str  # speculators' loss spec: a name or a JSON object of name: weight (loss_spec)
    lr_schedule: str  # after the warmup: cosine or linear decay to 0, or constant
    hidden_noise: float  # Gaussian noise on the draft's input states, x RMS of each row
    norm_before_fc: bool  # one RMSNorm over the concatenated target states before fc
    num_layers: int
    draft_arch: str
    precision: str  # auto: bfloat16 autocast on a GPU, float32 on a CPU
    pack_shape: str  # auto: fixed on a GPU (one compiled shape), exact on a CPU
    norm_before_residual: bool
    checkpoint_every: int
    log_every: int
    verify_shards: bool
    report_to: tuple[str, ...]  # where the curves go besides metrics.jsonl (eyrie.train.curves)
    method: str  # eagle3 | dflash | dspark (eyrie.arch.methods.DRAFT_METHODS)
    block_size: int  # block drafters: positions per draft forward, the anchor's included
    sample_from_anchor: bool | None  # block drafters; None: the method's own
    mask_token_id: int | None  # block drafters; None: eyrie.arch.draft.mask_token's choice
    aux_ids: tuple[int, ...] | None  # the stored layers the draft reads; None: all of them
    fsdp: bool  # several processes shard the draft and its optimizer state (eyrie.train.sharding)

    # its fields, and vllm.rehearsal (eyrie.core.rehearsal.is_rehearsal reads it beside: the fields
    # make the run id, and a rehearsal's is apart by its folders)
    READS: ClassVar[tuple[str, ...]]

    @property
    def block(self) -> bool:
        """A block drafter (a block of tokens per draft forward), not EAGLE-3."""
        return self.method != "eagle3"

    def draft_layers(self, stored: list[int], where: str) -> list[int]:
        """The target layers the draft reads: train.aux_ids, each one the shards hold
        (`stored`: their aux_layer_ids, from `where`), or all of them."""
        if self.aux_ids is None:
            return list(stored)
        missing = [i for i in self.aux_ids if i not in stored]
        if missing:
            raise EyrieError(
                f"train.aux_ids {list(self.aux_ids)}: layers {missing} are not in the shards "
                f"({where}: aux_layer_ids {list(stored)}); name layers they hold, or add them "
                "to layers.aux_ids (which extracts them again)"
            )
        return list(self.aux_ids)

    @property
    def positions(self) -> int:
        """Tokens one draft pass proposes, the K its metrics count: EAGLE-3's TTT steps, or a
        block's (eyrie.config.drafts.block_positions)."""
        if not self.block:
            return self.ttt_steps
        return block_positions(self.method, self.block_size, self.sample_from_anchor)

    @classmethod
    def from_settings(cls, settings: dict, runtime: dict | None = None) -> TrainSettings:
        """Typed `train` section of --settings (its runtime merged in; `eyrie train` has none);
        every problem reported at once, each by key."""
        merged = merge_settings(settings, runtime or {})
        section = load_settings(merged, ["train"], EyrieError)["train"]
        convert = {
            "float": float,
            "float | str": lambda v: v if v == "auto" else float(v),  # learning_rate
            "tuple[str, ...]": tuple,
            "tuple[int, ...] | None": lambda v: None if v is None else tuple(v),
        }
        if not isinstance(section["method"], str):
            raise EyrieError(
                f"invalid --settings: train.method: {section['method']}: a stage trains one kind "
                "of draft; the workflow trains each of a list (rules/train.smk)"
            )
        section = {**section, "loss": loss_spec(section["loss"])}
        return cls(
            **{
                f.name: convert.get(f.type, lambda v: v)(section[f.name])
                for f in dataclasses.fields(cls)
            }
        )

    def resolved_for(self, hidden_size: int) -> "TrainSettings":
        """These settings with learning_rate a number: `auto` resolved for a draft of width
        `hidden_size` (the target's). A resolved `auto` is the number in the run id, so a run
        whose explicit rate equals it is the same run."""
        if self.learning_rate != "auto":
            return self
        return dataclasses.replace(self, learning_rate=auto_learning_rate(hidden_size))


TrainSettings.READS = (
    *(f"train.{f.name}" for f in dataclasses.fields(TrainSettings)),
    "vllm.rehearsal",
)


def auto_learning_rate(hidden_size: int) -> float:
    """train.learning_rate: auto for a draft `hidden_size` wide (see REF_HIDDEN), to one
    significant digit: the optimum is broad (at 512, 3e-4 fell only 2-4% below 1e-3), and round
    numbers are what a user would type (one printed value, one run id)."""
    lr = REF_LR * min(1.0, REF_HIDDEN / hidden_size) ** LR_WIDTH_EXPONENT
    return float(f"{lr:.1g}")


def loss_spec(loss: str | dict) -> str:
    """train.loss as the spec speculators' resolve_loss_config takes: a loss name, or a weighted
    sum as canonical JSON (sorted names; one text per recipe, in the run id and the metrics)."""
    if isinstance(loss, str):
        return loss
    return json.dumps({name: float(w) for name, w in sorted(loss.items())})


def check_world(packs_per_step: int, world: int) -> None:
    """Every rank takes the same number of each step's packs: W must divide packs_per_step."""
    if packs_per_step % world:
        up = world * math.ceil(packs_per_step / world)
        raise EyrieError(
            f"train.packs_per_step is {packs_per_step} but the run has {world} processes "
            f"(WORLD_SIZE): each step's packs are split evenly over the processes; set "
            f"train.packs_per_step to a multiple of {world} (e.g. {up}) or start a number "
            f"of processes that divides {packs_per_step}"
        )


@dataclass(frozen=True)
class VllmSettings:
    """The `vllm` section (every vLLM engine and the preflight of vLLM); config/schema.yaml checks
    and defaults it."""

    python: str  # the vLLM environment's Python (relative: to the repository)
    extraction_path: str  # auto | native | capture (eyrie.vllm.checks.choose_path)
    tensor_parallel_size: int
    gpu_memory_gib: float  # each GPU's memory, for preflight's weight estimate
    gpu_memory_utilization: float
    enforce_eager: bool
    dtype: str  # vLLM's dtype; auto: vLLM's choice (bfloat16 for a float32 checkpoint)
    max_model_len: int | None  # None: the stage's own (the target's context, or what it needs)
    max_num_batched_tokens: int | None  # None: the stage's own (eyrie.vllm.engine.bounds)
    rehearsal: bool  # the target with random weights (eyrie.core.rehearsal, docs/rehearsal.md)

    @classmethod
    def from_section(
        cls, section: dict | None, error: type[EyrieError] = ConfigError
    ) -> VllmSettings:
        """A `vllm` section (as the config or a stage's --settings has it, in part or whole)
        checked against the schema, its defaults filled; every problem at once in one `error`."""
        return cls.of(load_settings({"vllm": section or {}}, ["vllm"], error)["vllm"])

    @classmethod
    def of(cls, section: dict) -> VllmSettings:
        """The section as load_settings returns it: already checked, its defaults filled."""
        return cls(
            **{
                f.name: float(section[f.name]) if f.type == "float" else section[f.name]
                for f in dataclasses.fields(cls)
            }
        )


def load_with_vllm(
    settings: dict, sections: Sequence[str], error: type[EyrieError]
) -> tuple[dict, VllmSettings]:
    """A vLLM stage's settings (its runtime merged in): `sections` and vllm checked by the
    schema together (every problem at once, each naming its key), with the typed vllm section."""
    loaded = load_settings(settings, [*sections, "vllm"], error)
    return loaded, VllmSettings.of(loaded["vllm"])


def vllm_runtime(
    gpu_memory_utilization: float | None, error: type[EyrieError] = ConfigError
) -> dict:
    """A stage's --gpu-memory-utilization flag as its runtime settings ({} when not given; a bad
    one an `error` naming the flag): it changes no result, so the workflow keeps it out of
    --settings (no rerun when it changes)."""
    key, flag = "vllm.gpu_memory_utilization", "--gpu-memory-utilization"
    problems = flag_problems(key, gpu_memory_utilization, flag)
    if problems:
        raise error("invalid " + "; ".join(problems))
    if gpu_memory_utilization is None:
        return {}
    return {"vllm": {"gpu_memory_utilization": float(gpu_memory_utilization)}}


# the vllm keys an engine of the target (regeneration, evaluation) reads besides the rehearsal
ENGINE_KEYS = (
    "vllm.tensor_parallel_size",
    "vllm.gpu_memory_utilization",
    "vllm.enforce_eager",
    "vllm.dtype",
    "vllm.max_model_len",
    "vllm.max_num_batched_tokens",
)


@dataclass(frozen=True)
class RegenSettings:
    """The `regenerate` section (and data.non_text, data.chat_template_kwargs,
    trust_remote_code, and the vllm section for the vllm backend), schema-checked."""

    num_shards: int
    backend: str
    device: str
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    turns: str
    thinking: str  # auto only: replaced by chat_template_kwargs, kept for finished runs' params
    batch_size: int
    non_text: str = "drop"
    trust_remote_code: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)
    vllm: VllmSettings | None = None  # the config's vllm section (regenerate-vllm's)

    READS: ClassVar[tuple[str, ...]] = (
        *(
            f"regenerate.{name}"
            for name in (
                "num_shards",
                "backend",
                "device",
                "max_new_tokens",
                "temperature",
                "top_p",
                "seed",
                "turns",
                "thinking",
                "batch_size",
            )
        ),
        "data.non_text",
        "data.chat_template_kwargs",
        "target.trust_remote_code",
        *ENGINE_KEYS,
    )

    @classmethod
    def from_settings(cls, settings: dict, runtime: dict | None = None) -> RegenSettings:
        """The stage's --settings (its runtime merged in) checked by the schema (every problem
        at once). `data` may be absent: the workflow passes data.non_text and
        data.chat_template_kwargs only when they differ from their defaults."""
        loaded = load_settings(merge_settings(settings, runtime or {}), ["regenerate"], DataError)
        data, vllm = loaded.get("data") or {}, loaded.get("vllm")
        return cls(
            **loaded["regenerate"],
            non_text=data.get("non_text", schema_default("data.non_text")),
            trust_remote_code=loaded["trust_remote_code"],
            chat_template_kwargs=data.get(
                "chat_template_kwargs", schema_default("data.chat_template_kwargs")
            ),
            vllm=VllmSettings.of(vllm) if vllm else None,
        )

    @property
    def sampled(self) -> bool:
        return self.temperature > 0


@dataclass(frozen=True)
class ExtractSettings:
    """The `extract` section with layers.aux_ids and trust_remote_code (and the vllm section
    for the vllm backend), schema-checked, the autos resolved."""

    backend: str
    device: str  # resolved: cpu | cuda
    dtype: torch.dtype  # compute dtype (resolved)
    storage_dtype: str  # bfloat16 | float16 | float32 | float8_e4m3
    max_tokens_per_batch: int
    aux_ids: list[int] | None
    trust_remote_code: bool
    # the config's vllm section (the vllm backend's; None: --settings has none)
    vllm: VllmSettings | None = None

    # the engine's and its shard jobs' (extract.engine_wait_s: the shard job's --engine-wait-s)
    READS: ClassVar[tuple[str, ...]] = (
        "extract.backend",
        "extract.device",
        "extract.dtype",
        "extract.storage_dtype",
        "extract.max_tokens_per_batch",
        "layers.aux_ids",
        "target.trust_remote_code",
        "vllm.extraction_path",
        "vllm.tensor_parallel_size",
        "vllm.gpu_memory_utilization",
        "vllm.enforce_eager",
        "vllm.max_model_len",
        "vllm.rehearsal",
    )

    @classmethod
    def from_settings(cls, settings: dict, runtime: dict | None = None) -> ExtractSettings:
        """The stage's settings (its runtime merged in), checked by the schema (every problem at
        once, each naming its key), with the autos resolved."""
        import torch

        settings = merge_settings(settings, runtime or {})

        # the vllm backend reads the config's vllm section: with it, --settings must carry one
        ext, problems = settings.get("extract"), []
        if isinstance(ext, dict) and ext.get("backend") == "vllm" and not settings.get("vllm"):
            problems.append(
                "extract.backend=vllm but --settings has no vllm section; pass the config's "
                "vllm section"
            )
        loaded = load_settings(settings, ["extract", "layers"], ExtractError, problems)
        ext, vllm = loaded["extract"], loaded.get("vllm")
        device = auto_device("extract.device", ext["device"], ExtractError)
        dtype = auto_dtype(ext["dtype"], device)
        return cls(
            backend=ext["backend"],
            device=device,
            dtype=getattr(torch, dtype),
            storage_dtype=ext["storage_dtype"],
            max_tokens_per_batch=ext["max_tokens_per_batch"],
            aux_ids=loaded["layers"]["aux_ids"],
            trust_remote_code=loaded["trust_remote_code"],
            vllm=VllmSettings.of(vllm) if vllm else None,
        )
