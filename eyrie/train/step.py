"""One optimizer step over this rank's packs: the batches copied to the device, forward and backward
of each pack (the loss of a step is the mean over its packs), the gradient clipped, AdamW and the
schedule stepped.

Contract: a step returns its device-side sums (the draft kind's `sums`, eyrie.train.kinds, over
every rank's packs) and gradient
norm without waiting for the device; the host reads them at log and checkpoint steps only. Under
DDP the gradients are averaged over ranks at the backward of a rank's last pack. Steps and
precision: docs/training.md.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from eyrie.config.sections import TrainSettings
from eyrie.train.launch import Dist
from eyrie.train.model import Trainable
from eyrie.train.packing import Prefetcher, decode_batch


@dataclass
class Stepper:
    """What a step needs: the draft and its optimizer, the module the step calls (`net`: the
    draft or its DDP wrapper), the device, and this rank's share `k` of each step's packs."""

    cfg: TrainSettings
    draft: Trainable
    net: torch.nn.Module
    device: torch.device
    dist: Dist
    k: int  # packs of each step that this rank trains
    bf16: bool  # bfloat16 autocast (weights and optimizer state stay float32)
    copy_stream: "torch.cuda.Stream | None"  # host-to-device copies on a GPU

    def stage(self, loader: Prefetcher) -> tuple[list[dict], float]:
        """The next step's batches, copies to the device under way; seconds blocked."""
        t = time.perf_counter()
        batches = [_to_device(b, self.device, self.copy_stream) for b in loader.get()]
        return batches, time.perf_counter() - t

    def step(self, batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over this rank's packs: (summed pack metrics, gradient norm)."""
        draft = self.draft
        if self.device.type == "cuda":  # the copies (on copy_stream) complete before it reads
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.copy_stream)
            for b in batches:
                for v in b.values():
                    v.record_stream(current)
        draft.optimizer.zero_grad(set_to_none=True)
        K = self.draft.kind.positions
        sums = torch.zeros(1 + 3 * K, dtype=torch.float64, device=self.device)
        for j, batch in enumerate(batches):
            sums += self._pack_step(j, batch)
        self.dist.all_sum(sums)
        grad_norm = torch.nn.utils.clip_grad_norm_(draft.params, self.cfg.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # a sharded draft's (DTensor): the same on each rank
            grad_norm = grad_norm.full_tensor()
        draft.optimizer.step()
        draft.scheduler.step()
        return sums, grad_norm

    def _pack_step(self, j: int, batch: dict) -> torch.Tensor:
        """Forward and backward of this rank's pack j; its additive metrics."""
        cfg, net = self.cfg, self.net
        batch = decode_batch(batch)  # float8 codes (GPU transfers) to float32, on the device
        if not self.bf16:  # under bfloat16 autocast the layers take the stored bf16 as it is
            batch = {n: (v.float() if v.is_floating_point() else v) for n, v in batch.items()}
        if cfg.hidden_noise:  # the draft's input only; the target's distribution stays exact
            batch["hidden_states"] = add_hidden_noise(
                batch["hidden_states"],
                cfg.hidden_noise,
                batch["verifier_last_hidden_states"].shape[-1],
            )
        # DDP averages gradients over ranks at the backward of a rank's last pack only; a
        # sharded draft (FSDP2) reduce-scatters them then
        last = j == self.k - 1
        if hasattr(net, "set_requires_gradient_sync"):
            net.set_requires_gradient_sync(last)
        sync = net is self.draft.model or last
        with (
            contextlib.nullcontext() if sync else net.no_sync(),
            torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16),
        ):
            _, loss, metrics = net(**batch, **self.draft.kind.call)
            (loss / self.k if self.k > 1 else loss).backward()
        return self.draft.kind.sums(loss, metrics)


def add_hidden_noise(states: torch.Tensor, scale: float, width: int) -> torch.Tensor:
    """`states` [..., n * width] plus Gaussian noise of `scale` times the RMS of each row of each
    layer (of `width` values): the draft learns from states that vary a little, as its own
    drafted states do at inference. The RMS is computed without a gradient."""
    rows = states.unflatten(-1, (-1, width))
    rms = rows.detach().float().pow(2).mean(-1, keepdim=True).sqrt().to(states.dtype)
    return (rows + torch.randn_like(rows) * (scale * rms)).flatten(-2)


def _to_device(
    batch: dict[str, torch.Tensor], device: torch.device, stream: "torch.cuda.Stream | None"
) -> dict[str, torch.Tensor]:
    """A host batch (pinned for CUDA) copied to the device on `stream`, without waiting."""
    if device.type != "cuda":
        return batch
    with torch.cuda.stream(stream):
        return {n: v.to(device, non_blocking=True) for n, v in batch.items()}
