"""Settings of the process that runs the engine, made by its entry points (`python -m core`, app.py, the benchmarks,
the tests' conftest) before torch loads: importing core sets nothing in the process."""

from __future__ import annotations

import os
import sys

# OpenMP reads its wait policy once, when torch loads it: PASSIVE idle threads sleep instead of spinning. With the
# default, a 2-thread CPU step on a machine whose cores other processes keep busy waited for a descheduled thread at
# every operator (a 3-row level-2 step 3.3 s against 59 ms: python -m bench.cpu_steps --openmp-default); on a quiet
# machine it costs ~2-3 ms a step. A value already set is kept.
OMP_WAIT_POLICY = "PASSIVE"
# The engine's thread lets go of the GIL while it waits for the device and wants it back the moment a step is done;
# a UI thread holding it runs on for Python's switch interval (5 ms by default: several decode steps of a small model
# on a GPU) before it hands over. A shorter interval bounds that wait.
SWITCH_INTERVAL_S = 0.0005


def configure(openmp: bool = True) -> None:
    """Set OpenMP's wait policy (unless the environment sets one, or not `openmp`: its default kept) and the
    interpreter's switch interval; call it before torch is imported."""
    if openmp:
        os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
