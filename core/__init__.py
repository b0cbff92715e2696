"""TriForce engine: hierarchical speculative decoding for long-context generation. Importing it loads nothing: the
names below are imported on first use, so a light module (core.io.text, core.config) loads without torch, and the
process settings (core.process) are the entry points' to make before torch loads."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"Engine": "core.engine", "GenerationConfig": "core.config", "TriForceError": "core.config",
            "ContextOverflowError": "core.config", "TokenizerMismatchError": "core.config",
            "ModelNotFoundError": "core.config", "events": "core.events"}  # name → the module that defines it

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'core' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    value = module if module.__name__ == f"core.{name}" else getattr(module, name)
    globals()[name] = value
    return value
