"""A rehearsal's random verifier rows (eyrie.arch.verifier.random_rows): the training and the
export draw them in separate processes, which may run on different numbers of threads, and must
get the same stand-in target."""

from __future__ import annotations

import torch

from eyrie.arch.verifier import ROW_BLOCK, SEED_BLOCKS, random_rows


def test_the_same_rows_whatever_the_threads():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = random_rows(2 * ROW_BLOCK + 7, 16, 0.02, seed=3)
        torch.set_num_threads(2)
        two = random_rows(2 * ROW_BLOCK + 7, 16, 0.02, seed=3)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    # each block from its own generator: block 1 is the draw of seed 3 * SEED_BLOCKS + 1
    g = torch.Generator().manual_seed(3 * SEED_BLOCKS + 1)
    block = torch.empty(ROW_BLOCK, 16).normal_(0, 0.02, generator=g)
    assert torch.equal(one[ROW_BLOCK : 2 * ROW_BLOCK], block)
    assert abs(float(one.std()) - 0.02) < 0.001 and not torch.equal(
        one, random_rows(2 * ROW_BLOCK + 7, 16, 0.02, seed=4)
    )
