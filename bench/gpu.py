"""GPU benchmarks, every part from one command; each module also runs its own parts (`python -m bench.gpu_real`).

  check                   the CUDA path's measured errors, as tests/test_gpu.py measures and asserts them
                          (`python -m pytest tests/test_gpu.py` is the pass/fail check)
  synthetic, prefill      bench.gpu_synthetic: a Llama-2-7B shape (or --shape) with random weights
  real, sweep, replay     bench.gpu_real: the embedded model end to end with RoPE scaling, and its trace replayed
  profile, profile_small  bench.gpu_profile: per-kernel device time of decode steps

python -m bench.gpu [--parts check synthetic real replay] [--contexts ...] [--draft assets/draft] [--budget 4096]
    [--reselect once] [--gguf PATH (default: the embedded GGUF)]
TRIFORCE_GEMV=0 swaps the Triton decode GEMV for cuBLAS. Writes bench/results/<gpu>.json (or --out) with a
top-level "summary".
"""

from __future__ import annotations

import argparse
import json
import sys

from bench import gpu_profile, gpu_real, gpu_synthetic
from bench.common import GpuResults, gpu_main


def check_part(args: argparse.Namespace, results: GpuResults) -> None:
    from tests.test_gpu import measured
    results.data["check"] = measured()
    print(json.dumps(results.data["check"]), flush=True)


PARTS = {"check": check_part}

if __name__ == "__main__":
    gpu_main(__doc__, [sys.modules[__name__], gpu_synthetic, gpu_real, gpu_profile],
             default=["check", "synthetic", "real", "replay"])
