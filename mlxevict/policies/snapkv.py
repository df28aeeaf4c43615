"""SnapKV: attention of an observation window of recent queries, pooled over neighbours.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024
(https://arxiv.org/abs/2404.14469). Defaults follow NVIDIA kvpress (window 64, kernel 5).
Built for compressing a long prompt (``prompt_mode="compress"``); during decoding the
window is simply the latest queries.
"""

import mlx.core as mx

from ..kernels import attention_probs_compiled, gqa_mean, pool_keys
from .base import Policy

DEFAULT_WINDOW = 64
DEFAULT_KERNEL = 5


class SnapKVPolicy(Policy):
    name = "snapkv"
    source = "https://arxiv.org/abs/2404.14469"

    def __init__(self, observation_window: int = DEFAULT_WINDOW, kernel: int = DEFAULT_KERNEL):
        self.query_window = observation_window
        self.kernel = kernel

    def score(self, cache) -> mx.array:
        probs = attention_probs_compiled(
            cache.recent_queries, cache.dense_keys, cache.positions, cache.recent_query_pos, cache.scale
        )
        return pool_keys(gqa_mean(probs), self.kernel)  # B, H, C

    def config(self) -> dict:
        return {"observation_window": self.query_window, "kernel": self.kernel}
