"""``mlxevict eval --suite long`` (the default suite): its options and the run."""

from __future__ import annotations

import argparse
import time
from typing import Any

SHORT_ONLY = ("context", "memory", "new_tokens")  # options of the 512-token suite


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give fractions like 0.25,0.125") from None
    if any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every fraction must be in (0, 1]")
    return values


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers like 1024,2048") from None


def add_long_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", choices=("long", "short"), default="long",
                   help="long (default): natural prose of 1k-2k tokens, tuning and test halves; short: the 512-token tasks")
    p.add_argument("--long", action="store_true", help="long suite: the whole matrix (4k and 8k contexts, 50%% budgets, every policy and "
                   "quantized baseline, the simulated storages; hours on a CPU)")
    p.add_argument("--lengths", type=_ints, default=None,
                   help="long suite: retrieval contexts (default 1024,2048; the tuning half's too when given alone)")
    p.add_argument("--tuning-lengths", type=_ints, default=None,
                   help="long suite: the tuning half's retrieval contexts (default 1024; --long: 1024,2048)")
    p.add_argument("--fidelity-texts", type=int, default=None, help="long suite: 2k-token texts per half (default 2)")
    p.add_argument("--recall-texts", type=int, default=None,
                   help="long suite: 2k-token texts per half whose scored tail restates a passage 1-2k tokens back (default 1; 0: none)")
    p.add_argument("--kinds", type=_names, default=None,
                   help="long suite: retrieval kinds (default passkey,passkeys,keyvalue,reasoning)")
    p.add_argument("--instances", type=int, default=None, help="long suite: rows of each task kind per length (default 1)")
    p.add_argument("--compress-policies", type=_names, default=None,
                   help="long suite: policies also run compressed after prefill, at 25%% of the tokens (default snapkv)")
    p.add_argument("--memory-budgets", type=_floats, default=None,
                   help="long suite: shares of a 16-bit full cache's bytes (default 0.25,0.125)")
    p.add_argument("--variants", type=_names, default=None,
                   help="long suite: storages tried on the tuning half beside the product's and the 16-bit default's (default "
                   "none; --long: default:k5v3w8c64, one tier, kivi-k5v3, tiers-k3v2; any storage suffix, or a simulated one: kivi-k5v3, tiers-k3v2, sim-k5v3w8, kivi-k2v2, kivi-tiers, "
                   "sim-k3v2w8, kivi-k3v2, kivi-k3v2-pre, kivi-tiers-pre; or the paged pilot, evicted entries read back K "
                   "pages at a time: paged-K, quest-K, shared-K, with sN for pages scored from N-bit keys, bN for pages in N bits)")
    p.add_argument("--baselines", type=_names, default=None,
                   help="long suite: mlx-lm's unbudgeted caches (default quantized4; --long: quantized8,quantized4,quantized3)")
    p.add_argument("--splits", type=_names, default=None, help="long suite: tuning,test (default both, in that order)")
    p.add_argument("--parts", type=_names, default=None,
                   help="long suite: groups of test runs (default baselines,policies,compress,memory,chosen; "
                   "also: variants, every simulated storage)")
    p.add_argument("--chosen-from", default=None, help="long suite: a long.json whose tuning half picks the storage")
    p.add_argument("--reference-dir", default=None,
                   help="long suite: keep the full cache's outcomes here and reuse them (runs split across processes)")


def long_config(args: argparse.Namespace) -> Any:
    from mlxevict.errors import MlxEvictError

    from .caches import CacheSettings
    from .long_runs import LONG, LongConfig

    for name in SHORT_ONLY:
        if getattr(args, name, None):
            raise MlxEvictError(f"--{name.replace('_', '-')} belongs to the 512-token suite: add --suite short")
    quick = dict(lengths=(512,), tuning_lengths=(512,), kinds=("passkeys", "reasoning"), fidelity_texts=1, fidelity_length=512, fidelity_scored=64,
                 policies=("default", "window"),
                 compress_policies=("default",), token_fractions=(0.25,), compress_fractions=(0.25,), memory_fractions=(0.25,),
                 variants=(), baselines=("quantized4",)) if args.quick else {}  # fmt: skip
    if args.long and args.quick:
        raise MlxEvictError("--long and --quick: choose one")
    if args.long:
        quick = LONG
    given = dict(
        lengths=args.lengths, tuning_lengths=args.tuning_lengths or args.lengths,  # --lengths alone: both halves
        fidelity_texts=args.fidelity_texts, recall_texts=args.recall_texts, instances=args.instances, kinds=args.kinds, compress_policies=args.compress_policies,
        token_fractions=args.budgets, compress_fractions=args.budgets, memory_fractions=args.memory_budgets, variants=args.variants,
        baselines=args.baselines, splits=args.splits, parts=args.parts, reference_dir=args.reference_dir,
        policies=None if args.policies in (None, "all") else _names(args.policies),
    )  # fmt: skip
    settings = CacheSettings(sinks=args.sinks, window=args.window, slack=args.slack)
    config = LongConfig(settings=settings, **{**quick, **{k: v for k, v in given.items() if v is not None}})
    config.check()
    return config


def run_long_eval(args: argparse.Namespace) -> int:
    from .cli import ProgressBar, _load, _meta
    from .long_eval import load_chosen, run_long
    from .long_report import long_markdown, write_long
    from .long_runs import total_runs
    from .report import write_json

    config = long_config(args)
    chosen = load_chosen(args.chosen_from) if args.chosen_from else None
    model, tokenizer, model_name = _load(args.model)
    started = time.perf_counter()
    bar = ProgressBar(total_runs(config))
    partial = args.out / "long.partial.json"
    results = run_long(model, tokenizer, config, bar, chosen, save=lambda r: write_json({**r, **_meta(args, model_name, time.perf_counter() - started)}, partial))
    bar.close()
    results.update(_meta(args, model_name, time.perf_counter() - started))
    paths = write_long(results, args.out)
    print(long_markdown(results))
    for path in paths:
        print(path)
    return 0
