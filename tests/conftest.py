"""Shared fixtures: the embedded engine is loaded once per test session."""

import pytest

from core import Engine


@pytest.fixture(scope="session")
def embedded() -> Engine:
    return Engine.load()
