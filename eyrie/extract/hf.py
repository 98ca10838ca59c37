"""Extraction backend "hf": a Hugging Face transformers forward of the target's base model (no
lm_head) with hooks that capture the residual stream in vLLM layer-id semantics
(eyrie.arch.hooks). Samples run in length-sorted, right-padded batches (`plan_batches`); on a
CPU each batch is yielded as a HostBatch, on a GPU it is cast and checked on the device and
staged into pinned buffers (StagedBatch). docs/shard-format.md ("Extraction").
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from eyrie.arch.loader import load_causal_lm
from eyrie.arch.target import TargetInfo
from eyrie.core.errors import ExtractError
from eyrie.extract.batches import HostBatch, PinnedStaging, StoredBatch, plan_batches

if TYPE_CHECKING:
    import torch

    from eyrie.config.sections import ExtractSettings

log = logging.getLogger(__name__)


def forward_batch(
    model, batch: list[np.ndarray], aux_ids: list[int], final_id: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """One right-padded batch through the target's base model: (aux [B, T_max, n_aux*H],
    final [B, T_max, H]) on the device in the compute dtype; rows past T_b are padding."""
    import torch

    from eyrie.arch.hooks import capture_hidden_states

    T = max(len(x) for x in batch)
    ids = torch.zeros(len(batch), T, dtype=torch.long)  # [B, T] int64
    mask = torch.zeros(len(batch), T, dtype=torch.long)  # [B, T] 1 = real token
    for b, x in enumerate(batch):
        ids[b, : len(x)] = torch.from_numpy(x.astype(np.int64))
        mask[b, : len(x)] = 1
    ids, mask = ids.to(device), mask.to(device)
    with capture_hidden_states(model, aux_ids + [final_id]) as captured:
        # The base model runs every decoder layer and the final norm but not the lm_head.
        model.base_model(input_ids=ids, attention_mask=mask, use_cache=False)
    missing = [k for k in aux_ids + [final_id] if k not in captured]
    if missing:
        raise ExtractError(
            f"layer id {missing[0]} was not captured by the forward pass of "
            f"{type(model).__name__}; its architecture entry in eyrie.arch.registry is wrong"
        )
    return torch.cat([captured[k] for k in aux_ids], dim=-1), captured[final_id]


def real_rows(lengths: list[int], T: int) -> np.ndarray:
    """Flat indices [sum(lengths)] of the real tokens of a right-padded [B, T] batch."""
    return np.concatenate([b * T + np.arange(n) for b, n in enumerate(lengths)]).astype(np.int64)


class HFBackend:
    """Hugging Face transformers forward with capture hooks; length-sorted padded batches."""

    staging: PinnedStaging | None = None  # on a GPU: made at the first shard, kept for the others

    def __init__(
        self,
        target: Path,
        info: TargetInfo,
        cfg: ExtractSettings,
        aux_ids: list[int],
        final_id: int,
    ):
        self.cfg, self.aux_ids, self.final_id = cfg, list(aux_ids), final_id
        self.model = load_causal_lm(
            target, cfg.device, cfg.dtype, cfg.trust_remote_code, ExtractError
        )

    def states(self, input_ids: list[np.ndarray], storage: torch.dtype) -> Iterator[StoredBatch]:
        import torch

        lengths = [len(x) for x in input_ids]
        batches = self._plan(lengths)
        if self.cfg.device == "cuda" and self.staging is None:  # one set of buffers per load
            self.staging = PinnedStaging()
        waited = self.staging.wait_s if self.staging is not None else 0.0
        for batch in batches:
            with torch.inference_mode():  # not held across the yield (it is thread-global state)
                if self.staging is None:
                    item = self._host_batch(input_ids, batch, storage)
                else:
                    item = self._staged_batch(input_ids, batch)
            yield item
        if self.staging is not None and self.staging.wait_s - waited > 1.0:
            log.info(
                "hf: waited %.1f s for the writer to free a pinned buffer",
                self.staging.wait_s - waited,
            )

    def _plan(self, lengths: list[int]) -> list[list[int]]:
        cfg = self.cfg
        batches = plan_batches(lengths, cfg.max_tokens_per_batch)
        too_long = sum(1 for b in batches if lengths[b[0]] > cfg.max_tokens_per_batch)
        if too_long:
            log.warning(
                "%d samples are longer than extract.max_tokens_per_batch=%d; each runs alone",
                too_long,
                cfg.max_tokens_per_batch,
            )
        log.info(
            "hf: %d batches (<= %d padded tokens), %s on %s",
            len(batches),
            cfg.max_tokens_per_batch,
            cfg.dtype,
            cfg.device,
        )
        return batches

    def _host_batch(
        self, input_ids: list[np.ndarray], batch: list[int], storage: torch.dtype
    ) -> HostBatch:
        """One batch on the host in the `storage` dtype; padding rows dropped (views)."""
        ids = [input_ids[i] for i in batch]
        aux, final = forward_batch(self.model, ids, self.aux_ids, self.final_id, self.cfg.device)
        aux, final = aux.to(storage).to("cpu"), final.to(storage).to("cpu")
        return HostBatch(
            batch,
            [aux[b, : len(x)] for b, x in enumerate(ids)],  # [T_i, n_aux*H] per sample
            [final[b, : len(x)] for b, x in enumerate(ids)],  # [T_i, H] per sample
        )

    def _staged_batch(self, input_ids: list[np.ndarray], batch: list[int]) -> StoredBatch:
        """One batch's real rows, stored representation made on the GPU, copied without
        blocking into a pinned buffer."""
        import torch

        from eyrie.formats.codecs import stored_tensors

        ids = [input_ids[i] for i in batch]
        aux, final = forward_batch(self.model, ids, self.aux_ids, self.final_id, self.cfg.device)
        lens = [len(x) for x in ids]
        idx = torch.from_numpy(real_rows(lens, aux.shape[1])).to(self.cfg.device)
        stored, bad = stored_tensors(
            aux.flatten(0, 1).index_select(0, idx),
            final.flatten(0, 1).index_select(0, idx),
            self.cfg.storage_dtype,
        )
        del aux, final  # the copies are queued next: the device memory can go
        return self.staging.stage(batch, lens, stored, bad)

    def close(self) -> None:
        import torch

        self.model = self.staging = None
        if self.cfg.device == "cuda":
            torch.cuda.empty_cache()
