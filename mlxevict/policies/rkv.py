"""R-KV: importance from the latest queries' attention minus key redundancy.

Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Training-Free
Reasoning Models Acceleration", 2025 (https://arxiv.org/abs/2505.24133): reasoning
traces repeat themselves, so among similar keys only one needs to stay.
``score = λ·importance − (1−λ)·redundancy`` with both normalised to sum to one.
"""

import mlx.core as mx

from ..kernels import attention_probs_compiled, gqa_mean, key_redundancy_compiled, pool_keys
from .base import Policy

DEFAULT_WINDOW = 8
DEFAULT_KERNEL = 7
DEFAULT_LAMBDA = 0.1


class RKVPolicy(Policy):
    name = "rkv"
    source = "https://arxiv.org/abs/2505.24133"

    def __init__(
        self,
        observation_window: int = DEFAULT_WINDOW,
        kernel: int = DEFAULT_KERNEL,
        mix: float = DEFAULT_LAMBDA,
    ):
        self.query_window = observation_window
        self.kernel = kernel
        self.mix = mix

    def score(self, cache) -> mx.array:
        keys = cache.dense_keys  # B, H, C, D
        probs = attention_probs_compiled(
            cache.recent_queries, keys, cache.positions, cache.recent_query_pos, cache.scale
        )
        importance = pool_keys(gqa_mean(probs), self.kernel)  # B, H, C
        importance = importance / mx.maximum(importance.sum(axis=-1, keepdims=True), 1e-9)
        redundancy = key_redundancy_compiled(keys, cache.positions)  # B, H, C
        return self.mix * importance - (1 - self.mix) * redundancy

    def config(self) -> dict:
        return {"observation_window": self.query_window, "kernel": self.kernel, "mix": self.mix}
