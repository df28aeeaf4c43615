"""``mlxevict bench MODEL`` and ``mlxevict eval MODEL``: argument parsing and the run.

Wired into ``mlxevict/cli.py`` by ``add_bench_parser`` and ``add_eval_parser``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .caches import CacheSettings, cache_names, parse_names
from .long_cli import add_long_arguments, run_long_eval

DEFAULT_OUT = Path("out")
# --quick with --policies all: the default policy (also in 5/3 bits), two others and mlx-lm's caches,
# so `eval --quick` takes under 5 minutes and `bench --quick` under 3 on a 2-core CPU (docs/cli.md).
QUICK_EVAL = ("kvcache", "rotating", "quantized4", "{default}", "window", "entropy", "{default}:k5v3w8")
QUICK_BENCH = ("kvcache", "rotating", "quantized4", "default", "entropy")


class ProgressBar:
    """A one-line progress bar on stderr: ``[#####.....] 12/34 rkv @ 0.25  4m10s left``."""

    def __init__(self, total: int, stream=sys.stderr, width: int = 24):
        self.total, self.stream, self.width = max(total, 1), stream, width
        self.done, self.started = 0, time.perf_counter()

    def __call__(self, label: str) -> None:
        elapsed = time.perf_counter() - self.started
        left = elapsed / self.done * (self.total - self.done) if self.done else None
        filled = self.width * self.done // self.total
        eta = "" if left is None else f"  {_duration(left)} left"
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {label:<32}{eta}")
        self.stream.flush()
        self.done = min(self.done + 1, self.total)

    def close(self) -> None:
        self.stream.write(f"\rdone in {_duration(time.perf_counter() - self.started)}{' ' * 60}\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budgets {text!r}: give fractions like 0.5,0.25,0.125") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"--budgets {text!r}: every fraction must be in (0, 1]")
    return values


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers like 512,1024") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every number must be positive")
    return values


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="an MLX folder, a .gguf file, a repo id, or 'demo'")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a few-minute run that checks the harness end to end: smaller tasks and, with --policies all, "
        "a handful of caches",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default: ./out)")
    parser.add_argument(
        "--policies",
        default="all",
        help=f"comma-separated caches and policies, or 'all' (known: {', '.join(cache_names())})",
    )
    parser.add_argument("--sinks", type=int, default=4, help="attention-sink tokens kept (default 4)")
    parser.add_argument("--window", type=int, default=None, help="recent tokens kept (default: mlxevict's)")
    parser.add_argument("--slack", type=int, default=None, help="entries freed per eviction (default: mlxevict's)")
    parser.add_argument("--seed", type=int, default=0, help="task and prompt seed (default 0)")


def add_eval_parser(subparsers: Any) -> None:
    """``mlxevict eval MODEL``: quality per budget for every cache."""
    p = subparsers.add_parser(
        "eval",
        help="quality vs budget and KV bytes: retrieval, fidelity, generation agreement",
        description="The long suite (default): facts hidden in 1k and 2k tokens of natural prose (--long: also 4k "
        "and 8k), fidelity on 2k-token texts, streamed and compressed, budgets in tokens and in bytes, tuning and "
        "test halves kept apart (mlxevict.benchmarks.long_eval). --suite short: evaluate every policy, the default policy stored in 8, 4 and 5/3 bits, and mlx-lm's caches at "
        "budgets that are fractions of the context (with --memory, of its KV bytes at 16 bits); plot quality "
        "against kept fraction (eval.png) and against KV bytes relative to a 16-bit full cache (eval_bytes.png).",
    )
    _common(p)
    add_long_arguments(p)
    p.add_argument("--budgets", type=_fractions, default=None, help="fractions of the context (default 0.5,0.25,0.125; the long suite: 0.25,0.125, --long adds 0.5)")
    p.add_argument("--context", type=int, default=None, help="tokens per retrieval/fidelity sequence (default 512)")
    p.add_argument(
        "--memory",
        action="store_true",
        help="budgets are fractions of a 16-bit full cache's KV bytes, not of its tokens: each cache keeps as "
        "many entries as its storage fits (quality per byte of memory)",
    )
    p.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per generation prompt (default 64)")
    p.set_defaults(func=_run_eval)


def add_bench_parser(subparsers: Any) -> None:
    """``mlxevict bench MODEL``: speed and memory for every cache."""
    p = subparsers.add_parser(
        "bench",
        help="speed and memory: decode/prefill tok/s, peak memory, KV bytes",
        description="Benchmark every policy and mlx-lm cache, with ratios measured side by side.",
    )
    _common(p)
    p.add_argument("--budget", type=int, default=None, help="entries per layer (default 256)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode tokens per cache (default 1000)")
    p.add_argument("--contexts", type=_ints, default=None, help="prefill lengths (default 256,512,1024)")
    p.add_argument("--repeats", type=int, default=None, help="repeats of the context sweep (default 1)")
    p.set_defaults(func=_run_bench)


def _settings(args: argparse.Namespace) -> CacheSettings:
    return CacheSettings(sinks=args.sinks, window=args.window, slack=args.slack)


def _load(name: str) -> tuple[Any, Any, str]:
    from mlxevict.resolve import load_model, resolve_model

    resolved = resolve_model(name, progress=True)
    model, tokenizer = load_model(resolved)
    return model, tokenizer, resolved.name


def _meta(args: argparse.Namespace, model_name: str, seconds: float) -> dict[str, Any]:
    import mlx.core as mx
    import mlx_lm

    return {
        "model": model_name,
        "command": "mlxevict " + " ".join(sys.argv[1:]) if sys.argv else "",
        "quick": args.quick,
        "seconds": round(seconds, 1),
        "machine": f"{platform.system()} {platform.machine()}, {mx.default_device()}",
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
    }


def _finish(results: dict[str, Any], write: Callable[[dict[str, Any], Path], list[Path]], out: Path) -> int:
    for path in write(results, out):
        print(path)
    return 0


def _quick_all(args: argparse.Namespace) -> bool:
    return args.quick and args.policies == "all"


def _run_eval(args: argparse.Namespace) -> int:
    if args.suite == "long":
        return run_long_eval(args)
    from .quality import EvalConfig, run_eval
    from .report import eval_markdown, write_eval
    from .terminal import show

    from mlxevict.policies import DEFAULT_POLICY

    policies = ",".join(QUICK_EVAL).format(default=DEFAULT_POLICY) if _quick_all(args) else args.policies
    names = tuple(parse_names(policies, storage=True))
    quick = dict(context=192, retrieval=2, fidelity=1, generation=2, prompt_tokens=100, new_tokens=16,
                 fractions=(0.5, 0.25)) if args.quick else {}  # fmt: skip
    given = {
        k: v
        for k, v in dict(context=args.context, fractions=args.budgets, new_tokens=args.new_tokens).items()
        if v is not None
    }
    config = EvalConfig(names=names, settings=_settings(args), seed=args.seed, memory=args.memory, **{**quick, **given})
    model, tokenizer, model_name = _load(args.model)
    started = time.perf_counter()
    bar = ProgressBar(len(config.runs()) + 1)
    results = run_eval(model, tokenizer, config, bar)
    bar.close()
    results.update(_meta(args, model_name, time.perf_counter() - started))
    show(eval_markdown(results))
    return _finish(results, write_eval, args.out)


def _run_bench(args: argparse.Namespace) -> int:
    from .report import bench_markdown, write_bench
    from .terminal import show
    from .speed import BenchConfig, CONTEXT_NAMES, run_bench

    policies = ",".join(QUICK_BENCH) if _quick_all(args) else args.policies
    names = tuple(parse_names(policies))
    context_names = CONTEXT_NAMES if args.policies == "all" and not args.quick else names
    quick = dict(new_tokens=40, segment=10, contexts=(128, 256), probe_tokens=4, budget=64) if args.quick else {}
    given = {
        k: v
        for k, v in dict(
            budget=args.budget, new_tokens=args.new_tokens, contexts=args.contexts, repeats=args.repeats
        ).items()
        if v is not None
    }
    config = BenchConfig(
        names=names, context_names=context_names, settings=_settings(args), seed=args.seed, **{**quick, **given}
    )
    model, _, model_name = _load(args.model)
    started = time.perf_counter()
    rounds = -(-(config.new_tokens - 1) // config.segment) + 1 if config.new_tokens > 0 else 0
    bar = ProgressBar(rounds + len(config.contexts) * len(context_names) * config.repeats)
    results = run_bench(model, config, bar)
    bar.close()
    results.update(_meta(args, model_name, time.perf_counter() - started))
    show(bench_markdown(results))
    return _finish(results, write_bench, args.out)
