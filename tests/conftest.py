"""Shared fixtures: the embedded engine is loaded once per test session."""

import pytest
import torch

from core import Engine


@pytest.fixture(scope="session")
def embedded() -> Engine:
    return Engine.load()


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread (no OpenMP hand-offs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
