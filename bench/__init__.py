"""Benchmarks: scripts that print and save figures (never timed tests)."""
