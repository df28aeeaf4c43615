"""``mlxevict serve [MODEL]``: an OpenAI-compatible server; every conversation thinks within the KV budget."""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
from pathlib import Path

from ..errors import MlxEvictError
from .flags import add_cache_options, add_model_argument, add_page_options, add_sampling_options
from .sampling import check_sampling

API_KEY_ENV = "MLXEVICT_API_KEY"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
DEFAULT_CONVERSATIONS = 10  # as mlx-lm's --prompt-cache-size
CONVERSATION_SHARE = 4  # kept conversations may take a quarter of the memory available at start

_EPILOG = f"""\
Endpoints: POST /v1/chat/completions and /v1/completions (stream: true for
server-sent events), GET /v1/models, GET /health. Reasoning comes in
reasoning_content, apart from content; usage.mlxevict holds the cache's numbers.
A request may set max_tokens, temperature, top_p, top_k, min_p, seed, stop,
logit_bias, and mlxevict's own policy and budget (at most the server's --budget).
Requests run one at a time, in order. Ctrl-C stops the server. Under mlx.launch
rank 0 serves and every rank generates (docs/serve.md).

examples:
  mlxevict serve                                    # the demo model on http://127.0.0.1:8080/v1
  mlxevict serve mlx-community/DeepSeek-R1-Distill --budget 2048 --policy entropy
  {API_KEY_ENV}=secret mlxevict serve ./model --host 0.0.0.0 --port 9000
  curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"messages": [{{"role": "user", "content": "Hi"}}], "max_tokens": 20}}'
"""


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``serve`` on the top-level ``mlxevict`` parser."""
    parser = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible server with an evicting KV cache",
        description="Serve a model over the OpenAI API; every conversation's KV cache stays within the budget.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_argument(parser)
    group = parser.add_argument_group("server")
    group.add_argument(
        "--host", default=DEFAULT_HOST, help="address to listen on (default %(default)s: this machine only)"
    )
    group.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default %(default)s; 0 picks a free one)")
    group.add_argument(
        "--api-key", default=os.environ.get(API_KEY_ENV) or None,
        help=f"require Authorization: Bearer KEY on every request (default: ${API_KEY_ENV}, else none)",
    )
    group.add_argument("--chat-template", help="a Jinja chat template (a file or the text) instead of the model's")
    group.add_argument(
        "--conversations", type=int, default=DEFAULT_CONVERSATIONS,
        help="most finished conversations kept for their next turn (default %(default)s; 0 keeps none)",
    )
    group.add_argument(
        "--conversation-memory", default=None, metavar="SIZE",
        help=f"most KV memory the kept conversations take together, such as 2GB (default: 1/{CONVERSATION_SHARE} "
        "of the memory available at start)",
    )
    group.add_argument(
        "--memory-margin", default=None, metavar="SIZE",
        help="stop a request when the system has less than this memory available (default 1 GiB)",
    )
    add_cache_options(parser)
    add_page_options(parser)
    add_sampling_options(parser)
    parser.set_defaults(func=run_serve)


def _check(args: argparse.Namespace) -> None:
    """Refuse bad server options before a model loads."""
    from .common import page_options, storage_flags

    check_sampling(args)
    storage_flags(args)
    page_options(args)
    if not 0 <= args.port <= 65535:
        raise MlxEvictError(f"--port {args.port} is not a port; use 1-65535 (0: any free one)")
    if args.conversations < 0:
        raise MlxEvictError(f"--conversations {args.conversations} must be >= 0")


def _chat_template(text: str) -> str:
    path = Path(text).expanduser()
    if len(text) < 4096 and path.is_file():
        return path.read_text()
    if "{" not in text:
        raise MlxEvictError(f"--chat-template {text!r} is neither a file nor a Jinja template")
    return text


def _model_ids(resolved, given) -> tuple[str, ...]:
    """The names a request's ``model`` may use; the first (the one reported) has no spaces."""
    from ..demo_model import DEMO_MODEL_NAME

    first = DEMO_MODEL_NAME if resolved.source == "demo" else resolved.name
    names = (first, resolved.name, given, str(resolved.path), "default")
    return tuple(dict.fromkeys(n for n in names if n))


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


_exit_code = [1]  # what the process exits with unless the server stops cleanly (the CLI's code for an error)


def _exit_without_teardown() -> None:
    # A thread that generated (mlx-lm's thread-local generation stream) makes MLX's teardown at exit
    # abort the process ("terminate called without an active exception", status 134; MLX 0.32.4, seen
    # alone and under mlx.launch), so the server ends here, its output flushed, before that teardown.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(_exit_code[0])


def run_serve(args: argparse.Namespace) -> int:
    import mlx.core as mx
    import psutil

    from ..budget import parse_budget, parse_size
    from ..memory import MemoryGuard
    from ..launch import launched
    from ..server import ApiServer, ConversationStore, Defaults, Engine
    from ..server.ranks import ShardedEngine, agreed_bytes, follow, watch_launcher
    from ..paged_storage import DEFAULT_PAGES
    from ..plan import paged_plan
    from .common import budget_option, build_caches, load, plan_budget, report, rule_page_options, storage_flags
    from .sampling import resolve_sampling

    request = budget_option(args)
    _check(args)
    guard = MemoryGuard(margin=parse_size(args.memory_margin)) if args.memory_margin else MemoryGuard()
    template = _chat_template(args.chat_template) if args.chat_template else None
    resolved, model, tokenizer = load(args)
    if args.seed is not None:
        mx.random.seed(args.seed)
    if template is not None:
        tokenizer.chat_template = template
    build_caches(model, args, request)  # a budget that cannot work fails here, in CLI words
    paged = rule_page_options(args, model, request)  # --page-dir, or the memory rule's temp folder
    if paged:  # entries held in the model's dtype; a budget in memory counts the sketch of the context too
        pages = paged.get("pages", DEFAULT_PAGES)
        plan = paged_plan(model, request, pages)
        plan_of = lambda text: paged_plan(model, parse_budget(text), pages)  # noqa: E731
    else:
        plan = plan_budget(model, request, storage_flags(args))
        plan_of = lambda text: plan_budget(model, parse_budget(text), plan.storage)  # noqa: E731
    storage, budget = plan.storage.options(), plan.tokens
    sampling, note = resolve_sampling(args, resolved.path)
    if note:
        report(note)
    share = psutil.virtual_memory().available // CONVERSATION_SHARE
    kept_bytes = parse_size(args.conversation_memory) if args.conversation_memory else share
    defaults = Defaults(max_tokens=args.max_tokens, temperature=sampling["temp"], top_p=sampling["top_p"],
                        policy=args.policy, budget=budget, top_k=sampling["top_k"], min_p=sampling["min_p"])
    group = launched()  # under mlx.launch: rank 0 serves, every rank generates (server/ranks.py)
    sharded = {}
    if group is not None:
        kept_bytes = agreed_bytes(kept_bytes, group)
        sharded = dict(group=group, on_fatal=lambda: os.kill(os.getpid(), signal.SIGINT))
    # SIGTERM (a service manager) shuts down as Ctrl-C does, and so does SIGINT also where the
    # shell started the server in the background (which ignores SIGINT). Under mlx.launch SIGTERM
    # comes from the launcher when another rank failed (launch.py says so), Ctrl-C is rank 0's to
    # act on (follow), and a launcher that is itself gone stops the server as Ctrl-C does. Set
    # before the worker starts: a failure there interrupts the main thread with SIGINT.
    for signum in (signal.SIGINT,) if group is not None else (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt if group is None or group.rank() == 0 else signal.SIG_IGN)
    engine = (Engine if group is None else ShardedEngine)(
        model,
        tokenizer,
        defaults=defaults,
        budget_tokens=lambda text: plan_of(text).tokens,
        cache_options=dict(sinks=args.sinks, window=args.window, **storage, **paged),
        store=ConversationStore(args.conversations, kept_bytes),
        guard=guard,
        log=report,
        **sharded,
    )
    atexit.register(_exit_without_teardown)
    if group is not None and group.rank() != 0:
        follow(engine)
        _exit_code[0] = 0
        return 0
    server = None
    try:
        try:
            server = ApiServer((args.host, args.port), engine, defaults=defaults,
                               model_ids=_model_ids(resolved, args.model), api_key=args.api_key, log=report)
        except OSError as err:
            raise MlxEvictError(
                f"cannot listen on {args.host}:{args.port} ({err.strerror}); pick another --port"
            ) from None
        kv = f", KV in {plan.storage.label}" if plan.storage.quantized else ""
        kv += f", evicted entries to {paged['page_dir']}" if paged else ""
        auth = ", API key required" if args.api_key else ""
        ranks = f" on {group.size()} ranks" if group is not None else ""
        report(f"serving {resolved.name}{ranks} at {server.url} (policy {args.policy}, budget {budget} tokens"
               f"{kv}{auth}); Ctrl-C stops")
        if group is not None:
            watch_launcher(lambda: os.kill(os.getpid(), signal.SIGINT))
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        if group is not None:
            # Stopping already (Ctrl-C, or mlx.launch's SIGTERM after a rank died): the worker's own
            # failure signal, which may come now, must not replace the reason with an interruption.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if server is not None:
            server.server_close()
        engine.close()
    failure = engine.failure() if group is not None else None
    if failure is not None:
        raise failure
    print(file=sys.stderr)
    report("server stopped")
    _exit_code[0] = 0
    return 0
