"""Where a decode step's time goes in quantized storage: one layer's write, then its attention.

``python -m mlxevict.benchmarks.kv_bits`` measures whole-model decode speed per storage mode;
this splits one layer's step (SmolLM2-135M's shapes: 3 kv-heads, 9 query heads,
head dim 64) into the cache write (fold, window shift, quantize) and the attention,
with synthetic keys, the modes taking turns in rounds (the first round warms up).
``k5v3w8c64`` is keys per channel (:class:`~mlxevict.channel_storage.ChannelStorage`), ``k5v3w8c64l32``
its precision tiers (:class:`~mlxevict.tiered_storage.TieredStorage`);
``mlx-lm q4`` is mlx-lm's ``QuantizedKVCache(bits=4)`` holding ``2 * budget`` tokens, the decode
speed target's reference (its write and its attention, as ``mlx_lm.models.base`` runs them):

    bash scripts/with-openblas python -m mlxevict.benchmarks.storage_step
"""

from __future__ import annotations

import argparse
import io
import re
import time

import mlx.core as mx

from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache

from mlxevict.cache import EvictingKVCache
from mlxevict.channel_storage import ChannelStorage
from mlxevict.quantized import QuantizedEvictingKVCache
from mlxevict.tiered_storage import TieredStorage

MODES = {
    "q8": dict(kv_bits=8),
    "q4": dict(kv_bits=4),
    "q4w8": dict(kv_bits=4, window_bits=8),
    "k5v3w8": dict(kv_bits=(5, 3), window_bits=8),
    "k5v3w8c64": dict(kv_bits=(5, 3), window_bits=8, key_group=64),
    "k5v3w8c64l32": dict(kv_bits=(5, 3), window_bits=8, key_group=64, low_bits=(3, 2)),
}
MLX_LM_Q4 = "mlx-lm q4"


def filled_cache(budget: int, heads: int, dim: int, key_group: int | None = None, low_bits=None, **storage):
    """A ``window``-policy cache holding ``budget - 56`` tokens: full within two rounds, then evicting."""
    if low_bits:
        tiers = TieredStorage(storage["kv_bits"], low_bits, budget, key_group=key_group)
        cache = EvictingKVCache("window", budget, storage=tiers)
    elif key_group:
        cache = EvictingKVCache("window", budget, storage=ChannelStorage(key_group=key_group, **storage))
    else:
        cache = QuantizedEvictingKVCache("window", budget, **storage)
    cache.model_patched = True  # driven here without a model: this benchmark calls attention itself
    keys = mx.random.normal((1, heads, budget - 56, dim))
    cache.update_and_fetch(keys, keys)
    mx.eval(cache.storage.state)
    return cache


class MlxLmQ4:
    """mlx-lm's ``QuantizedKVCache(bits=4)`` holding ``tokens``, kept there (each step's token is dropped again)."""

    def __init__(self, tokens: int, heads: int, dim: int):
        self.cache = QuantizedKVCache(group_size=64, bits=4)
        keys = mx.random.normal((1, heads, tokens, dim))
        self.cache.update_and_fetch(keys, keys)
        mx.eval(self.cache.keys, self.cache.values)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        out = self.cache.update_and_fetch(keys, values)
        self.cache.offset -= 1
        return out

    def attend(self, queries, keys, values, scale, mask):
        return quantized_scaled_dot_product_attention(queries, keys, values, scale, mask, group_size=64, bits=4)


def step_ms(caches: dict, queries: mx.array, keys: mx.array, attend: bool, rounds: int, steps: int) -> dict:
    """Mean milliseconds per step for each cache, over ``rounds - 1`` rounds after a warm-up round."""
    total = dict.fromkeys(caches, 0.0)
    for r in range(rounds):
        for name, cache in caches.items():
            start = time.perf_counter()
            for _ in range(steps):
                k, v = cache.update_and_fetch(keys, keys)
                if attend:  # the patched attention calls the storage's
                    k = (cache if isinstance(cache, MlxLmQ4) else cache.storage).attend(queries, k, v, 0.125, None)
                mx.eval(k, v)
            if r:
                total[name] += time.perf_counter() - start
    return {name: 1e3 * t / ((rounds - 1) * steps) for name, t in total.items()}


def _arrays(tree) -> list[mx.array]:
    """The arrays in nested lists and tuples (a storage's ``arrays()`` may hold ``None``)."""
    if isinstance(tree, mx.array):
        return [tree]
    return [a for x in tree or () for a in _arrays(x)] if isinstance(tree, (list, tuple)) else []


def step_nodes(cache, queries: mx.array, keys: mx.array) -> int:
    """Graph nodes one step (write and attention) builds for MLX to run: on the CPU each costs a few microseconds
    whatever its size, which at a 135M model's shapes is most of a cache's share of a decode step."""
    k, v = cache.update_and_fetch(keys, keys)
    out = (cache if isinstance(cache, MlxLmQ4) else cache.storage).attend(queries, k, v, 0.125, None)
    held = [cache.cache.keys, cache.cache.values] if isinstance(cache, MlxLmQ4) else cache.storage.arrays()
    dot = io.StringIO()
    mx.export_to_dot(dot, out, *_arrays(held))
    nodes = len(re.findall(r'label ="', dot.getvalue()))
    mx.eval(out, held)
    return nodes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxevict.benchmarks.storage_step", description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=int, default=256, help="at least 152 (keys per channel hold 96 tokens)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    heads, query_heads, dim = 3, 9, 64
    queries, keys = mx.random.normal((1, query_heads, 1, dim)), mx.random.normal((1, heads, 1, dim))
    print(f"ms per step and layer (budget {args.budget}, {args.rounds - 1} rounds x {args.steps} steps)")
    print("| storage | write | write + attention | graph nodes of a step |\n|---|---|---|---|")
    results = {}
    for attend in (False, True):
        caches = {name: filled_cache(args.budget, heads, dim, **storage) for name, storage in MODES.items()}
        caches[MLX_LM_Q4] = MlxLmQ4(2 * args.budget, heads, dim)
        results[attend] = step_ms(caches, queries, keys, attend, args.rounds, args.steps)
    nodes = {name: step_nodes(cache, queries, keys) for name, cache in caches.items()}
    for name in (*MODES, MLX_LM_Q4):
        print(f"| {name} | {results[False][name]:.2f} | {results[True][name]:.2f} | {nodes[name]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
