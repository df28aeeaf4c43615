"""``mlxevict generate [MODEL] -p PROMPT``: stream one answer, then one stats line."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from typing import TYPE_CHECKING

from ..errors import MlxEvictError
from .flags import (
    add_cache_options,
    add_page_options,
    add_model_argument,
    add_sampling_options,
    add_template_options,
    say_loading,
)
from .sampling import check_sampling

if TYPE_CHECKING:
    from ..events import Finished

DEMO_PROMPT = "Explain in three sentences why the sky is blue."
EXIT_CODES = {"stop": 0, "length": 0, "memory": 1, "interrupted": 130}

_EPILOG = """\
The answer goes to stdout; the reasoning (<think>...</think>) to stderr, dimmed
on a terminal, or nowhere with --hide-reasoning. A stats line ends the run on
stderr: tokens, tok/s, KV kept/capacity, evicted, peak memory. Ctrl-C stops,
keeps the text printed so far and exits 130.

examples:
  mlxevict generate -p "What is the capital of France?"            # offline demo model
  mlxevict generate mlx-community/DeepSeek-R1-Distill -p "Is 221 prime?" --budget 1024
  mlxevict generate ./smollm2 -p "Count to 50." --policy entropy --budget 64 --max-tokens 300
  mlxevict generate ./smollm2 -p "Is 221 prime?" --budget 512 --kv-bits 8   # evict and quantize
  echo "Why is the sea salty?" | mlxevict generate model.gguf --budget 800MB --json
  mlxevict generate --model ./r1 -p "Is 221 prime?" --max-kv-size 1024 --chat-template-args '{"enable_thinking": false}'
  mlxevict generate --prompt-cache-file doc.safetensors -p " Summarize it."   # after mlxevict cache-prompt

Sampling (--temp, --top-p, --top-k, --min-p) defaults to the model's
generation_config.json when it has one (DeepSeek-R1: temp 0.6, top-p 0.95),
else to mlx_lm.generate's (greedy).
"""


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``generate`` on the top-level ``mlxevict`` parser."""
    parser = subparsers.add_parser(
        "generate",
        help="generate one answer with an evicting KV cache",
        description="Generate one answer with an evicting KV cache, streaming it as it is written.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_argument(parser)
    parser.add_argument(
        "-p", "--prompt", help="the prompt, or - to read it from stdin; default: stdin (a demo prompt on a terminal)"
    )
    parser.add_argument("--hide-reasoning", action="store_true", help="do not print the reasoning")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument(
        "--prompt-cache-file",
        metavar="FILE",
        help="continue a prompt cache saved by mlxevict cache-prompt (the prompt follows the saved one)",
    )
    parser.add_argument(
        "--prefill-step-size", type=int, default=None, metavar="N", help="prompt tokens per model call (default 256)"
    )
    add_template_options(parser)
    add_cache_options(parser)
    add_page_options(parser)
    add_sampling_options(parser)
    parser.set_defaults(func=run_generate)


def report(line: str) -> None:
    """``common.report``, imported when first needed (``common`` loads MLX)."""
    from .common import report as say

    say(line)


def read_prompt(args: argparse.Namespace) -> str:
    """``-p``, else stdin; on a terminal with neither, the demo prompt (said so on stderr)."""
    if args.prompt == "-":  # as mlx_lm.generate: read stdin, even on a terminal
        prompt = sys.stdin.read() if sys.stdin is not None else ""
    elif args.prompt is not None:
        prompt = args.prompt
    elif sys.stdin is None or sys.stdin.isatty():
        report(f"no prompt given (-p or stdin); using the demo prompt: {DEMO_PROMPT!r}")
        prompt = DEMO_PROMPT
    else:
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise MlxEvictError("empty prompt: give some text with -p or on stdin")
    return prompt


def as_json(finished: "Finished", model: str, budget: int) -> dict:
    progress = finished.progress
    cache = None
    if progress.cache is not None:
        cache = {**asdict(progress.cache), "saved_nbytes": progress.cache.saved_nbytes}
    return {
        "model": model,
        "finish_reason": finished.reason,
        "message": finished.message,
        "reasoning": finished.reasoning,
        "answer": finished.answer,
        "prompt_tokens": progress.prompt_tokens,
        "generated_tokens": progress.generated_tokens,
        "prompt_tokens_per_s": progress.prompt_tokens_per_s,
        "tokens_per_s": progress.tokens_per_s,
        "budget": budget,
        "cache": cache,
        "memory": asdict(progress.memory),
    }


def run_generate(args: argparse.Namespace) -> int:
    check_sampling(args)
    say_loading(args)
    from ..events import Finished, TextChunk
    from ..launch import rank_stats, ranks_json
    from ..generate import stream_events
    from ..model_patch import patch
    from ..memory import MemoryGuard
    from .cache_prompt import check_model, load_saved
    from .common import TextPrinter, budget_option, build_caches, load, page_options, stats_line, storage_flags
    from .prompt import prompt_ids
    from .sampling import resolve_sampling

    if args.prefill_step_size is not None and args.prefill_step_size < 1:
        raise MlxEvictError(f"--prefill-step-size {args.prefill_step_size} must be at least 1")
    page_options(args)  # bad page flags fail before a model loads
    saved = load_saved(args) if args.prompt_cache_file else None
    request = budget_option(args)
    storage_flags(args)  # bad storage options fail before a model loads
    prompt = read_prompt(args)
    resolved, model, tokenizer = load(args)
    ids = prompt_ids(args, tokenizer, prompt, cached=saved is not None)
    if saved is None:
        caches = build_caches(model, args, request, expected_tokens=len(ids) + args.max_tokens)
    else:
        caches = saved[0]
        check_model(saved[1], resolved, args.prompt_cache_file)
        patch(model)
        report(f"continuing {args.prompt_cache_file}: {caches[0].offset} tokens seen, policy {caches[0].policy.name}, "
               f"budget {caches[0].budget}")
    sampling, note = resolve_sampling(args, resolved.path)
    if note:
        report(note)
    printer = TextPrinter(sys.stdout, sys.stderr, show_reasoning=not args.hide_reasoning)
    options = {"prefill_step_size": args.prefill_step_size} if args.prefill_step_size else {}
    events = stream_events(
        model,
        tokenizer,
        ids,
        caches=caches,
        max_tokens=args.max_tokens,
        seed=args.seed,
        guard=MemoryGuard(),
        **sampling,
        **options,
    )
    finished = None
    try:
        for event in events:
            if isinstance(event, TextChunk) and not args.json:
                printer.write(event.kind, event.text)
            elif isinstance(event, Finished):
                finished = event
    except KeyboardInterrupt:
        # Ctrl-C while printing rather than while the model ran: same outcome.
        events.close()
        printer.end()
        print("interrupted", file=sys.stderr)
        return 130
    ranks = rank_stats(finished)  # every rank's KV and peak under mlx.launch, else None
    if args.json:
        print(json.dumps({**as_json(finished, resolved.name, caches[0].budget), **ranks_json(ranks)}))
    else:
        printer.end()
        if finished.message:
            report(finished.message)
        print(stats_line(finished, ranks), file=sys.stderr, flush=True)
    return EXIT_CODES[finished.reason]
