"""``mlxevict cache-prompt [MODEL] --prompt-cache-file F -p PROMPT``: save a prompt's evicting cache, as
``mlx_lm.cache_prompt`` does, for ``mlxevict generate --prompt-cache-file F -p QUESTION`` to continue."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import MlxEvictError
from .flags import add_cache_options, add_model_argument, add_page_options, add_template_options, say_loading

_EPILOG = """\
The prompt is read into an evicting cache under --budget (the chat template's
user message is left open, as mlx_lm.cache_prompt does) and saved with
mlx-lm's save_prompt_cache. `mlxevict generate --prompt-cache-file F -p TEXT`
then continues that message with TEXT and answers, without reading the saved
part again; the cache keeps its policy, budget and storage.

examples:
  mlxevict cache-prompt --prompt-cache-file doc.safetensors -p "$(cat notes.txt)" --budget 1024
  mlxevict generate --prompt-cache-file doc.safetensors -p " Summarize the notes above."
"""


def add_cache_prompt_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``cache-prompt`` on the top-level ``mlxevict`` parser."""
    parser = subparsers.add_parser(
        "cache-prompt",
        help="read a prompt into an evicting cache and save it for generate --prompt-cache-file",
        description="Read a prompt into an evicting KV cache and save it (mlx_lm.cache_prompt with eviction).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_argument(parser)
    parser.add_argument("-p", "--prompt", help="the prompt; - or none: read stdin (as mlx_lm.cache_prompt's -)")
    parser.add_argument("--prompt-cache-file", required=True, metavar="FILE", help="the .safetensors file to write")
    add_template_options(parser)
    add_cache_options(parser)
    add_page_options(parser)
    parser.set_defaults(func=run_cache_prompt)


def metadata(args: argparse.Namespace, resolved: Any) -> dict[str, str]:
    """What ``generate`` checks when it continues: mlx-lm's keys and the model's folder."""
    return {
        "model": args.model or "",
        "model_path": str(Path(resolved.path).resolve()),
        "tokenizer_config": "{}",
        "chat_template_args": json.dumps(args.chat_template_args or {}),
    }


def run_cache_prompt(args: argparse.Namespace) -> int:
    say_loading(args)
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import save_prompt_cache

    from .common import budget_option, build_caches, load, page_options, report, storage_flags
    from .prompt import cache_prompt_ids

    request = budget_option(args)
    storage_flags(args)
    page_options(args)
    prompt = sys.stdin.read() if args.prompt in (None, "-") else args.prompt
    if not prompt.strip():
        raise MlxEvictError("empty prompt: give some text with -p or on stdin")
    resolved, model, tokenizer = load(args)
    caches = build_caches(model, args, request)
    tokens = cache_prompt_ids(args, tokenizer, prompt)
    limit = getattr(model.args, "max_position_embeddings", None)
    if limit and len(tokens) >= limit:
        raise MlxEvictError(f"the prompt takes {len(tokens)} tokens, but the model's context limit is {limit}")
    start = time.perf_counter()
    for _ in generate_step(mx.array(tokens), model, max_tokens=0, prompt_cache=caches):
        pass
    seconds = time.perf_counter() - start
    path = Path(args.prompt_cache_file)
    if path.parent and not path.parent.is_dir():
        raise MlxEvictError(f"--prompt-cache-file {path}: no folder {path.parent}; create it first")
    save_prompt_cache(str(path), caches, metadata(args, resolved))
    report(
        f"saved {len(tokens)} prompt tokens ({caches[0].size()} kept, policy {caches[0].policy.name}, budget "
        f"{caches[0].budget}) to {path} in {seconds:.1f} s; peak {mx.get_peak_memory() / 1e9:.3f} GB"
    )
    return 0


def load_saved(args: argparse.Namespace) -> tuple[list[Any], dict[str, str]]:
    """The caches and metadata of ``--prompt-cache-file``; ``args.model`` is taken from it when not given.

    Raises:
        MlxEvictError: no such file, not a saved evicting cache, or cache flags that it would ignore.
    """
    from mlx_lm.models.cache import load_prompt_cache

    from ..cache import EvictingKVCache

    path = Path(args.prompt_cache_file)
    if not path.is_file():
        raise MlxEvictError(f"--prompt-cache-file {path}: no such file; write one with mlxevict cache-prompt")
    given = (("--budget", args.budget), ("--kv-bits", args.kv_bits), ("--window", args.window),
             ("--page-dir", getattr(args, "page_dir", None)))
    for flag, value in given:
        if value is not None:
            raise MlxEvictError(f"{flag} {value}: a saved cache keeps its own settings; drop {flag}")
    try:
        caches, meta = load_prompt_cache(str(path), return_metadata=True)
    except (ValueError, KeyError, RuntimeError) as err:
        raise MlxEvictError(f"--prompt-cache-file {path} is not a saved prompt cache ({err})") from None
    if not caches or not all(isinstance(c, EvictingKVCache) for c in caches):
        raise MlxEvictError(f"--prompt-cache-file {path} holds no evicting cache; write one with mlxevict cache-prompt")
    if args.model is None:
        args.model = meta.get("model") or None
    if args.chat_template_args is None and meta.get("chat_template_args"):
        args.chat_template_args = json.loads(meta["chat_template_args"]) or None
    return caches, meta


def check_model(meta: dict[str, str], resolved: Any, path: str) -> None:
    """Refuse to continue a cache with another model than the one that wrote it (as mlx_lm.generate does)."""
    saved = meta.get("model_path")
    if saved and Path(saved) != Path(resolved.path).resolve():
        raise MlxEvictError(f"--prompt-cache-file {path} was written with the model in {saved}, not {resolved.path}")
