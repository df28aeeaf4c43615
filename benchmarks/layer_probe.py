"""Which layers carry a storage's error: its fidelity with each block of layers given an exact cache in turn.

The long suite's fidelity protocol (:mod:`mlxevict.benchmarks.long_feed`: 2k-token natural texts
streamed in 64-token chunks, the last 256 tokens scored against a full cache's, top-1 and
KL(full ‖ cache)) for one cache, run once as is and once per block of layers, the layers of the
block holding mlx-lm's ``KVCache`` instead. A block whose exact layers cut the KL most is where the
storage loses most. ``--eight-bit L`` then asks what that layer is worth at equal bytes: the long
suite's retrieval rows and fidelity texts of a half with layer ``L`` in mlx-lm's 8-bit cache and the
other layers' budget cut so that all of them hold the same bytes as the cache alone. Measurements,
not product settings (docs/tiers.md):

    bash scripts/with-openblas python -m mlxevict.benchmarks.layer_probe --split tuning --fraction 0.25
    bash scripts/with-openblas python -m mlxevict.benchmarks.layer_probe --blocks 15,16,17,18,19
    bash scripts/with-openblas python -m mlxevict.benchmarks.layer_probe --eight-bit 18 --split test
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from .caches import CacheSettings, entries_within, make_caches
from .long_feed import Batch, build_batches, kv_fraction, tail_logits
from .long_runs import SEEDS, LongConfig
from .long_score import Outcome, score
from .long_tasks import make_long_texts

CHUNK = 64  # tokens per streamed call, as the long suite feeds them
Q8_SHARE = (64 + 4) / 128  # mlx-lm's QuantizedKVCache(8) per token, as a share of 16 bits: codes, 16-bit scale and bias per 64


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
    ref = _full_cache(model, batch)
    settings = CacheSettings()
    budget = entries_within(model, cache, fraction, length, settings)
    rows = []
    for block in [[], *blocks]:
        caches = make_caches(model, cache, budget, settings)
        for i in block:
            caches[i] = KVCache()
        rows.append((list(block), score(batch, tail_logits(model, caches, batch, "stream", CHUNK, False), ref)))
    return rows


def eight_bit_layer(model: nn.Module, tokenizer: Any, cache: str, fraction: float, layer: int, config: LongConfig,
                    split: str = "tuning") -> list[dict[str, Any]]:  # fmt: skip
    """Per batch of ``config``'s ``split``: ``cache`` alone at ``fraction`` of the bytes, then with ``layer`` in
    mlx-lm's ``QuantizedKVCache(8)`` and the other layers at the share left (the same bytes in all).

    Returns:
        One dict per (batch, setting): ``batch``, ``setting``, ``answers`` and ``of`` (retrieval: answers
        the full cache gets, and how many of them this one gets) or ``top1`` and ``kl``, and ``kv``.
    """
    from mlx_lm.models.cache import QuantizedKVCache

    n, settings = len(model.layers), CacheSettings()
    rest = (fraction * n - Q8_SHARE) / (n - 1)
    rows = []
    for batch in build_batches(tokenizer, config, split):
        L = batch.tokens.shape[1]
        ref = _full_cache(model, batch)
        alone = make_caches(model, cache, entries_within(model, cache, fraction, L, settings), settings)
        mixed = make_caches(model, cache, entries_within(model, cache, rest, L, settings), settings)
        mixed[layer] = QuantizedKVCache(group_size=64, bits=8)
        for setting, caches in ((f"{cache} at {fraction:g}", alone), (f"layer {layer} 8-bit, the rest at {rest:.4f}", mixed)):
            out = score(batch, tail_logits(model, caches, batch, "stream", CHUNK, False), ref)
            row = {"batch": batch.name, "setting": setting, "kv": kv_fraction(model, caches, L)}
            if batch.rows:
                pairs = [(a, r) for got, full in zip(out.correct, ref.correct) for a, r in zip(got, full)]
                row.update(answers=sum(a and r for a, r in pairs), of=sum(r for _, r in pairs))
            else:
                row.update(top1=out.top1, kl=out.kl)
            rows.append(row)
    return rows


def _full_cache(model: nn.Module, batch: Batch) -> Outcome:
    """The reference: ``batch`` streamed into mlx-lm's ``KVCache`` in every layer."""
    from mlx_lm.models.cache import KVCache

    return score(batch, tail_logits(model, [KVCache() for _ in model.layers], batch, "stream", CHUNK, False), None)


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
    parser.add_argument("--eight-bit", type=int, default=None, metavar="LAYER",
                        help="instead: this layer in 8 bits at equal bytes, on the long suite's rows and texts")  # fmt: skip
    args = parser.parse_args(argv)

    from mlx_lm import load

    from mlxevict.demo_model import demo_model_path

    model, tokenizer = load(str(demo_model_path()))
    n = len(model.layers)
    if args.eight_bit is not None:
        config = LongConfig(instances=2 if args.split == "tuning" else 1)  # the tuning half at 1k, the test at 1k and 2k
        print("| batch | setting | answers | top-1 | KL | KV / 16-bit full |\n|---|---|---|---|---|---|")
        for r in eight_bit_layer(model, tokenizer, args.cache, args.fraction, args.eight_bit, config, args.split):
            got = f"{r['answers']}/{r['of']}" if "of" in r else ""
            fid = (f"{r['top1']:.3f}", f"{r['kl']:.4f}") if "kl" in r else ("", "")
            print(f"| {r['batch']} | {r['setting']} | {got} | {fid[0]} | {fid[1]} | {r['kv']:.3f} |")
        return
    blocks = args.blocks or [list(range(a, min(a + 5, n))) for a in range(0, n, 5)]
    start = time.time()
    rows = probe(model, tokenizer, args.cache, args.fraction, blocks, split=args.split)
    print(f"{args.cache} at {args.fraction:g} of the bytes, {args.split} half, {time.time() - start:.0f} s")
    print("| exact layers | top-1 | KL |\n|---|---|---|")
    for block, out in rows:
        print(f"| {', '.join(map(str, block)) or 'none'} | {out.top1:.3f} | {out.kl:.4f} |")


if __name__ == "__main__":
    main()
