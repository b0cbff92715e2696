"""TriForce engine: hierarchical speculative decoding for long-context generation."""

from core import events
from core.config import (ContextOverflowError, GenerationConfig, ModelNotFoundError, TokenizerMismatchError,
                         TriForceError)
from core.engine import Engine

__all__ = ["Engine", "GenerationConfig", "TriForceError", "ContextOverflowError", "TokenizerMismatchError",
           "ModelNotFoundError", "events"]
