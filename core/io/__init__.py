"""What comes in: models (loading, presets, installing the offline ones), documents and prompts. The names below
are imported on first use: a light module of this package (core.io.text) loads without torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"default_device": "loading", "load_tokenizer": "loading", "MAX_DOCUMENT_CHARS": "prompting",
            "build_prompt": "prompting", "document_fit": "prompting", "plain_ids": "prompting", "EMBEDDED": "presets",
            "PRESETS": "presets", "Preset": "presets", "held_out_documents": "samples",
            "sample_instructions": "samples", "gpu_memory_gib": "inputs", "gpu_only_note": "inputs",
            "note_gpu_only": "inputs", "read_capped": "inputs", "html_to_text": "text"}  # name → its module here

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'core.io' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"core.io.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
