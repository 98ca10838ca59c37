"""How the training loop drives each kind of draft: EAGLE-3 (one token per draft forward, K
forwards chained within a step: speculators' test-time training) and the block drafters
(DFlash, DSpark: a block of tokens from one forward). A kind gives the number of drafted
tokens a step's metrics count (`positions`), the model's extra forward arguments (`call`) and
its per-position figures in eyrie's pack sums (`sums`): [loss, loss_k.., acc_sum_k..,
acc_total_k..], k the k-th drafted token. EAGLE-3's TTT step k and a block's k-th predicted
position are the same thing, the draft's k-th token, so one record serves both;
the block drafters have no per-position loss (NaN sums, None in the records).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eyrie.arch.methods import BLOCK_METHODS

# anchors per pack whose blocks a block drafter predicts in one forward (speculators' DFlash
# default; its DSpark's is 3072 for its longer packs)
MAX_ANCHORS = 512


@dataclass(frozen=True)
class DraftKind:
    """One draft method as the step calls it (see the module)."""

    method: str
    positions: int  # drafted tokens per draft pass that the metrics count (K)
    call: dict = field(default_factory=dict)  # the forward's arguments besides the batch
    first: int = 0  # block drafters: the block position of the first drafted token

    def sums(self, loss: torch.Tensor, metrics: dict) -> torch.Tensor:
        """One pack's additive device-side metrics, float64 [1 + 3K] (see the module)."""
        K = range(self.positions)
        if self.method in BLOCK_METHODS:
            pos = [f"position_{self.first + k}_acc" for k in K]
            losses = [torch.tensor(float("nan"))] * self.positions
        else:
            pos = [f"full_acc_{k}" for k in K]
            losses = [metrics[f"loss_{k}_sum"] for k in K]
        values = [
            loss,
            *losses,
            *(metrics[f"{p}_sum"] for p in pos),
            *(metrics[f"{p}_total"] for p in pos),
        ]
        device = torch.as_tensor(loss).device
        return torch.stack(
            [torch.as_tensor(v).detach().to(device=device, dtype=torch.float64) for v in values]
        )


def eagle3_kind(ttt_steps: int, ttt_step_loss_decay: float, loss_config) -> DraftKind:
    """EAGLE-3: `ttt_steps` chained forwards, each drafting one token."""
    call = dict(
        ttt_steps=ttt_steps, ttt_step_loss_decay=ttt_step_loss_decay, loss_config=loss_config
    )
    return DraftKind("eagle3", ttt_steps, call)


def block_kind(model, loss: str, max_anchors: int = MAX_ANCHORS) -> DraftKind:
    """A block drafter built by speculators (eyrie.arch.draft): its own training arguments for
    the loss spec `loss` (eager implementation, as eyrie's EAGLE-3 loss), and the block
    positions it drafts: all of them when it samples from the block's anchor (DSpark's
    default), else all but the anchor."""
    config = model.config
    call, _ = type(model).get_trainer_kwargs(
        loss_fn=loss, loss_implementation="eager", max_anchors=max_anchors
    )
    first = 0 if config.sample_from_anchor else 1
    return DraftKind(config.speculators_model_type, config.block_size - first, call, first)
