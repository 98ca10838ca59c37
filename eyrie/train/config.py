"""eyrie.train.config: TODO docstring."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

from eyrie.errors import EyrieError

log = logging.getLogger(__name__)


# Settings that do not change the trained weights (left out of the run id).
NOT_IN_RUN_ID = ("log_every", "checkpoint_every", "verify_shards")


KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


PRECISIONS = ("auto", "float32", "bfloat16")


PACK_SHAPES = ("auto", "fixed", "exact")


@dataclass(frozen=True)
class TrainSettings:
    seed: int = 0
    device: str = "auto"
    epochs: int = 6
    learning_rate: float = 3.0e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_grad_norm: float = 1.0
    max_tokens_per_batch: int = 2048
    packs_per_step: int = 1
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    num_layers: int = 1
    draft_arch: str = "llama"
    precision: str = "auto"  # auto: bfloat16 autocast on a GPU, float32 on a CPU
    pack_shape: str = "auto"  # auto: fixed on a GPU (one compiled shape), exact on a CPU
    norm_before_residual: bool = True
    checkpoint_every: int = 100
    log_every: int = 10
    verify_shards: bool = True

    @classmethod
    def from_settings(cls, settings: dict) -> "TrainSettings":
        """Typed `train` section of --settings; every problem reported at once, each by key."""
        section = settings.get("train")
        if not isinstance(section, dict):
            raise EyrieError(
                '--settings: missing object "train" (pass {"train": {...}} from config.yaml)'
            )
        fields = {f.name: f for f in dataclasses.fields(cls)}
        problems = [
            f"train.{k}: unknown key (allowed: {', '.join(fields)})"
            for k in section
            if k not in fields
        ]
        for name, value in section.items():
            if name not in fields:
                continue
            kind = type(fields[name].default)
            ok = (
                isinstance(value, bool)
                if kind is bool
                else (
                    isinstance(value, (int, float)) and not isinstance(value, bool)
                    if kind is float
                    else isinstance(value, kind) and not isinstance(value, bool)
                )
            )
            if not ok:
                problems.append(f"train.{name}: {value!r} must be {KIND_NAMES[kind]}")
        if not problems:
            cfg = cls(
                **{
                    k: (float(v) if type(fields[k].default) is float else v)
                    for k, v in section.items()
                }
            )
            rules = [
                (cfg.device in ("auto", "cpu", "cuda"), "device: use auto, cpu or cuda"),
                (cfg.draft_arch in ("llama", "qwen3"), "draft_arch: use llama or qwen3"),
                (cfg.precision in PRECISIONS, f"precision: use {', '.join(PRECISIONS)}"),
                (cfg.pack_shape in PACK_SHAPES, f"pack_shape: use {', '.join(PACK_SHAPES)}"),
                (cfg.ttt_steps >= 1, "ttt_steps: must be >= 1"),
                (cfg.epochs >= 1, "epochs: must be >= 1"),
                (cfg.num_layers >= 1, "num_layers: must be >= 1"),
                (cfg.packs_per_step >= 1, "packs_per_step: must be >= 1"),
                (cfg.learning_rate > 0, "learning_rate: must be > 0"),
                (cfg.max_grad_norm > 0, "max_grad_norm: must be > 0"),
                (cfg.ttt_step_loss_decay > 0, "ttt_step_loss_decay: must be > 0"),
                (
                    cfg.warmup_steps >= 0 and cfg.weight_decay >= 0,
                    "warmup_steps/weight_decay: must be >= 0",
                ),
                (
                    cfg.checkpoint_every >= 1 and cfg.log_every >= 1,
                    "checkpoint_every/log_every: must be >= 1",
                ),
                (
                    cfg.max_tokens_per_batch >= 8 * cfg.ttt_steps,
                    f"max_tokens_per_batch: {cfg.max_tokens_per_batch} is too small for ttt_steps="
                    f"{cfg.ttt_steps} (use at least {8 * cfg.ttt_steps})",
                ),
            ]
            problems += [f"train.{msg}" for ok, msg in rules if not ok]
        if problems:
            raise EyrieError("invalid train settings: " + "; ".join(problems))
        return cfg


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
