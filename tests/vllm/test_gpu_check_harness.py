"""The GPU check's harness (tests/support/vllm_gpu_check.py) on the CPU: what it reads from a
backend's batches is what the stage writes. Nothing on the CPU runs the harness otherwise, and it
broke twice unseen (the typed settings, then the batch classes). The backend here is a stand-in
yielding the real batch classes (HostBatch, StagedBatch), with known values per layer."""

from __future__ import annotations

import numpy as np
import torch

from eyrie.extract.batches import HostBatch, StagedBatch
from eyrie.formats.codecs import stored_arrays
from tests.support.vllm_gpu_check import through_a_shard

H = 4
IDS = [1, 2, 3]  # two aux layers + the final one


def states(T: int, sample: int) -> tuple[torch.Tensor, torch.Tensor]:
    """aux [T, 2H] whose layer j holds sample*10 + j, final [T, H] holding sample*10 + 9."""
    aux = torch.cat([torch.full((T, H), sample * 10.0 + j) for j in range(len(IDS) - 1)], dim=1)
    return aux.bfloat16(), torch.full((T, H), sample * 10.0 + 9).bfloat16()


class StandInBackend:
    """A backend's interface as vllm_gpu_check uses it: layer_ids, H, states(), close()."""

    layer_ids, H = IDS, H

    def __init__(self):
        self.closed = False

    def states(self, prompts, dtype):
        host = [states(len(prompts[i]), i) for i in (1, 0)]
        yield HostBatch([1, 0], [a for a, _ in host], [f for _, f in host])
        rows = [stored_arrays(*states(len(prompts[2]), 2), "bfloat16")]
        yield StagedBatch(
            batch=[2],
            lengths=[len(prompts[2])],
            rows=rows,
            bad=np.zeros(1, dtype=bool),
            done=None,
            free=lambda: None,
        )

    def close(self):
        self.closed = True


def test_every_batch_kind_is_read_back_as_stored(tmp_path):
    prompts = [np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int32), np.arange(4)]
    backend = StandInBackend()
    got = through_a_shard(tmp_path, "standin", backend, prompts)
    assert backend.closed and len(got) == 3
    for i, (aux, final) in enumerate(got):
        T = len(prompts[i])
        assert aux.shape == (T, 2 * H) and final.shape == (T, H)
        for j in range(2):
            assert torch.equal(aux[:, j * H : (j + 1) * H], torch.full((T, H), i * 10.0 + j))
        assert torch.equal(final, torch.full((T, H), i * 10.0 + 9))
