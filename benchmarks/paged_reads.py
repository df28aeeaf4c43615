"""What the paged pilot reads (``benchmarks/paged.py``): pages per call, and how many are new.

The long suite measures what reading pages back buys (answers, KL); this measures what it
costs, in entries read per layer and kv-head: a streamed natural text of the tuning half fed in
64-token calls under a memory budget, then greedy decoding. For each ``quest-K`` / ``shared-K``
name it prints, over the calls after the first eviction, the mean number of entries a kv-head
reads a prompt call and a decode step, and in a decode step how many of them it did not read the
step before (what a resident copy of the last step's pages would leave to fetch). The bytes a
step for another model follow from its bytes a token (``mlxevict info``): entries read x bytes a
token, if every layer and kv-head read as many.

    bash scripts/with-openblas python -m mlxevict.benchmarks.paged_reads --names shared-64,quest-32
"""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

import mlx.core as mx

from .caches import CacheSettings, entries_within
from .long_feed import feed
from .paged import PAGE, make_paged
from .prose import stream


def measure(model: Any, tokens: mx.array, name: str, budget: int, decode: int, chunk: int = 64) -> dict[str, Any]:
    """Feed ``tokens`` to ``name``'s caches in ``chunk``-token calls, decode ``decode`` tokens; count the reads."""
    caches = make_paged(model, name, budget)
    for c in caches:
        c.storage.reads = []
    logits = feed(model, caches, tokens, 0, tokens.shape[1], chunk)[-1]
    for _ in range(decode):
        logits = model(logits[:, -1:].argmax(axis=-1), cache=caches)
        mx.eval(logits)
    logs = [r for c in caches for r in c.storage.reads]
    prompt = [pages for n, pages, _ in logs if n > 1]
    steps = [(pages, new) for n, pages, new in logs if n == 1]
    mean = lambda xs: round(PAGE * sum(xs) / len(xs), 1) if xs else None  # noqa: E731
    return {
        "name": name,
        "budget": budget,
        "evicted": caches[0].storage.spilled[0].shape[2] if caches[0].storage.spilled is not None else 0,
        "prompt_call_entries": mean(prompt),
        "decode_step_entries": mean([p for p, _ in steps]),
        "decode_step_new_entries": mean([n for _, n in steps]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", default="shared-64,quest-32", help="quest-K / shared-K names, comma-separated")
    parser.add_argument("--context", type=int, default=2048, help="tokens streamed before decoding")
    parser.add_argument("--share", type=float, default=0.125, help="memory budget as a share of a 16-bit full cache")
    parser.add_argument("--decode", type=int, default=32, help="greedy tokens after the text")
    args = parser.parse_args(argv)
    import mlxevict
    from mlxevict.resolve import load_model, resolve_model

    model, tokenizer = load_model(resolve_model("demo", progress=True))
    tokens = mx.array(tokenizer.encode(stream("tuning", 0, 8 * args.context))[: args.context])[None]
    budget = entries_within(model, "default", args.share, args.context, CacheSettings())
    with warnings.catch_warnings(), mlxevict.patched(model):
        warnings.simplefilter("ignore")
        for name in args.names.split(","):
            print(json.dumps(measure(model, tokens, name, budget, args.decode)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
