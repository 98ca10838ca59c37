"""The draft as training holds it: on this process's device, with its AdamW optimizer, its learning
rate schedule and its loss, and under several processes wrapped in DDP or sharded (FSDP2).

Contract: built from the typed `train` section and the preflight report's expectations alone, so
every rank builds the same draft (the seed is `train.seed`); the schedule is linear warmup, then
cosine, linear or constant (`lr_factor`). Precision and DDP: docs/training.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from eyrie.config.sections import TrainSettings
from eyrie.core.errors import EyrieError
from eyrie.core.runtime import auto_device
from eyrie.train.kinds import DraftKind, block_kind, eagle3_kind
from eyrie.train.launch import Dist


@dataclass
class Trainable:
    """The draft and what updates it: the trained parameters, AdamW, the LR schedule, the loss."""

    model: torch.nn.Module
    params: list[torch.nn.Parameter]  # those with requires_grad (not the frozen embeddings/head)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    kind: DraftKind  # how the step calls it and reads its metrics (eyrie.train.kinds)


def build_trainable(
    target: Path,
    layers: list[int],
    cfg: TrainSettings,
    vocab: tuple[torch.Tensor, torch.Tensor],
    total_steps: int,
    device: torch.device,
    rehearsal: bool,
    world: int = 1,
) -> Trainable:
    """The draft on `device` reading the target `layers` (`vocab`: d2t, t2d), its AdamW
    optimizer, LR schedule and loss; with train.fsdp and `world` > 1 processes, sharded
    (eyrie.train.sharding) before the optimizer is made on its shards."""
    from speculators.losses import resolve_loss_config

    from eyrie.arch.draft import DraftSpec, build_draft

    # speculators' flex attention on a GPU (a block mask over the packed documents and TTT
    # steps); FlexAttention has no backward on a CPU, where sdpa stays.
    spec = DraftSpec(
        layers,
        num_layers=cfg.num_layers,
        draft_arch=cfg.draft_arch,
        norm_before_residual=cfg.norm_before_residual,
        norm_before_fc=cfg.norm_before_fc,
        ttt_steps=cfg.ttt_steps,
        attn_impl="simple_flex_attention" if device.type == "cuda" else "sdpa",
        random_verifier=rehearsal,  # the target's weights need not be on disk yet
        method=cfg.method,
        block_size=cfg.block_size,
        mask_token_id=block_mask_token(target, cfg, int(vocab[1].shape[0])),
        sample_from_anchor=cfg.sample_from_anchor,
    )
    model = build_draft(target, spec, *vocab, seed=cfg.seed, device=device).to(device)
    model.train()
    if cfg.fsdp and world > 1:  # every rank built the same draft: each keeps its shards
        from eyrie.train.sharding import shard

        shard(model, device, world, layers_apart=cfg.block)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, total_steps, cfg.lr_schedule)
    )
    if cfg.block:
        kind = block_kind(model, cfg.loss)
    else:
        loss = resolve_loss_config(cfg.loss, "eager")
        kind = eagle3_kind(cfg.ttt_steps, cfg.ttt_step_loss_decay, loss)
    if kind.positions != cfg.positions:  # one count of drafted tokens for records and export
        raise EyrieError(
            f"the {cfg.method} draft proposes {kind.positions} tokens per pass but the settings "
            f"give {cfg.positions}: speculators changed its block convention"
        )
    return Trainable(model, params, optimizer, scheduler, kind)


def block_mask_token(target: Path, cfg: TrainSettings, vocab_size: int) -> int | None:
    """A block drafter's mask id: train.mask_token_id, else the target tokenizer's choice
    (eyrie.arch.draft.mask_token); None for EAGLE-3."""
    from transformers import AutoTokenizer

    from eyrie.arch.draft import mask_token

    if not cfg.block:
        return None
    if cfg.mask_token_id is None:
        return mask_token(AutoTokenizer.from_pretrained(str(target)), vocab_size, str(target))
    if cfg.mask_token_id >= vocab_size:
        raise EyrieError(
            f"train.mask_token_id {cfg.mask_token_id} is past the target's {vocab_size} "
            "embedding rows; give an id below it (a reserved special token), or null"
        )
    return cfg.mask_token_id


def wrap_ddp(model: torch.nn.Module, dist: Dist, device: torch.device) -> torch.nn.Module:
    """The module the steps call: the draft, or under several processes its DDP wrapper
    (made after loading: DDP starts from rank 0's, identical, weights); a sharded draft
    (train.fsdp) is called as it is."""
    from eyrie.train.sharding import is_sharded

    if dist.world <= 1 or is_sharded(model):
        return model
    from torch.nn.parallel import DistributedDataParallel

    # Unsplit at DDP's bucket boundaries the compiled draft fuses as in one process, so the
    # weights equal one process's (docs/training.md).
    torch._dynamo.config.optimize_ddp = False
    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )


def resolve_device(name: str, dist: Dist | None = None) -> torch.device:
    """cpu, or this process's GPU (cuda:LOCAL_RANK) when CUDA is asked for or `auto` finds it."""
    dist = dist or Dist()
    if auto_device("train.device", name, EyrieError) == "cpu":
        return torch.device("cpu")
    if dist.local_world > torch.cuda.device_count():
        raise EyrieError(
            f"{dist.local_world} processes on this node but {torch.cuda.device_count()} "
            "GPU(s) visible (CUDA_VISIBLE_DEVICES); use --nproc-per-node <= GPUs per node"
        )
    torch.cuda.set_device(dist.local_rank)
    return torch.device("cuda", dist.local_rank)


def lr_factor(step: int, warmup: int, total: int, schedule: str = "cosine") -> float:
    """Linear warmup over `warmup` steps, then `schedule`: cosine or linear decay to 0 at
    `total`, or constant."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))
