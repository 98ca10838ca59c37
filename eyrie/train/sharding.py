"""Sharded training (train.fsdp): the draft's parameters, gradients and AdamW state split over
the processes with FSDP2 (`torch.distributed.fsdp.fully_shard`) instead of replicated (DDP).

Contract: a sharded run reads and writes the checkpoints and outputs of a replicated one (whole
tensors, the optimizer state keyed by parameter index), so a run resumes across the two and
across process counts; `full_states` gathers them (every rank calls it), `load_full` hands a
checkpoint's whole tensors to the shards. A block drafter's decoder layers are sharded one by one
(each runs once per forward, so one layer's weights are gathered at a time); EAGLE-3's run
ttt_steps times per forward, so its draft is one unit. docs/training.md#sharded-training-fsdp2.
"""

from __future__ import annotations

import torch


def shard(model: torch.nn.Module, device: torch.device, world: int, layers_apart: bool) -> None:
    """Shard `model` in place over the `world` processes of the default group (before its
    optimizer is made: fully_shard replaces the parameters with their shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    if layers_apart:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model`'s parameters are FSDP2 shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def whole(t: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """A tensor as a whole on the CPU where `keep` (rank 0), else None: a DTensor gathered
    from every rank (a collective: every rank calls it, in the same order), a plain tensor as
    it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()  # one tensor at a time on the device, then dropped where not kept
    return t.detach().cpu() if keep else None


def full_states(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    keep: bool,
    skip: frozenset[str] = frozenset(),
) -> tuple[dict, dict | None]:
    """(the draft's state_dict without `skip`, the optimizer's state_dict) with whole tensors:
    what model.state_dict() and optimizer.state_dict() give in one process. Every rank calls
    it; where `keep` is false (ranks but 0) the dicts are empty, so no host holds more than one
    whole copy."""
    weights = {k: whole(v, keep) for k, v in model.state_dict().items() if k not in skip}
    if optimizer is None:
        return (weights if keep else {}), None
    state = optimizer.state_dict()
    moments = {
        i: {name: whole(v, keep) if torch.is_tensor(v) else v for name, v in s.items()}
        for i, s in sorted(state["state"].items())
    }
    if not keep:
        return {}, {}
    return weights, {**state, "state": moments}


def load_full(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict | None,
) -> None:
    """Hand whole tensors (a checkpoint's; `weights` may leave out the frozen ones) to the
    shards of `model` and, when given, of `optimizer`'s state (keyed by parameter index)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def local(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        full = full.to(device=like.device, dtype=like.dtype)
        if isinstance(like, DTensor):  # every rank holds the whole tensor: no communication
            return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
        return full

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, full in weights.items():
            target = params.get(name)
            if target is None:  # a buffer (d2t, t2d): a plain tensor in every rank
                model.get_buffer(name).copy_(full)
            else:
                target.copy_(local(full, target))
    if optimizer_state is None:
        return
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    moments = {}
    for i, s in optimizer_state["state"].items():
        p = trained[int(i)]
        moments[i] = {
            k: local(v, p) if torch.is_tensor(v) and v.shape == p.shape else v for k, v in s.items()
        }
    optimizer.load_state_dict({**optimizer_state, "state": moments})
