"""``mlxevict calibrate [MODEL]``: find the layers a model's low-bit KV hurts most, for memory budgets to keep in 8 bits."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..errors import MlxEvictError
from .flags import add_model_argument, say_loading

TEXT_SEED = 7  # which natural text of the long suite's tuning half is streamed (the eval's halves use others)

_EPILOG = """\
Each layer in turn holds its KV in the memory rule's storage (keys in 5 bits
per channel, values in 3) while the others stay exact; the KL against an
exact cache over a natural text's last 256 tokens is that layer's error.
The layers whose error stands out are kept in 8 bits whenever a --budget in
memory makes the cache evict (the same tokens in every layer, the bytes
counted). The result is kept in the mlxevict cache for this model and used by
generate, chat, serve and make_cache(model, budget="1.5GB") from then on.
On the demo model (30 layers, CPU) it takes about 3 minutes.

examples:
  mlxevict calibrate demo
  mlxevict calibrate mlx-community/DeepSeek-R1-Distill-Qwen-14B-4bit --tokens 2048
  mlxevict calibrate demo --show
"""


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``calibrate`` on the top-level ``mlxevict`` parser."""
    parser = subparsers.add_parser(
        "calibrate",
        help="find the layers to keep in 8 bits under a memory budget (once per model)",
        description="Measure each layer's error in low-bit KV storage and keep the worst in 8 bits.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_argument(parser)
    parser.add_argument("--tokens", type=int, default=1024, help="length of the text streamed (default %(default)s)")
    parser.add_argument("--text", metavar="FILE", help="calibrate on this text file instead of the built-in prose")
    parser.add_argument("--show", action="store_true", help="print the model's calibration without measuring")
    parser.set_defaults(func=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    if args.tokens < 512:
        raise MlxEvictError(f"--tokens {args.tokens}: give at least 512 (the last 256 are scored)")
    text = _read(args.text) if args.text else None
    say_loading(args)
    from ..calibrate import Calibration, calibrate, calibration_path, find_calibration
    from .common import load

    resolved, model, tokenizer = load(args)
    if args.show:
        found = find_calibration(model)
        if found is None:
            raise MlxEvictError(f"{resolved.name} has no calibration; run mlxevict calibrate {args.model or ''}".rstrip())
        print(_summary(found))
        return 0
    tokens = _tokens(tokenizer, text, args.tokens)
    limit = getattr(model.args, "max_position_embeddings", None)
    if limit and len(tokens) > limit:
        raise MlxEvictError(f"--tokens {len(tokens)} is more than the model's context of {limit}")
    start = time.perf_counter()

    def progress(done: int, total: int) -> None:
        print(f"\rmlxevict: layer {done}/{total}, {time.perf_counter() - start:.0f} s", end="", file=sys.stderr, flush=True)

    result: Calibration = calibrate(model, tokens, progress=progress, name=resolved.name)
    print(file=sys.stderr)
    path = result.save(calibration_path(model))
    print(_summary(result))
    print(f"saved {path} ({time.perf_counter() - start:.0f} s)")
    return 0


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise MlxEvictError(f"cannot read --text {path}: {err.strerror or err}") from None


def _tokens(tokenizer: object, text: str | None, length: int) -> list[int]:
    """``length`` tokens of ``text``, or of the built-in natural prose (the long suite's tuning half)."""
    if text is None:
        from ..benchmarks.long_tasks import make_long_texts

        return make_long_texts(tokenizer, 1, length, "tuning", TEXT_SEED)[0]
    tokens = tokenizer.encode(text)
    if len(tokens) < length:
        raise MlxEvictError(f"--text has {len(tokens)} tokens, fewer than --tokens {length}")
    return tokens[:length]


def _summary(c: object) -> str:
    """The chosen layers and the largest errors, one line each."""
    errors = c.errors
    top = sorted(range(len(errors)), key=lambda i: -errors[i])[:5]
    median = sorted(errors)[len(errors) // 2]
    chosen = ", ".join(map(str, c.layers)) or "none (no layer stands out)"
    lines = [f"{c.name or 'model'}: layers in 8 bits under a memory budget: {chosen}",
             f"largest errors (KL over {c.scored} of {c.tokens} tokens, {c.storage}; median {median:.5f}):"]  # fmt: skip
    lines += [f"  layer {i:>3}  {errors[i]:.5f}  ({errors[i] / median:.1f}x median)" for i in top]
    return "\n".join(lines)
