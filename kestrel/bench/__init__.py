"""Benchmarks and evals of any OpenAI-compatible server: load generation, workloads, metrics, cards."""
