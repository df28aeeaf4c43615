"""Heavy-Hitter Oracle: keep the tokens that have received the most attention.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
Large Language Models", 2023 (https://arxiv.org/abs/2306.14048).
"""

import mlx.core as mx

from ..kernels import attention_probs_compiled, gqa_mean, query_pieces
from .base import Policy


class H2OPolicy(Policy):
    name = "h2o"
    source = "https://arxiv.org/abs/2306.14048"
    observes = True

    def observe(self, cache, queries, query_pos) -> None:
        keys, positions, stats = cache.dense_keys, cache.positions, cache.stats
        for q, pos in query_pieces(queries, query_pos):
            stats = stats + gqa_mean(attention_probs_compiled(q, keys, positions, pos, cache.scale))
        cache.stats = stats  # B, H, C: accumulated attention

    def score(self, cache) -> mx.array:
        return cache.stats
