"""Heavy-Hitter Oracle: keep the tokens that have received the most attention.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
Large Language Models", 2023 (https://arxiv.org/abs/2306.14048).
"""

import mlx.core as mx

from ..kernels import attention_probs_compiled, gqa_mean
from .base import Policy


class H2OPolicy(Policy):
    name = "h2o"
    source = "https://arxiv.org/abs/2306.14048"
    observes = True

    def observe(self, cache, queries, query_pos) -> None:
        probs = attention_probs_compiled(queries, cache.dense_keys, cache.positions, query_pos, cache.scale)
        cache.stats = cache.stats + gqa_mean(probs)  # B, H, C: accumulated attention

    def score(self, cache) -> mx.array:
        return cache.stats
