"""Shared test settings."""

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
