"""What the model-running commands share once they run: loading, the budget, the stats line (flags: ``flags``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, TextIO

from ..budget import DEFAULT_BUDGET_TEXT, BudgetRequest, parse_budget  # noqa: F401 (DEFAULT_BUDGET_TEXT: old path)
from ..chat_session import STORAGE_KEYS  # noqa: F401 (make_cache's storage arguments; old import path)
from ..errors import MlxEvictError
from ..events import Finished
from ..launch import RankStats, launched, load_sharded, rank_line
from ..kvstorage import DTYPE, FLAGS, NONE, KVStorage, bits_label, parse_bits, parse_layers
from ..make import make_cache
from ..memory import format_bytes
from ..plan import CachePlan, page_folder, plan_cache
from ..resolve import Resolved, load_model, resolve_model
from .flags import (  # noqa: F401 (the flags' old import path: other commands read them from here)
    add_cache_options,
    add_model_argument,
    add_sampling_options,
    kv_bits_option,
    page_dir_flag,
)
from .sampling import check_sampling  # noqa: F401 (its old import path)

DIM, RESET = "\x1b[2m", "\x1b[0m"
KV_BITS_NONE = NONE  # --kv-bits none: the model's dtype, also under a budget in memory


def report(line: str) -> None:
    print(f"mlxevict: {line}", file=sys.stderr, flush=True)


def load(args: argparse.Namespace) -> tuple[Resolved, Any, Any]:
    """Resolve ``args.model`` (telling the user about choices) and load it."""
    budget = getattr(args, "budget", None)  # the family choice counts the KV of the budget the run will use
    resolved = resolve_model(args.model, progress=sys.stderr.isatty(), report=report, budget=budget)
    group = launched()  # under mlx.launch each rank loads its share of every layer (or, --pipeline, of the layers)
    pipeline = getattr(args, "pipeline", False)
    if pipeline and group is None:
        raise MlxEvictError("--pipeline splits the model over the ranks of mlx.launch; run under mlx.launch or drop it")
    model, tokenizer = load_model(resolved) if group is None else load_sharded(resolved, group, pipeline=pipeline)
    return resolved, model, tokenizer


def storage_flags(args: argparse.Namespace) -> Optional[KVStorage]:
    """The storage the flags ask for (checked, errors naming the flags); ``None``: the planner's rule."""
    flags = (args.kv_group_size, args.fp_window, args.window_bits)
    key_group, low = getattr(args, "key_group", None), getattr(args, "low_bits", None)
    eight = getattr(args, "eight_bit_layers", None)
    if args.kv_bits is None and all(value is None for value in (*flags, key_group, low, eight)):
        return None
    bits = None if args.kv_bits in (None, KV_BITS_NONE) else args.kv_bits
    try:
        low_bits = None if low is None else parse_bits(low)
        layers = parse_layers(eight) if eight else ()
        return KVStorage.of(bits, *flags, key_group=key_group, low_bits=low_bits, eight_bit_layers=layers, names=FLAGS)
    except ValueError as err:
        raise MlxEvictError(str(err)) from None


def plan_budget(
    model: Any, request: BudgetRequest, storage: Optional[KVStorage] = None, expected_tokens: Optional[int] = None
) -> CachePlan:
    """:func:`~mlxevict.plan.plan_cache` with CLI wording: its notes told on stderr, its errors one line."""
    try:
        plan = plan_cache(model, request, storage, expected_tokens=expected_tokens)
    except ValueError as err:
        raise MlxEvictError(str(err)) from None
    for note in plan.notes:
        report(note)
    return plan


def resolve_budget(request: BudgetRequest, model: Any, **storage: Any) -> int:
    """Tokens for ``--budget`` in the storage ``storage`` (``make_cache``'s storage arguments), capped at the
    model's context (see :func:`plan_budget`)."""
    return plan_budget(model, request, KVStorage.from_options(**storage)).tokens


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


def page_options(args: argparse.Namespace) -> dict[str, Any]:
    """``make_cache``'s ``page_dir`` and ``pages`` from ``--page-dir`` and ``--pages``: empty without ``--page-dir``
    (the memory rule decides: :func:`rule_page_options`), ``page_dir=False`` for ``--page-dir none``.

    Raises:
        MlxEvictError: ``--pages`` with ``--page-dir none``, or ``--page-dir`` or ``--pages`` with ``--kv-bits``.
    """
    page_dir, pages = page_dir_flag(args), getattr(args, "pages", None)
    if page_dir is False:
        if pages is not None:
            raise MlxEvictError("--pages needs a page store: drop --page-dir none")
        return {"page_dir": False}
    if pages is not None and pages < 1:
        raise MlxEvictError(f"--pages {pages}: read at least one page")
    if (page_dir or pages is not None) and storage_flags(args):
        flag = "--page-dir" if page_dir else "--pages"
        raise MlxEvictError(f"{flag} keeps entries in the model's dtype: leave out --kv-bits and its storage flags")
    return {**({"page_dir": page_dir} if page_dir else {}), **({"pages": pages} if pages else {})}


def rule_page_options(
    args: argparse.Namespace, model: Any, request: BudgetRequest, expected_tokens: Optional[int] = None
) -> dict[str, Any]:
    """:func:`page_options` with the memory rule's page store (:func:`mlxevict.plan.page_folder`) when no
    ``--page-dir`` is given: ``{"page_dir": ..., "pages": ...}`` for a paged cache, else ``{}``."""
    given = page_options(args)
    pages = {"pages": given["pages"]} if "pages" in given else {}
    folder = page_folder(given.get("page_dir"), model, request, storage_asked=storage_flags(args) is not None,
                         expected_tokens=expected_tokens, **pages)  # fmt: skip
    return {} if folder is None else {"page_dir": folder, **pages}


def page_budget(model: Any, request: BudgetRequest) -> "int | BudgetRequest":
    """A paged cache's budget for ``make_cache``: a budget in memory as asked (sized there, the sketch counted),
    one in tokens by the dtype's plan (capped at the context, its notes told)."""
    return request if request.tokens is None else plan_budget(model, request, DTYPE).tokens


def build_caches(
    model: Any, args: argparse.Namespace, request: BudgetRequest, expected_tokens: Optional[int] = None
) -> list:
    """``make_cache`` from the command line's options, with CLI wording on errors (``expected_tokens``: the
    prompt's and the answer's, when known)."""
    paged = rule_page_options(args, model, request, expected_tokens)
    if paged:  # make_cache sizes a budget in memory by the paged rule (plan.paged_plan)
        try:
            return make_cache(model, args.policy, page_budget(model, request), sinks=args.sinks, window=args.window,
                              expected_tokens=expected_tokens, **paged)  # fmt: skip
        except ValueError as err:
            raise MlxEvictError(str(err)) from None
    plan = plan_budget(model, request, storage_flags(args), expected_tokens)
    try:
        return make_cache(
            model, args.policy, plan.tokens, sinks=args.sinks, window=args.window, **plan.storage.options()
        )
    except ValueError as err:
        given = "" if request.tokens is not None else f" (--budget {request.text} = {plan.tokens} tokens)"
        raise MlxEvictError(f"{err}{given}") from None


def use_color(stream: TextIO) -> bool:
    return stream.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


def stats_line(finished: Finished, ranks: Optional[list[RankStats]] = None) -> str:
    """One line: tokens, tok/s, KV kept/budget, evicted, peak memory, every rank's (``ranks``), why it stopped."""
    p = finished.progress
    prompt = f"prompt {p.prompt_tokens} tokens, {p.prompt_tokens_per_s:.1f} tok/s"
    parts = [f"{p.generated_tokens} tokens, {p.tokens_per_s:.1f} tok/s ({prompt})"]
    if p.cache is not None:
        c = p.cache
        held = f"{format_bytes(c.nbytes)} vs {format_bytes(c.full_nbytes)} full"
        held += f" ({bits_label(c.kv_bits)})" if c.kv_bits else ""
        parts.append(f"KV kept {c.kept}/{c.budget}, evicted {c.evicted}, {held}")
        if c.disk_nbytes:
            parts.append(f"pages {format_bytes(c.disk_nbytes)} on disk, {format_bytes(c.read_nbytes)} read")
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
    return parse_budget(args.budget)
