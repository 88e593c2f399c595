"""Benchmarks: workload generators, load drivers (in-process engine or HTTP), vLLM-style results."""
