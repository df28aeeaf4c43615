"""Decode tok/s of mlxevict policies relative to mlx-lm's RotatingKVCache at the same budget.

Round-robin over the caches, best of ``--repeats`` per cache, so machine load hits all alike:

    bash scripts/with-openblas python -m mlxevict.benchmarks.decode_vs_rotating --tokens 150
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache

import mlxevict
from mlxevict.demo_model import demo_model_path

WARMUP = 10


def decode_rate(model, prompt: mx.array, caches: list, tokens: int) -> float:
    start = None
    for n, _ in enumerate(generate_step(prompt, model, prompt_cache=caches, max_tokens=tokens)):
        if n == WARMUP:
            start = time.perf_counter()
    return (tokens - WARMUP - 1) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policies", default="default,entropy,uncertainty,window,rkv,knorm")
    args = parser.parse_args()
    model, tokenizer = load(str(demo_model_path("float32")))
    prompt = mx.array(tokenizer.encode("Once upon a time, " * 20))
    makers = {"rotating": lambda: [RotatingKVCache(args.budget, 4) for _ in model.layers]}
    for name in args.policies.split(","):
        makers[name] = lambda name=name: mlxevict.make_cache(model, name, budget=args.budget)
    rates: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(args.repeats):
        for name, make in makers.items():
            rates[name].append(decode_rate(model, prompt, make(), args.tokens))
    base = max(rates["rotating"])
    print(f"| cache (budget {args.budget}, {args.tokens} tokens) | decode tok/s | × RotatingKVCache |")
    print("|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {max(values):.1f} | {max(values) / base:.2f} |")


if __name__ == "__main__":
    main()
