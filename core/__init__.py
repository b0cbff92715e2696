"""TriForce engine: hierarchical speculative decoding for long-context generation."""

import os

# OpenMP reads its wait policy once, when torch loads it: PASSIVE idle threads sleep instead of spinning. With the
# default, a 2-thread CPU step on a machine whose cores other processes keep busy waited for a descheduled thread at
# every operator (a 3-row level-2 step 3.3 s against 59 ms: python -m bench.cpu_steps --openmp-default); on a quiet
# machine it costs ~2-3 ms a step. A value already set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from core import events  # noqa: E402
from core.config import (ContextOverflowError, GenerationConfig, ModelNotFoundError,  # noqa: E402
                         TokenizerMismatchError, TriForceError)
from core.engine import Engine  # noqa: E402

__all__ = ["Engine", "GenerationConfig", "TriForceError", "ContextOverflowError", "TokenizerMismatchError",
           "ModelNotFoundError", "events"]
