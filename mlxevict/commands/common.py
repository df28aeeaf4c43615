"""What the model-running commands share once they run: loading, the budget, the stats line (flags: ``flags``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, TextIO

from ..cache import DEFAULT_BUDGET
from ..errors import MlxEvictError
from ..events import Finished
from ..make import make_cache
from ..quantized import DEFAULT_GROUP_SIZE, PAIR_BITS, KVBits, bits_label, check_storage, key_value_bits
from ..resolve import Resolved, load_model, resolve_model
from ..telemetry import BudgetRequest, budget_tokens, format_bytes, kv_bytes_per_token, memory_storage, parse_budget

DIM, RESET = "\x1b[2m", "\x1b[0m"
DEFAULT_BUDGET_TEXT = f"default ({DEFAULT_BUDGET})"
STORAGE_KEYS = ("kv_bits", "kv_group_size", "full_precision_window", "window_bits")  # make_cache's storage
KV_BITS_NONE = "none"  # --kv-bits none: the model's dtype, also under a budget in memory


def report(line: str) -> None:
    print(f"mlxevict: {line}", file=sys.stderr, flush=True)


def load(args: argparse.Namespace) -> tuple[Resolved, Any, Any]:
    """Resolve ``args.model`` (telling the user about choices) and load it."""
    resolved = resolve_model(args.model, progress=sys.stderr.isatty(), report=report)
    model, tokenizer = load_model(resolved)
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


def stats_line(finished: Finished) -> str:
    """One line: tokens, tok/s, KV kept/capacity, evicted, peak memory, why it stopped."""
    p = finished.progress
    prompt = f"prompt {p.prompt_tokens} tokens, {p.prompt_tokens_per_s:.1f} tok/s"
    parts = [f"{p.generated_tokens} tokens, {p.tokens_per_s:.1f} tok/s ({prompt})"]
    if p.cache is not None:
        c = p.cache
        held = f"{format_bytes(c.nbytes)} vs {format_bytes(c.full_nbytes)} full"
        held += f" ({bits_label(c.kv_bits)})" if c.kv_bits else ""
        parts.append(f"KV kept {c.kept}/{c.capacity}, evicted {c.evicted}, {held}")
    parts.append(f"peak {format_bytes(p.memory.mlx_peak)}")
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
