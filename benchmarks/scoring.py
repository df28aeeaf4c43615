"""What an eviction's scoring costs: attention rows of the observation queries over every slot.

Attention-based policies (``default``, ``snapkv``, ``tova``, ``h2o``, ``rkv``, ``entropy``) score
an eviction with :func:`mlxevict.kernels.attention_probs`: ``queries × slots`` rows per query head
and a softmax over them. On the CPU the softmax's ``exp`` is most of it; the compiled twin uses
:func:`mlxevict.kernels.exp_poly`. This times the plain reference (``mx.softmax``) against the
compiled kernel, one layer of SmolLM2-135M's shapes (9 query heads over 3 kv-heads, head dim 64),
32 queries (the default policy's observation window), the two taking turns in rounds:

    bash scripts/with-openblas python -m mlxevict.benchmarks.scoring
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from mlxevict.kernels import attention_probs, attention_probs_compiled

KERNELS = {"reference (mx.softmax)": attention_probs, "compiled (exp_poly)": attention_probs_compiled}


def inputs(slots: int, queries: int, heads: int = 3, group: int = 3, dim: int = 64) -> tuple[mx.array, ...]:
    """Random queries and keys, every slot valid and older than every query."""
    k1, k2 = mx.random.split(mx.random.key(0))
    q = mx.random.normal((1, heads * group, queries, dim), key=k1)
    k = mx.random.normal((1, heads, slots, dim), key=k2)
    positions = mx.broadcast_to(mx.arange(slots, dtype=mx.int32), (1, heads, slots))
    query_pos = mx.arange(slots, slots + queries, dtype=mx.int32)
    mx.eval(q, k, positions, query_pos)
    return q, k, positions, query_pos


def score_ms(slots: int, queries: int, rounds: int, steps: int) -> dict[str, float]:
    """Mean milliseconds per call of each kernel over ``rounds - 1`` rounds after a warm-up round."""
    args = inputs(slots, queries)
    total = dict.fromkeys(KERNELS, 0.0)
    for r in range(rounds):
        for name, kernel in KERNELS.items():
            start = time.perf_counter()
            for _ in range(steps):
                mx.eval(kernel(*args, 0.125))
            if r:
                total[name] += time.perf_counter() - start
    return {name: 1e3 * t / ((rounds - 1) * steps) for name, t in total.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxevict.benchmarks.scoring", description=__doc__.splitlines()[0])
    p.add_argument("--slots", default="256,1024,2048,4096", help="comma-separated slot counts")
    p.add_argument("--queries", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    print(f"ms per layer's scoring ({args.queries} queries, {args.rounds - 1} rounds x {args.steps} calls)")
    print("| slots | " + " | ".join(KERNELS) + " | ratio |\n|---|" + "---|" * (len(KERNELS) + 1))
    for slots in (int(s) for s in args.slots.split(",")):
        ms = score_ms(slots, args.queries, args.rounds, args.steps)
        ref, fast = ms.values()
        print(f"| {slots} | {ref:.2f} | {fast:.2f} | {ref / fast:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
