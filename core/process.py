"""The setting of the process that runs the engine, made by its entry points (`python -m core`, app.py, the
benchmarks, the tests' conftest) before torch loads: importing core sets nothing in the process."""

from __future__ import annotations

import os

# OpenMP reads its wait policy once, when torch loads it: PASSIVE idle threads sleep instead of spinning. With the
# default, a 2-thread CPU step on a machine whose cores other processes keep busy waited for a descheduled thread at
# every operator (a 3-row level-2 step 3.3 s against 59 ms: python -m bench.cpu_steps --openmp-default); on a quiet
# machine it costs ~2-3 ms a step. A value already set is kept.
OMP_WAIT_POLICY = "PASSIVE"


def configure(openmp: bool = True) -> None:
    """Set OpenMP's wait policy, unless the environment sets one or not `openmp` (OpenMP's default kept); call it
    before torch is imported."""
    if openmp:
        os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
