"""``mlxevict chat [MODEL]``: the TUI, or a line-mode REPL with ``--plain`` or without a terminal."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from ..errors import MlxEvictError
from ..events import Finished, TextChunk
from ..generate import ChatSession
from ..launch import rank_stats
from ..policies import policy_names
from ..quantized import bits_label
from ..telemetry import MemoryGuard, parse_budget
from .common import (
    STORAGE_KEYS,
    TextPrinter,
    add_cache_options,
    add_model_argument,
    add_sampling_options,
    budget_option,
    cache_storage,
    check_sampling,
    load,
    resolve_budget,
    stats_line,
    storage_options,
)

HELP = """\
commands:
  /policy NAME     use another eviction policy from the next turn (the conversation is kept)
  /budget N        another budget: tokens, KV memory (1.5GB) or auto
  /stats           the KV cache now
  /reset           clear the conversation and free the cache
  /help            this list
  /quit            leave (or Ctrl-D)"""

_EPILOG = f"""\
In a terminal this opens the TUI. --plain (or no terminal) gives a line-mode
REPL: each line is a message; the answer goes to stdout, the reasoning to
stderr, and a stats line follows each turn. Ctrl-C stops the current answer
and keeps it; Ctrl-C at the prompt exits with status 130.

{HELP}

examples:
  mlxevict chat                                         # the offline demo model
  mlxevict chat mlx-community/DeepSeek-R1-Distill --policy entropy --budget auto
  printf 'Hi!\\nWhat did I just say?\\n' | mlxevict chat ./smollm2 --plain
"""


def add_chat_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``chat`` on the top-level ``mlxevict`` parser."""
    parser = subparsers.add_parser(
        "chat",
        help="chat with a model in the TUI (or line by line with --plain)",
        description="Chat with a model; the KV cache is kept across turns and evicted under the budget.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_argument(parser)
    parser.add_argument("--plain", action="store_true", help="a line-mode REPL instead of the TUI")
    parser.add_argument("--system", help="a system message")
    parser.add_argument("--hide-reasoning", action="store_true", help="do not print the reasoning (--plain)")
    add_cache_options(parser)
    add_sampling_options(parser)
    parser.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    request = budget_option(args)
    check_sampling(args)
    storage_options(args)  # bad storage options fail before a model loads
    resolved, model, tokenizer = load(args)
    storage = cache_storage(args, request, model)
    session = ChatSession(
        model,
        tokenizer,
        policy=args.policy,
        budget=resolve_budget(request, model, **storage),
        system=args.system,
        max_tokens=args.max_tokens,
        temp=args.temp,
        top_p=args.top_p,
        seed=args.seed,
        guard=MemoryGuard(),
        sinks=args.sinks,
        window=args.window,
        **storage,
    )
    if args.plain or not (sys.stdin.isatty() and sys.stdout.isatty()):
        return repl(session, resolved.name, sys.stdin, sys.stdout, sys.stderr, show_reasoning=not args.hide_reasoning)
    try:
        from ..app.main import run_chat_app
    except ImportError as err:
        raise MlxEvictError(f"the chat TUI cannot start ({err}); use --plain") from None
    return int(run_chat_app(session, model_name=resolved.name) or 0)


def command(session: ChatSession, line: str, err: TextIO) -> bool:
    """Run a ``/command``; ``False`` means quit."""
    name, _, value = line.partition(" ")
    value = value.strip()
    if name in ("/quit", "/exit"):
        return False
    if name == "/help":
        print(HELP, file=err)
    elif name == "/reset":
        session.reset()
        print("conversation cleared, cache freed", file=err)
    elif name == "/stats":
        print(session.stats or "the cache is empty", file=err)
    elif name == "/policy":
        if value not in policy_names():
            raise MlxEvictError(f"unknown policy {value!r}; choose one of: {', '.join(policy_names())}")
        session.configure(policy=value)
        print(f"policy {value} from the next turn", file=err)
    elif name == "/budget":
        storage = {k: v for k, v in session.cache_options.items() if k in STORAGE_KEYS}
        budget = resolve_budget(parse_budget(value), session.model, **storage)
        session.configure(budget=budget)
        print(f"budget {budget} tokens from the next turn", file=err)
    else:
        raise MlxEvictError(f"unknown command {name!r}; /help lists them")
    return True


def turn(session: ChatSession, text: str, out: TextIO, err: TextIO, show_reasoning: bool) -> None:
    printer = TextPrinter(out, err, show_reasoning=show_reasoning)
    events = session.send(text)
    finished = None
    try:
        for event in events:
            if isinstance(event, TextChunk):
                printer.write(event.kind, event.text)
            elif isinstance(event, Finished):
                finished = event
    except KeyboardInterrupt:
        events.close()
    printer.end()
    if finished is None:
        print("interrupted", file=err)
        return
    if finished.message:
        print(f"mlxevict: {finished.message}", file=err)
    print(stats_line(finished, rank_stats(finished)), file=err, flush=True)


def repl(session: ChatSession, name: str, inp: TextIO, out: TextIO, err: TextIO, *, show_reasoning: bool = True) -> int:
    """Read messages line by line until EOF or ``/quit``; 130 on Ctrl-C at the prompt."""
    prompt = inp is sys.stdin and inp.isatty()
    kv_bits = session.cache_options.get("kv_bits")
    storage = f", KV in {bits_label(kv_bits)}" if kv_bits else ""
    settings = f"policy {session.policy}, budget {session.budget}{storage}"
    print(f"chatting with {name} ({settings}); /help for commands", file=err)
    while True:
        try:
            line = input("> ") if prompt else inp.readline()
        except EOFError:
            return 0
        except KeyboardInterrupt:
            print(file=err)
            return 130
        if not prompt and not line:
            return 0  # end of the piped input
        line = line.strip()
        if not line:
            continue
        try:
            if line.startswith("/"):
                if not command(session, line, err):
                    return 0
            else:
                turn(session, line, out, err, show_reasoning)
        except MlxEvictError as error:
            print(f"mlxevict: error: {error}", file=err)
