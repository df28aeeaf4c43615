"""What growing storage in 256-slot steps costs a decode: the steps that grow against the median step.

An evicting cache grows as mlx-lm's ``KVCache`` does (256 slots at a time) so it never
holds more than a full cache; each new capacity is a new shape for the compiled kernels
(one trace each) and a copy of the entries. This decodes ``--tokens`` greedy tokens on
the demo model with a budget that does not evict and prints the time of every step that
grew (and the one after it, where a lazily built graph may land) against the median:

    bash scripts/with-openblas python -m mlxevict.benchmarks.growth --tokens 1100
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1100)
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--policy", default="default")
    args = parser.parse_args(argv)

    from mlx_lm import load

    import mlxevict
    from mlxevict.demo_model import demo_model_path

    model, _ = load(str(demo_model_path()))
    caches = mlxevict.make_cache(model, args.policy, args.budget)
    y = model(mx.array([[1, 2, 3, 4]]), cache=caches)[:, -1].argmax(-1)
    times, capacities = [], []
    for _ in range(args.tokens):
        start = time.perf_counter()
        y = model(y[:, None], cache=caches)[:, -1].argmax(-1)
        mx.eval(y)
        times.append(time.perf_counter() - start)
        capacities.append(caches[0].capacity)
    median = statistics.median(times)
    grew = [i for i in range(1, len(times) - 1) if capacities[i] != capacities[i - 1]]
    print(f"{args.tokens} steps, median {median * 1e3:.1f} ms; capacities {sorted(set(capacities))}")
    for i in grew:
        print(f"  grew to {capacities[i]} at step {i}: {times[i] * 1e3:.1f} ms, next {times[i + 1] * 1e3:.1f} ms")
    extra = sum(times[i] + times[i + 1] - 2 * median for i in grew)
    print(f"time above the median at the steps that grew: {extra:+.2f} s of {sum(times):.1f} s")


if __name__ == "__main__":
    main()
