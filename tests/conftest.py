"""Shared fixtures: the embedded engine is loaded once per test session. Under pytest-xdist each worker computes on
its share of the cores (two workers with two threads each on two cores ran a CPU-bound test 2.3x slower than with
one each); the processes a test starts inherit that share."""

import os

from core.process import configure

configure()  # as the entry points do, before torch loads

import pytest  # noqa: E402
import torch  # noqa: E402

from core import Engine  # noqa: E402


def pytest_configure() -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, torch.get_num_threads() // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


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
