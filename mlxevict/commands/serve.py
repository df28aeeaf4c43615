"""``mlxevict serve [MODEL]``: an OpenAI-compatible server; every conversation thinks within the KV budget."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from ..defaults import started_by_launcher
from ..errors import MlxEvictError
from .flags import add_cache_options, add_model_argument, add_sampling_options
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
Requests run one at a time, in order. Ctrl-C stops the server.

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
    add_sampling_options(parser)
    parser.set_defaults(func=run_serve)


def _check(args: argparse.Namespace) -> None:
    """Refuse bad server options before a model loads."""
    from .common import storage_flags

    if started_by_launcher():
        raise MlxEvictError(
            "serve does not run under mlx.launch yet (each request would have to reach every rank); "
            "run it as one process, or use generate/chat --plain across machines"
        )
    check_sampling(args)
    storage_flags(args)
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


def run_serve(args: argparse.Namespace) -> int:
    import mlx.core as mx
    import psutil

    from ..budget import parse_budget, parse_size
    from ..memory import MemoryGuard
    from ..server import ApiServer, ConversationStore, Defaults, Engine
    from .common import budget_option, build_caches, load, plan_budget, report, storage_flags
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
    plan = plan_budget(model, request, storage_flags(args))
    storage, budget = plan.storage.options(), plan.tokens
    sampling, note = resolve_sampling(args, resolved.path)
    if note:
        report(note)
    share = psutil.virtual_memory().available // CONVERSATION_SHARE
    kept_bytes = parse_size(args.conversation_memory) if args.conversation_memory else share
    defaults = Defaults(max_tokens=args.max_tokens, temperature=sampling["temp"], top_p=sampling["top_p"],
                        policy=args.policy, budget=budget, top_k=sampling["top_k"], min_p=sampling["min_p"])
    engine = Engine(
        model,
        tokenizer,
        defaults=defaults,
        budget_tokens=lambda text: plan_budget(model, parse_budget(text), plan.storage).tokens,
        cache_options=dict(sinks=args.sinks, window=args.window, **storage),
        store=ConversationStore(args.conversations, kept_bytes),
        guard=guard,
        log=report,
    )
    try:
        ids = _model_ids(resolved, args.model)
        server = ApiServer((args.host, args.port), engine, defaults=defaults, model_ids=ids, api_key=args.api_key,
                           log=report)
    except OSError as err:
        engine.close()
        raise MlxEvictError(f"cannot listen on {args.host}:{args.port} ({err.strerror}); pick another --port") from None
    kv = f", KV in {plan.storage.label}" if plan.storage.quantized else ""
    auth = ", API key required" if args.api_key else ""
    report(f"serving {resolved.name} at {server.url} (policy {args.policy}, budget {budget} tokens{kv}{auth}); "
           "Ctrl-C stops")
    # SIGTERM (a service manager) shuts down as Ctrl-C does, and so does SIGINT also where the
    # shell started the server in the background (which ignores SIGINT).
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        engine.close()
    print(file=sys.stderr)
    report("server stopped")
    return 0
