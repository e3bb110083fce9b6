"""Sampling and acceptance: per-row sampling, rejection sampling, forced acceptance, counter-based RNG, FlashInfer."""
