"""Benchmarks; results are written to benchmarks/results/."""
