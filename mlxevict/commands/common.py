"""What the model-running commands share: the common options, loading, the budget, the stats line."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, TextIO

from ..budget import DEFAULT_BUDGET_TEXT, BudgetRequest, parse_budget  # noqa: F401 (DEFAULT_BUDGET_TEXT: old path)
from ..cache import DEFAULT_BUDGET, DEFAULT_SINKS, DEFAULT_WINDOW
from ..chat_session import STORAGE_KEYS  # noqa: F401 (make_cache's storage arguments; old import path)
from ..errors import MlxEvictError
from ..events import Finished
from ..generate import DEFAULT_MAX_TOKENS, DEFAULT_TEMP, DEFAULT_TOP_P
from ..kvstorage import DEFAULT_GROUP_SIZE, FLAGS, NONE, KVBits, KVStorage, bits_label, check, parse_bits
from ..make import make_cache
from ..memory import format_bytes
from ..plan import CachePlan, plan_cache
from ..policies import policy_names
from ..resolve import FAMILY_NAME, Resolved, load_model, resolve_model

MODEL_HELP = (
    f"an MLX model folder, a .gguf file, a Hugging Face repo id, or {FAMILY_NAME} "
    "(the largest distill that fits this machine); default: the offline demo model (SmolLM2-135M-Instruct)"
)
DIM, RESET = "\x1b[2m", "\x1b[0m"
KV_BITS_NONE = NONE  # --kv-bits none: the model's dtype, also under a budget in memory


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
    if args.seed is not None and not 0 <= args.seed < 2**64:
        raise MlxEvictError(f"--seed {args.seed} must be an integer from 0 to 2**64 - 1")


def report(line: str) -> None:
    print(f"mlxevict: {line}", file=sys.stderr, flush=True)


def load(args: argparse.Namespace) -> tuple[Resolved, Any, Any]:
    """Resolve ``args.model`` (telling the user about choices) and load it."""
    budget = getattr(args, "budget", None)  # the family choice counts the KV of the budget the run will use
    resolved = resolve_model(args.model, progress=sys.stderr.isatty(), report=report, budget=budget)
    model, tokenizer = load_model(resolved)
    return resolved, model, tokenizer


def storage_flags(args: argparse.Namespace) -> Optional[KVStorage]:
    """The storage the flags ask for (checked, errors naming the flags); ``None``: the planner's rule."""
    flags = (args.kv_group_size, args.fp_window, args.window_bits)
    if args.kv_bits is None and all(value is None for value in flags):
        return None
    bits = None if args.kv_bits in (None, KV_BITS_NONE) else args.kv_bits
    try:
        return KVStorage.of(bits, *flags, names=FLAGS)
    except ValueError as err:
        raise MlxEvictError(str(err)) from None


def plan_budget(model: Any, request: BudgetRequest, storage: Optional[KVStorage] = None) -> CachePlan:
    """:func:`~mlxevict.plan.plan_cache` with CLI wording: its notes told on stderr, its errors one line."""
    try:
        plan = plan_cache(model, request, storage)
    except ValueError as err:
        raise MlxEvictError(str(err)) from None
    for note in plan.notes:
        report(note)
    return plan


def resolve_budget(request: BudgetRequest, model: Any, **storage: Any) -> int:
    """Tokens for ``--budget`` in the storage ``storage`` (``make_cache``'s storage arguments), capped at the
    model's context (see :func:`plan_budget`)."""
    return plan_budget(model, request, KVStorage.from_options(**storage)).tokens


def kv_bits_option(text: str) -> KVBits | str:
    """``--kv-bits``: ``8``, ``4``, ``KEY,VALUE`` bits such as ``5,3``, or ``none`` (the model's dtype)."""
    try:
        bits = parse_bits(text)
        check(bits, names=FLAGS)
    except ValueError as err:
        # argparse names the flag itself: "argument --kv-bits: 3 is not supported; ..."
        raise argparse.ArgumentTypeError(str(err).removeprefix("--kv-bits ")) from None
    return KV_BITS_NONE if bits is None else bits


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """``make_cache``'s storage arguments from the flags (empty without ``--kv-bits`` or with ``none``)."""
    storage = storage_flags(args)
    return {} if storage is None else storage.options()


def cache_storage(args: argparse.Namespace, request: BudgetRequest, model: Any) -> dict[str, Any]:
    """The storage of a command's cache: the flags', or the planner's rule for a budget in memory."""
    storage = storage_flags(args)
    if storage is None and request.tokens is None:
        storage = plan_cache(model, request).storage
    return {} if storage is None else storage.options()


def build_caches(model: Any, args: argparse.Namespace, request: BudgetRequest) -> list:
    """``make_cache`` from the command line's options, with CLI wording on errors."""
    plan = plan_budget(model, request, storage_flags(args))
    try:
        return make_cache(
            model, args.policy, plan.tokens, sinks=args.sinks, window=args.window, **plan.storage.options()
        )
    except ValueError as err:
        given = "" if request.tokens is not None else f" (--budget {request.text} = {plan.tokens} tokens)"
        raise MlxEvictError(f"{err}{given}") from None


def use_color(stream: TextIO) -> bool:
    return stream.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


def stats_line(finished: Finished) -> str:
    """One line: tokens, tok/s, KV kept/budget, evicted, peak memory, why it stopped."""
    p = finished.progress
    prompt = f"prompt {p.prompt_tokens} tokens, {p.prompt_tokens_per_s:.1f} tok/s"
    parts = [f"{p.generated_tokens} tokens, {p.tokens_per_s:.1f} tok/s ({prompt})"]
    if p.cache is not None:
        c = p.cache
        held = f"{format_bytes(c.nbytes)} vs {format_bytes(c.full_nbytes)} full"
        held += f" ({bits_label(c.kv_bits)})" if c.kv_bits else ""
        parts.append(f"KV kept {c.kept}/{c.budget}, evicted {c.evicted}, {held}")
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
    return parse_budget(args.budget)
