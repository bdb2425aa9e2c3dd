"""Benchmarks, the simulated vLLM fleet, workload generators and reports."""
