"""Benchmarks: scripts that print and save figures (never timed tests). Importing the package is each script's
entry: the process settings are made here, before torch loads (bench.cpu_steps --openmp-default keeps OpenMP's)."""

import sys

from core.process import configure

configure(openmp="--openmp-default" not in sys.argv)
