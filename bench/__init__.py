"""Benchmarks. Each writes JSONL/CSV rows that carry `bench.environment.environment()`."""
