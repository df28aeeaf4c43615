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
        return mx.random.uniform(shape=cache.positions.shape, key=key)

    def config(self) -> dict:
        return {"seed": self.seed}

    def runtime_state(self) -> dict:
        return {"key": self._key.tolist()}

    def load_runtime_state(self, state: dict) -> None:
        if "key" in state:
            self._key = mx.array(state["key"], dtype=mx.uint32)
