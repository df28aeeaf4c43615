"""The flags the model-running commands share, spelt as mlx-lm spells them where mlx-lm has them.

This module imports nothing heavy (argparse, the defaults, the policy names), so
``mlxevict generate --help`` prints at once; the values are read and checked by
:func:`finish_args` after parsing and by ``commands.common`` once a model is loaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

from ..defaults import (
    DEFAULT_BUDGET,
    DEFAULT_GROUP_SIZE,
    DEFAULT_MAX_TOKENS,
    DEFAULT_SINKS,
    DEFAULT_WINDOW,
    FAMILY_NAME,
)
from ..errors import MlxEvictError
from ..kvstorage import FLAGS, NONE, check, parse_bits
from ..policies import policy_names

MODEL_HELP = (
    f"an MLX model folder, a .gguf file, a Hugging Face repo id, or {FAMILY_NAME} "
    "(the largest distill that fits this machine); default: the offline demo model (SmolLM2-135M-Instruct)"
)
SAMPLING_DEFAULTS = "default: the model's generation_config.json, else mlx_lm.generate's"


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """``MODEL`` (optional) or ``--model MODEL`` (as mlx-lm), and ``--debug`` also after the command name."""
    parser.add_argument("model", metavar="MODEL", nargs="?", help=MODEL_HELP)
    parser.add_argument("--model", dest="model_flag", metavar="MODEL", help="the same as MODEL (mlx-lm's spelling)")
    # SUPPRESS: an unset --debug here must not undo ``mlxevict --debug COMMAND``.
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    parser.add_argument(
        "--pipeline", action="store_true",
        help="under mlx.launch: each rank holds a block of whole layers (pipeline parallelism, for models mlx-lm "
        "pipelines, such as qwen2) instead of 1/N of every layer's heads",
    )


def kv_bits_option(text: str) -> Any:
    """``--kv-bits``: ``8``, ``4``, ``KEY,VALUE`` bits such as ``5,3``, or ``none`` (the model's dtype)."""
    try:
        bits = parse_bits(text)
        check(bits, names=FLAGS)
    except ValueError as err:
        # argparse names the flag itself: "argument --kv-bits: 3 is not supported; ..."
        raise argparse.ArgumentTypeError(str(err).removeprefix("--kv-bits ")) from None
    return NONE if bits is None else bits


kv_bits_option.__name__ = "kv_bits"  # argparse names the type in "invalid kv_bits value"


def add_cache_options(parser: argparse.ArgumentParser) -> None:
    """``--policy``, ``--budget`` (or mlx-lm's ``--max-kv-size``), ``--window``, ``--sinks`` and the storage:
    ``--kv-bits``, ``--kv-group-size``, ``--fp-window``, ``--window-bits``, ``--key-group``, ``--low-bits``,
    ``--eight-bit-layers``."""
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
        "--max-kv-size",
        type=int,
        metavar="N",
        help="mlx-lm's name for a --budget of N tokens (here the cache evicts by --policy instead of rotating)",
    )
    group.add_argument(
        "--window",
        type=int,
        default=None,
        help=f"recent tokens always kept (default: min({DEFAULT_WINDOW}, budget/8); "
        "for the default policy min(64, budget/4))",
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
        "dtype or 8 bits (or 5,3 with --window-bits 8) if that holds the model's whole context, else precision "
        "tiers: 5,4 over --low-bits 3,2 with --window-bits 8 --key-group 64 (5,3 over 4,3 when the budget is under "
        "14%% of a 16-bit cache of the tokens expected; the most per byte on the tuning half)",
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
    group.add_argument(
        "--key-group",
        type=int,
        choices=(32, 64, 128),
        default=None,
        metavar="N",
        help="with --kv-bits 5,3 --window-bits 8: quantize keys per channel over N tokens (KIVI) instead of per "
        "token; a --budget in memory that must evict picks 64 unless --kv-bits is given",
    )
    group.add_argument(
        "--low-bits",
        default=None,
        metavar="K,V",
        help="with --key-group: precision tiers; the entries the policy ranks lowest are cut to these key and "
        "value bits (such as 3,2) before any is evicted, and a --budget counts entries at these bits",
    )
    group.add_argument(
        "--eight-bit-layers",
        default=None,
        metavar="L,L",
        help="with --kv-bits under 8: store these layers (such as 18) in 8 bits, the same tokens as the others; "
        "a --budget in memory without --kv-bits uses the layers `mlxevict calibrate` found for the model",
    )


def add_page_options(parser: argparse.ArgumentParser) -> None:
    """``--page-dir`` and ``--pages``: evicted entries written to disk and read back by page."""
    group = parser.add_argument_group("page store")
    group.add_argument(
        "--page-dir",
        metavar="DIR",
        help="write evicted KV entries to a file in DIR (an SSD) and read back, each step, the 16-entry pages the "
        "queries need; a --budget in memory then counts the entries held, a 2-bit copy of every evicted key "
        "(7.8%% of a 16-bit entry) and the pages read. The model's dtype only (no --kv-bits); the file has no name "
        "in DIR and its space is freed when the process ends, however it ends. Default: the system's temp folder "
        "when a --budget in memory without --kv-bits would evict and is at least 12%% of a 16-bit full cache of "
        "the tokens expected; none: never",
    )
    group.add_argument(
        "--pages", type=int, default=None, metavar="N", help="with a page store: pages read back per step and kv-head "
        "(default 32: 512 entries)",
    )


def page_dir_flag(args: argparse.Namespace) -> "str | bool | None":
    """``--page-dir`` as ``make_cache``'s ``page_dir``: the folder, ``False`` for ``none``, ``None`` when not given."""
    page_dir = getattr(args, "page_dir", None)
    return False if page_dir is not None and page_dir.strip().lower() == "none" else page_dir


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    """``--max-tokens``, ``--temp``, ``--top-p``, ``--top-k``, ``--min-p``, ``--seed``, as mlx_lm.generate's."""
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "-m", "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="most tokens to generate (default %(default)s)"
    )
    group.add_argument(
        "--temp", type=float, default=None, help=f"sampling temperature, 0 = greedy ({SAMPLING_DEFAULTS}: 0)"
    )
    group.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling mass ({SAMPLING_DEFAULTS}: 1)")
    group.add_argument(
        "--top-k", type=int, default=None, help=f"sample from the k likeliest tokens, 0 = all ({SAMPLING_DEFAULTS}: 0)"
    )
    group.add_argument(
        "--min-p",
        type=float,
        default=None,
        help=f"drop tokens under min-p x the top probability ({SAMPLING_DEFAULTS}: 0)",
    )
    group.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")


def add_template_options(parser: argparse.ArgumentParser, *, template: bool = True) -> None:
    """``--system-prompt`` (or ``--system``); with ``template``, ``--chat-template-config``/``--chat-template-args``
    and ``--ignore-chat-template`` (or ``--no-chat-template``)."""
    group = parser.add_argument_group("prompt")
    group.add_argument(
        "--system-prompt", "--system", dest="system", metavar="TEXT", help="a system message for the chat template"
    )
    if not template:
        return
    group.add_argument(
        "--chat-template-config",
        "--chat-template-args",
        dest="chat_template_args",
        metavar="JSON",
        type=template_args_option,
        default=None,
        help="keyword arguments for the tokenizer's apply_chat_template as JSON, e.g. '{\"enable_thinking\": false}'",
    )
    group.add_argument(
        "--ignore-chat-template",
        "--no-chat-template",
        dest="ignore_chat_template",
        action="store_true",
        help="feed the prompt as raw text, without the tokenizer's chat template",
    )


def template_args_option(text: str) -> dict[str, Any]:
    """``--chat-template-args``: a JSON object."""
    example = """'{"enable_thinking": false}'"""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        message = f"{text!r} is not JSON ({err.msg}); give an object such as {example}"
        raise argparse.ArgumentTypeError(message) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object; give one such as {example}")
    return value


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fold the mlx-lm spellings into one value each: ``--model`` into MODEL, ``--max-kv-size`` into ``--budget``.

    Raises:
        MlxEvictError: both spellings given with different values.
    """
    flag: Optional[str] = getattr(args, "model_flag", None)
    if flag is not None:
        if args.model is not None and args.model != flag:
            raise MlxEvictError(f"two models given: {args.model} and --model {flag}; give one")
        args.model = flag
    size: Optional[int] = getattr(args, "max_kv_size", None)
    if size is not None:
        if args.budget is not None:
            raise MlxEvictError(f"--max-kv-size {size} and --budget {args.budget} both set the budget; give one")
        if size < 1:
            raise MlxEvictError(f"--max-kv-size {size} must be a number of tokens >= 1")
        args.budget = str(size)
    return args


def say_loading(args: argparse.Namespace) -> None:
    """One line on a terminal before MLX, mlx-lm and the model load (seconds on a laptop, more on a busy CPU)."""
    if sys.stderr.isatty():
        saved = getattr(args, "prompt_cache_file", None)
        name = args.model or (f"the model of {saved}" if saved else "the demo model (SmolLM2-135M-Instruct)")
        print(f"mlxevict: loading {name} ...", file=sys.stderr, flush=True)
