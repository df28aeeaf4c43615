"""Token Omission Via Attention: keep what the current query attends to.

Oren et al., "Transformers are Multi-State RNNs", 2024 (https://arxiv.org/abs/2401.06104).
The cache evicts before appending, so "current" is the latest query seen.
"""

import mlx.core as mx

from ..kernels import attention_probs_compiled, gqa_mean
from .base import Policy


class TOVAPolicy(Policy):
    name = "tova"
    source = "https://arxiv.org/abs/2401.06104"
    query_window = 1

    def score(self, cache) -> mx.array:
        probs = attention_probs_compiled(
            cache.recent_queries, cache.dense_keys, cache.positions, cache.recent_query_pos, cache.scale
        )
        return gqa_mean(probs)  # B, H, C
