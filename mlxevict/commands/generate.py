"""``mlxevict generate [MODEL] -p PROMPT``: stream one answer, then one stats line."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ..errors import MlxEvictError
from ..events import Finished, TextChunk
from ..generate import stream_events
from ..launch import rank_stats, ranks_json
from ..telemetry import MemoryGuard
from .common import (
    TextPrinter,
    add_cache_options,
    add_model_argument,
    add_sampling_options,
    budget_option,
    build_caches,
    check_sampling,
    load,
    report,
    stats_line,
    storage_options,
)

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
    parser.add_argument("-p", "--prompt", help="the prompt; default: read stdin (or a demo prompt on a terminal)")
    parser.add_argument("--hide-reasoning", action="store_true", help="do not print the reasoning")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    add_cache_options(parser)
    add_sampling_options(parser)
    parser.set_defaults(func=run_generate)


def read_prompt(args: argparse.Namespace) -> str:
    """``-p``, else stdin; on a terminal with neither, the demo prompt (said so on stderr)."""
    if args.prompt is not None:
        prompt = args.prompt
    elif sys.stdin is None or sys.stdin.isatty():
        report(f"no prompt given (-p or stdin); using the demo prompt: {DEMO_PROMPT!r}")
        prompt = DEMO_PROMPT
    else:
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise MlxEvictError("empty prompt: give some text with -p or on stdin")
    return prompt


def as_json(finished: Finished, model: str, budget: int) -> dict:
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
    request = budget_option(args)
    check_sampling(args)
    storage_options(args)  # bad storage options fail before a model loads
    prompt = read_prompt(args)
    resolved, model, tokenizer = load(args)
    caches = build_caches(model, args, request)
    printer = TextPrinter(sys.stdout, sys.stderr, show_reasoning=not args.hide_reasoning)
    events = stream_events(
        model,
        tokenizer,
        prompt,
        caches=caches,
        max_tokens=args.max_tokens,
        temp=args.temp,
        top_p=args.top_p,
        seed=args.seed,
        guard=MemoryGuard(),
        chat_template=not args.no_chat_template,
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
