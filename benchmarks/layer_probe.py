"""Which layers carry a storage's error: its fidelity with each block of layers given an exact cache in turn.

The long suite's fidelity protocol (:mod:`mlxevict.benchmarks.long_feed`: 2k-token natural texts
streamed in 64-token chunks, the last 256 tokens scored against a full cache's, top-1 and
KL(full ‖ cache)) for one cache, run once as is and once per block of layers, the layers of the
block holding mlx-lm's ``KVCache`` instead. A block whose exact layers cut the KL most is where the
storage loses most. A measurement, not a product setting (docs/tiers.md):

    bash scripts/with-openblas python -m mlxevict.benchmarks.layer_probe --split tuning --fraction 0.25
    bash scripts/with-openblas python -m mlxevict.benchmarks.layer_probe --blocks 15,16,17,18,19
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from .caches import CacheSettings, entries_within, make_caches
from .long_feed import Batch, tail_logits
from .long_runs import SEEDS
from .long_score import Outcome, score
from .long_tasks import make_long_texts

CHUNK = 64  # tokens per streamed call, as the long suite feeds them


def probe(model: nn.Module, tokenizer: Any, cache: str, fraction: float, blocks: Sequence[Sequence[int]], *,
          split: str = "tuning", texts: int = 2, length: int = 2048, scored: int = 256) -> list[tuple[list[int], Outcome]]:  # fmt: skip
    """``[(exact layers, outcome)]``: first the cache as it is (no exact layer), then one row per block.

    Args:
        cache: a cache name as ``bench`` and ``eval`` take it, e.g. ``default:k5v3w8c64l32``.
        fraction: its budget as a share of a 16-bit full cache's bytes at ``length`` tokens.
        blocks: the groups of layer indices made exact in turn.
    """
    from mlx_lm.models.cache import KVCache

    batch = Batch("fidelity", mx.array(make_long_texts(tokenizer, texts, length, split, SEEDS[split])), length - scored, [])
    ref = score(batch, tail_logits(model, [KVCache() for _ in model.layers], batch, "stream", CHUNK, False), None)
    settings = CacheSettings()
    budget = entries_within(model, cache, fraction, length, settings)
    rows = []
    for block in [[], *blocks]:
        caches = make_caches(model, cache, budget, settings)
        for i in block:
            caches[i] = KVCache()
        rows.append((list(block), score(batch, tail_logits(model, caches, batch, "stream", CHUNK, False), ref)))
    return rows


def _blocks(text: str) -> list[list[int]]:
    """``"0-4,5-9"`` → ``[[0..4], [5..9]]``; ``"15,16"`` → ``[[15], [16]]``."""
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.append(list(range(int(a), int(b or a) + 1)))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default="default:k5v3w8c64l32")
    parser.add_argument("--fraction", type=float, default=0.25, help="share of a 16-bit full cache's bytes")
    parser.add_argument("--split", choices=tuple(SEEDS), default="tuning")
    parser.add_argument("--blocks", type=_blocks, default=None,
                        help="layers made exact in turn: 0-4,5-9 (default: blocks of 5 over every layer)")  # fmt: skip
    args = parser.parse_args(argv)

    from mlx_lm import load

    from mlxevict.demo_model import demo_model_path

    model, tokenizer = load(str(demo_model_path()))
    n = len(model.layers)
    blocks = args.blocks or [list(range(a, min(a + 5, n))) for a in range(0, n, 5)]
    start = time.time()
    rows = probe(model, tokenizer, args.cache, args.fraction, blocks, split=args.split)
    print(f"{args.cache} at {args.fraction:g} of the bytes, {args.split} half, {time.time() - start:.0f} s")
    print("| exact layers | top-1 | KL |\n|---|---|---|")
    for block, out in rows:
        print(f"| {', '.join(map(str, block)) or 'none'} | {out.top1:.3f} | {out.kl:.4f} |")


if __name__ == "__main__":
    main()
