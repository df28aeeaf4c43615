"""No eviction: the cache grows like mlx-lm's ``KVCache``; the reference for quality."""

import mlx.core as mx

from .base import Policy


class FullPolicy(Policy):
    name = "full"
    source = "reference"
    evicts = False

    def score(self, cache) -> mx.array:
        return cache.positions.astype(mx.float32)
