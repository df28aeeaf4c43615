"""Uniformly random eviction: the floor every other policy must beat."""

import mlx.core as mx

from .base import Policy

DEFAULT_SEED = 0


class RandomPolicy(Policy):
    name = "random"
    source = "baseline"

    def __init__(self, seed: int = DEFAULT_SEED):
        self.seed = seed
        self._key = mx.random.key(seed)

    def score(self, cache) -> mx.array:
        self._key, key = mx.random.split(self._key)
        B, H, C = cache.positions.shape
        # Every head's numbers, as one process holding all heads draws them; this rank keeps its block.
        shard = cache.shard
        return mx.random.uniform(shape=(B, H * shard.size, C), key=key)[:, shard.heads(H)]

    def config(self) -> dict:
        return {"seed": self.seed}

    def runtime_state(self) -> dict:
        return {"key": self._key.tolist()}

    def load_runtime_state(self, state: dict) -> None:
        if "key" in state:
            self._key = mx.array(state["key"], dtype=mx.uint32)
