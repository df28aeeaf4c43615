"""Where a decode step's time goes in quantized storage: one layer's write, then its attention.

``python -m mlxevict.benchmarks.kv_bits`` measures whole-model decode speed per storage mode;
this splits one layer's step (SmolLM2-135M's shapes: 3 kv-heads, 9 query heads,
head dim 64) into the cache write (fold, window shift, quantize) and the attention,
with synthetic keys, the modes taking turns in rounds (the first round warms up):

    bash scripts/with-openblas python -m mlxevict.benchmarks.storage_step
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from mlxevict.quantized import QuantizedEvictingKVCache, quantized_attention

MODES = {
    "q8": dict(kv_bits=8),
    "q4": dict(kv_bits=4),
    "q4w8": dict(kv_bits=4, window_bits=8),
    "k5v3w8": dict(kv_bits=(5, 3), window_bits=8),
}


def filled_cache(budget: int, heads: int, dim: int, **storage) -> QuantizedEvictingKVCache:
    """A ``window``-policy cache holding ``budget - 56`` tokens: full within two rounds, then evicting."""
    cache = QuantizedEvictingKVCache("window", budget, **storage)
    cache.model_patched = True  # driven here without a model: this benchmark calls attention itself
    keys = mx.random.normal((1, heads, budget - 56, dim))
    cache.update_and_fetch(keys, keys)
    mx.eval(cache.keys, cache.values)
    return cache


def step_ms(caches: dict, queries: mx.array, keys: mx.array, attend: bool, rounds: int, steps: int) -> dict:
    """Mean milliseconds per step for each cache, over ``rounds - 1`` rounds after a warm-up round."""
    total = dict.fromkeys(caches, 0.0)
    for r in range(rounds):
        for name, cache in caches.items():
            start = time.perf_counter()
            for _ in range(steps):
                k, v = cache.update_and_fetch(keys, keys)
                if attend:
                    k = quantized_attention(
                        queries, k, v, 0.125, None, cache.kv_group_size, cache.kv_bits, cache.rotation,
                        cache.window_bits,
                    )  # fmt: skip
                mx.eval(k, v)
            if r:
                total[name] += time.perf_counter() - start
    return {name: 1e3 * t / ((rounds - 1) * steps) for name, t in total.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxevict.benchmarks.storage_step", description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    heads, query_heads, dim = 3, 9, 64
    queries, keys = mx.random.normal((1, query_heads, 1, dim)), mx.random.normal((1, heads, 1, dim))
    print(f"ms per step and layer (budget {args.budget}, {args.rounds - 1} rounds x {args.steps} steps)")
    print("| storage | write | write + attention |\n|---|---|---|")
    results = {}
    for attend in (False, True):
        caches = {name: filled_cache(args.budget, heads, dim, **storage) for name, storage in MODES.items()}
        results[attend] = step_ms(caches, queries, keys, attend, args.rounds, args.steps)
    for name in MODES:
        print(f"| {name} | {results[False][name]:.2f} | {results[True][name]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
