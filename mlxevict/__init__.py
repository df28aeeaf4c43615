"""Entropy-guided KV-cache eviction for mlx-lm models."""

__version__ = "0.1.0"
