"""Fixtures every test folder shares: one torch thread, and the tiny world (a 4-layer Llama
target, its preflight report, vocabulary map and real hidden-state shards) built once per module
that asks for it. Builders (tiny models, stage argvs, Snakemake runs) are in tests/support."""

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine spinning
    OpenMP workers slow every matmul many times over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """build_world's tiny world (tests/support/train_helpers.py) in a folder of its own: target,
    preflight, vocab, shards, meta, model, samples, tokenizer. A module that needs more defines
    its own `world` on top of this one."""
    from tests.support.train_helpers import build_world

    return build_world(tmp_path_factory.mktemp("world"))
