"""Peak memory of a short generation, each cache measured again and again: is a cache above mlx-lm's ``KVCache``?

``mlxevict bench``'s context sweep measures each cache once; near a step where both hold the
same slots, the difference is smaller than one run's spread. This runs ``generate_step``
(prompt of ``--context`` random tokens, then ``--new-tokens``) for each cache in turn,
``--repeats`` rounds, and prints the min / median / max of the peak above the memory held
before (weights and the allocator's cache cleared first):

    bash scripts/with-openblas python -m mlxevict.benchmarks.peak --context 230 --repeats 6
"""

from __future__ import annotations

import argparse
import statistics

import mlx.core as mx

from .caches import CacheSettings, make_caches, release
from .speed import random_prompt

MiB = 2**20


def peak_of(model, name: str, prompt: mx.array, budget: int, new_tokens: int) -> float:
    """MiB above the active memory before: one ``generate_step`` run of cache ``name`` (as ``bench`` names them)."""
    from mlx_lm.generate import generate_step

    caches = make_caches(model, name, budget, CacheSettings())
    release()
    before = mx.get_active_memory()
    for _ in generate_step(prompt, model, prompt_cache=caches, max_tokens=new_tokens):
        pass
    return (mx.get_peak_memory() - before) / MiB


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=230)
    parser.add_argument("--new-tokens", type=int, default=5)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--caches", default="kvcache,default,window,entropy,h2o,uncertainty")
    args = parser.parse_args(argv)

    from mlx_lm import load

    from mlxevict.demo_model import demo_model_path

    model, _ = load(str(demo_model_path()))
    prompt = random_prompt(args.context, model.args.vocab_size, seed=0)
    names = args.caches.split(",")
    peaks: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.repeats):  # caches take turns, so a slow drift hits all alike
        for name in names:
            peaks[name].append(peak_of(model, name, prompt, args.budget, args.new_tokens))
    print(f"context {args.context}, {args.new_tokens} new tokens, budget {args.budget}, {args.repeats} rounds")
    print("| cache | min MiB | median MiB | max MiB |\n|---|---|---|---|")
    for name, values in peaks.items():
        print(f"| {name} | {min(values):.2f} | {statistics.median(values):.2f} | {max(values):.2f} |")


if __name__ == "__main__":
    main()
