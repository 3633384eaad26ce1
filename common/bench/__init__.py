"""Benchmarks: `tandem bench offline` (engine throughput) and `tandem bench serve` (any OpenAI-compatible endpoint)."""
