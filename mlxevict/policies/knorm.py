"""Key-norm eviction: keys with a small L2 norm draw attention, keep them.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression", 2024 (https://arxiv.org/abs/2406.11430). Needs no attention at all.
"""

import mlx.core as mx

from .base import Policy


class KnormPolicy(Policy):
    name = "knorm"
    source = "https://arxiv.org/abs/2406.11430"

    def score(self, cache) -> mx.array:
        return -mx.linalg.norm(cache.dense_keys.astype(mx.float32), axis=-1)  # B, H, C
