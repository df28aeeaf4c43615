"""What the model-running commands share: the common options, loading, the budget, the stats line."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, TextIO

from ..cache import DEFAULT_BUDGET, DEFAULT_SINKS, DEFAULT_WINDOW
from ..errors import MlxEvictError
from ..events import Finished
from ..generate import DEFAULT_MAX_TOKENS, DEFAULT_TEMP, DEFAULT_TOP_P
from ..launch import RankStats, launched, load_sharded, rank_line
from ..make import make_cache
from ..policies import policy_names
from ..quantized import DEFAULT_GROUP_SIZE, PAIR_BITS, KVBits, bits_label, check_storage, key_value_bits
from ..resolve import FAMILY_NAME, Resolved, load_model, resolve_model
from ..telemetry import BudgetRequest, budget_tokens, format_bytes, kv_bytes_per_token, memory_storage, parse_budget

MODEL_HELP = (
    f"an MLX model folder, a .gguf file, a Hugging Face repo id, or {FAMILY_NAME} "
    "(the largest distill that fits this machine); default: the offline demo model (SmolLM2-135M-Instruct)"
)
DIM, RESET = "\x1b[2m", "\x1b[0m"
DEFAULT_BUDGET_TEXT = f"default ({DEFAULT_BUDGET})"
STORAGE_KEYS = ("kv_bits", "kv_group_size", "full_precision_window", "window_bits")  # make_cache's storage
KV_BITS_NONE = "none"  # --kv-bits none: the model's dtype, also under a budget in memory


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """``MODEL`` (optional), and ``--debug`` also after the command name."""
    parser.add_argument("model", metavar="MODEL", nargs="?", help=MODEL_HELP)
    # SUPPRESS: an unset --debug here must not undo ``mlxevict --debug COMMAND``.
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")


def add_cache_options(parser: argparse.ArgumentParser) -> None:
    """``--policy``, ``--budget``, ``--window``, ``--sinks`` and the storage: ``--kv-bits``, ``--kv-group-size``,
    ``--fp-window``, ``--window-bits``."""
    group = parser.add_argument_group("KV cache")
    group.add_argument(
        "--policy", default="default", choices=policy_names(), help="eviction policy (default: %(default)s)"
    )
    group.add_argument(
        "--budget",
        help="most KV entries per layer: tokens (2048), KV memory (1.5GB, 800MB) or auto (from free memory); "
        f"default {DEFAULT_BUDGET}, at most the model's context",
    )
    group.add_argument(
        "--window", type=int, default=None, help=f"recent tokens always kept (default: min({DEFAULT_WINDOW}, budget/8); "
        "for the default policy min(64, budget/4))"
    )
    group.add_argument(
        "--sinks", type=int, default=DEFAULT_SINKS, help="first tokens always kept (default %(default)s)"
    )
    group.add_argument(
        "--kv-bits",
        type=kv_bits_option,
        default=None,
        metavar="BITS",
        help="store the kept KV entries in 8 or 4 bits, or keys and values apart as KEY,VALUE bits (5,3: the "
        "bytes of 4 bits, keys finer); the newest --fp-window tokens stay in full precision; none: the model's "
        "dtype. Default: the model's dtype for a --budget in tokens; for a --budget in memory (1.5GB, auto) the "
        "dtype or 8 bits if that holds the model's whole context, else 5,3 with --window-bits 8 (the most per "
        "byte)",
    )
    group.add_argument(
        "--kv-group-size",
        type=int,
        default=None,
        help=f"values per quantization scale and bias with --kv-bits: 32, 64 or 128 (default {DEFAULT_GROUP_SIZE})",
    )
    group.add_argument(
        "--fp-window",
        type=int,
        default=None,
        metavar="N",
        help="with --kv-bits: the newest N tokens kept in full precision until they are folded in "
        "(0 quantizes every token at once, as mlx-lm's --kv-bits does); default: min(32, budget/8)",
    )
    group.add_argument(
        "--window-bits",
        type=int,
        choices=(8,),
        default=None,
        help="with --kv-bits under 8: store the --fp-window tokens in 8 bits instead of full precision "
        "(half their bytes; on the test model almost the same quality)",
    )


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    """``--max-tokens``, ``--temp``, ``--top-p``, ``--seed``."""
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="most tokens to generate (default %(default)s)"
    )
    group.add_argument(
        "--temp", type=float, default=DEFAULT_TEMP, help="sampling temperature, 0 = greedy (default %(default)s)"
    )
    group.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help="nucleus sampling mass (default %(default)s)")
    group.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")


def check_sampling(args: argparse.Namespace) -> None:
    """Refuse sampling values mlx-lm would misbehave on, before a model is loaded."""
    if args.max_tokens < 1:
        raise MlxEvictError(f"--max-tokens {args.max_tokens} must be at least 1")
    if args.temp < 0:
        raise MlxEvictError(f"--temp {args.temp} must be >= 0 (0 is greedy)")
    if not 0 < args.top_p <= 1:
        raise MlxEvictError(f"--top-p {args.top_p} must be in (0, 1]")


def report(line: str) -> None:
    print(f"mlxevict: {line}", file=sys.stderr, flush=True)


def load(args: argparse.Namespace) -> tuple[Resolved, Any, Any]:
    """Resolve ``args.model`` (telling the user about choices) and load it."""
    resolved = resolve_model(args.model, progress=sys.stderr.isatty(), report=report)
    group = launched()  # under mlx.launch each rank loads its share of every layer
    model, tokenizer = load_model(resolved) if group is None else load_sharded(resolved, group)
    return resolved, model, tokenizer


def resolve_budget(request: BudgetRequest, model: Any, **storage: Any) -> int:
    """Tokens for ``--budget``, capped at the model's context.

    Memory forms use the KV bytes per token of the storage (``storage``: ``make_cache``'s storage
    arguments), the recent window at its own size.
    """
    limit = getattr(model.args, "max_position_embeddings", None)
    tokens = budget_tokens(request, model, context_limit=limit, **storage)
    if request.nbytes is not None and tokens < 1:
        per_token = kv_bytes_per_token(
            model, kv_bits=storage.get("kv_bits"), kv_group_size=storage.get("kv_group_size", DEFAULT_GROUP_SIZE)
        )
        raise MlxEvictError(
            f"--budget {request.text} holds no token of this model's KV ({per_token} bytes per "
            "token); give more memory or a number of tokens"
        )
    if limit and tokens > limit:
        # The cache allocates its budget up front; slots beyond the context would never be used.
        if request.text != DEFAULT_BUDGET_TEXT:
            report(
                f"--budget {request.text} is {tokens} tokens, more than the model's context of {limit}; using {limit}"
            )
        tokens = limit
    return tokens


def kv_bits_option(text: str) -> KVBits | str:
    """``--kv-bits``: ``8``, ``4``, ``KEY,VALUE`` bits such as ``5,3``, or ``none`` (the model's dtype)."""
    if text == KV_BITS_NONE:
        return text
    try:
        parts = [int(part) for part in text.split(",")]
        bits = parts[0] if len(parts) == 1 else tuple(parts)
        check_storage(bits, DEFAULT_GROUP_SIZE)
    except ValueError:
        pair_bits = f"{', '.join(map(str, PAIR_BITS[:-1]))} or {PAIR_BITS[-1]}"
        message = f"{text!r}: use 8 or 4, KEY,VALUE bits of {pair_bits} such as 5,3, or none"
        raise argparse.ArgumentTypeError(message) from None
    return bits


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """``make_cache``'s storage arguments from the flags (empty without ``--kv-bits`` or with ``none``)."""
    if args.kv_bits in (None, KV_BITS_NONE):
        flags = (("--kv-group-size", args.kv_group_size), ("--fp-window", args.fp_window))
        for flag, value in (*flags, ("--window-bits", args.window_bits)):
            if value is not None:
                raise MlxEvictError(f"{flag} {value} needs --kv-bits 8 or 4 (without it nothing is quantized)")
        return {}
    if args.window_bits is not None and max(key_value_bits(args.kv_bits)) >= 8:
        raise MlxEvictError(
            f"--window-bits {args.window_bits} needs --kv-bits under 8, such as 4 or 5,3 (an 8-bit window "
            "when the rest takes fewer bits)"
        )
    if args.fp_window is not None and args.fp_window < 0:
        raise MlxEvictError(f"--fp-window {args.fp_window} must be a number of tokens >= 0")
    storage = {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size or DEFAULT_GROUP_SIZE}
    if args.fp_window is not None:
        storage["full_precision_window"] = args.fp_window
    if args.window_bits is not None:
        storage["window_bits"] = args.window_bits
    return storage


def cache_storage(args: argparse.Namespace, request: BudgetRequest, model: Any) -> dict[str, Any]:
    """The storage of a command's cache: the flags', or :func:`memory_storage` for a budget in memory."""
    storage = storage_options(args)
    if args.kv_bits is None and request.tokens is None:
        return memory_storage(request, model, getattr(model.args, "max_position_embeddings", None))
    return storage


def build_caches(model: Any, args: argparse.Namespace, request: BudgetRequest) -> list:
    """``make_cache`` from the command line's options, with CLI wording on errors."""
    storage = cache_storage(args, request, model)
    budget = resolve_budget(request, model, **storage)
    try:
        return make_cache(model, args.policy, budget, sinks=args.sinks, window=args.window, **storage)
    except ValueError as err:
        given = "" if request.tokens is not None else f" (--budget {request.text} = {budget} tokens)"
        raise MlxEvictError(f"{err}{given}") from None


def use_color(stream: TextIO) -> bool:
    return stream.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


def stats_line(finished: Finished, ranks: Optional[list[RankStats]] = None) -> str:
    """One line: tokens, tok/s, KV kept/capacity, evicted, peak memory, every rank's (``ranks``), why it stopped."""
    p = finished.progress
    prompt = f"prompt {p.prompt_tokens} tokens, {p.prompt_tokens_per_s:.1f} tok/s"
    parts = [f"{p.generated_tokens} tokens, {p.tokens_per_s:.1f} tok/s ({prompt})"]
    if p.cache is not None:
        c = p.cache
        held = f"{format_bytes(c.nbytes)} vs {format_bytes(c.full_nbytes)} full"
        held += f" ({bits_label(c.kv_bits)})" if c.kv_bits else ""
        parts.append(f"KV kept {c.kept}/{c.capacity}, evicted {c.evicted}, {held}")
    parts.append(f"peak {format_bytes(p.memory.mlx_peak)}")
    if ranks:
        parts.append(rank_line(ranks))
    parts.append(finished.reason)
    return "[" + " | ".join(parts) + "]"


class TextPrinter:
    """Streams the answer to ``out`` and the reasoning to ``err`` (dimmed on a terminal) or nowhere."""

    def __init__(self, out: TextIO, err: TextIO, *, show_reasoning: bool = True):
        self.out, self.err, self.show_reasoning = out, err, show_reasoning
        self.dim = use_color(err)
        self.last: Optional[str] = None

    def write(self, kind: str, text: str) -> None:
        if kind == "reasoning":
            if not self.show_reasoning:
                return
            self.err.write(f"{DIM}{text}{RESET}" if self.dim else text)
            self.err.flush()
        else:
            if self.last == "reasoning" and self.show_reasoning:
                self.err.write("\n\n")
                self.err.flush()
            self.out.write(text)
            self.out.flush()
        self.last = kind

    def end(self) -> None:
        """Close the last line of streamed text."""
        if self.last == "answer":
            self.out.write("\n")
            self.out.flush()
        elif self.last == "reasoning" and self.show_reasoning:
            self.err.write("\n")
            self.err.flush()
        self.last = None


def budget_option(args: argparse.Namespace) -> BudgetRequest:
    """``--budget`` read (bad forms fail here, before a model loads); unset is the default budget."""
    if args.budget is None:
        return BudgetRequest(DEFAULT_BUDGET_TEXT, tokens=DEFAULT_BUDGET)
    return parse_budget(args.budget)
