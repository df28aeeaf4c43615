"""``mlxevict chat [MODEL]``: the TUI, or a line-mode REPL with ``--plain`` or without a terminal."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, TextIO

from ..errors import ERROR_PREFIX, MlxEvictError, Stopped
from ..policies import policy_names
from .flags import (
    add_cache_options,
    add_model_argument,
    add_page_options,
    add_sampling_options,
    add_template_options,
    say_loading,
)
from .sampling import check_sampling

if TYPE_CHECKING:
    from ..chat_session import ChatSession
    from ..stats import CacheStats

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
    parser.add_argument("--hide-reasoning", action="store_true", help="do not print the reasoning (--plain)")
    add_template_options(parser, template=False)
    add_cache_options(parser)
    add_page_options(parser)
    add_sampling_options(parser)
    parser.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    check_sampling(args)
    from ..chat_session import ChatSession
    from ..memory import MemoryGuard
    from .common import budget_option, load, page_budget, page_options, plan_budget, report, rule_page_options
    from .common import storage_flags
    from .sampling import resolve_sampling

    request = budget_option(args)
    storage = storage_flags(args)  # bad storage options fail before a model loads
    given = page_options(args)  # bad page flags fail before a model loads
    say_loading(args)
    resolved, model, tokenizer = load(args)
    paged = rule_page_options(args, model, request)  # --page-dir, or the memory rule's temp folder
    if paged:  # entries in the model's dtype; a budget in memory counts the sketch too: the session sizes it
        budget, stored = page_budget(model, request), {}
    else:
        plan = plan_budget(model, request, storage)
        budget, stored = plan.tokens, plan.storage.options()
    sampling, note = resolve_sampling(args, resolved.path)
    if note:
        report(note)
    session = ChatSession(
        model,
        tokenizer,
        policy=args.policy,
        budget=budget,
        system=args.system,
        max_tokens=args.max_tokens,
        seed=args.seed,
        guard=MemoryGuard(),
        sinks=args.sinks,
        window=args.window,
        storage_request=storage,
        page_rule="page_dir" not in given and storage is None,
        **sampling,
        **stored,
        **paged,
    )
    if args.plain or not (sys.stdin.isatty() and sys.stdout.isatty()):
        return repl(session, resolved.name, sys.stdin, sys.stdout, sys.stderr, show_reasoning=not args.hide_reasoning)
    try:
        from ..app.main import run_chat_app
    except ImportError as err:
        raise MlxEvictError(f"the chat TUI cannot start ({err}); use --plain") from None
    return int(run_chat_app(session, model_name=resolved.name) or 0)


def command(session: "ChatSession", line: str, err: TextIO) -> bool:
    """Run a ``/command``; ``False`` means quit."""
    from ..budget import parse_budget

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
        print(stats_text(session.stats) if session.stats else "the cache is empty", file=err)
    elif name == "/policy":
        if value not in policy_names():
            raise MlxEvictError(f"unknown policy {value!r}; choose one of: {', '.join(policy_names())}")
        session.configure(policy=value)
        print(f"policy {value} from the next turn", file=err)
    elif name == "/budget":
        try:
            plan = session.replan(parse_budget(value), session.storage_request)
        except ValueError as error:
            raise MlxEvictError(str(error)) from None
        for note in plan.notes:
            print(f"mlxevict: {note}", file=err)
        stored = f", KV in {plan.storage.label}" if plan.storage.quantized else ""
        print(f"budget {plan.tokens} tokens{stored} from the next turn", file=err)
    else:
        raise MlxEvictError(f"unknown command {name!r}; /help lists them")
    return True


def stats_text(c: "CacheStats") -> str:
    """``/stats`` as a person reads it: what the cache holds, has dropped, and costs."""
    from ..kvstorage import bits_label
    from ..memory import format_bytes

    bits = f", stored in {bits_label(c.kv_bits)}" if c.kv_bits else ""
    if c.kv_bits and c.full_precision_window:
        bits += f", the newest {c.full_precision_window} in {'8 bits' if c.window_bits else 'full precision'}"
    if c.disk_nbytes:
        bits += f"; evicted entries: {format_bytes(c.disk_nbytes)} on disk, {format_bytes(c.read_nbytes)} read back"
    return (
        f"KV cache ({c.policy}): {c.kept:,} of {c.tokens_seen:,} tokens kept, {c.evicted:,} evicted, "
        f"budget {c.budget:,}; {format_bytes(c.nbytes)} vs {format_bytes(c.full_nbytes)} for a full cache{bits}"
    )


def turn(session: "ChatSession", text: str, out: TextIO, err: TextIO, show_reasoning: bool) -> None:
    from ..events import Finished, TextChunk
    from ..launch import rank_stats
    from .common import TextPrinter, stats_line

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


def repl(
    session: "ChatSession", name: str, inp: TextIO, out: TextIO, err: TextIO, *, show_reasoning: bool = True
) -> int:
    """Read messages line by line until EOF or ``/quit``; 130 on Ctrl-C at the prompt."""
    prompt = inp is sys.stdin and inp.isatty()
    storage = f", KV in {session.storage.label}" if session.storage.quantized else ""
    if session.paged:
        asked = f" ({session.page_budget})" if session.page_budget else ""
        storage += f", evicted entries to {session.cache_options['page_dir']}{asked}"
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
        except Stopped:
            raise  # the rank is being ended: the CLI says the one line
        except MlxEvictError as error:
            print(f"{ERROR_PREFIX}{error}", file=err)
