"""Benchmark scripts: each prints a table and writes it into its own section of BENCHMARKS.md."""
