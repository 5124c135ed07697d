"""Sampling parameters (vLLM's names), the one definition of a request's distribution (temperature,
top-k, top-p) and the draws from it: the global generator, or noise keyed by (seed, position)."""
