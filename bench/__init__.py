"""Benchmarks: a small timing library (harness.py, flops.py) and the scripts built on it."""
