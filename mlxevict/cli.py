"""The ``mlxevict`` command line: one subcommand per verb, one clear line per error."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from typing import Callable, Sequence

from . import __version__
from .distributed import lost_peer
from .errors import MlxEvictError
from .launch import join_ranks, lost_peer_message
from .openblas import reexec_with_openblas

# name -> (function that adds the subparser). Each adder sets ``func`` on its parser.
CommandAdder = Callable[["argparse._SubParsersAction"], None]


def _command_adders() -> list[CommandAdder]:
    from .commands.chat import add_chat_parser
    from .commands.generate import add_generate_parser
    from .commands.info import add_info_parser
    from .benchmarks.cli import add_bench_parser, add_eval_parser
    from .convert.cli import add_convert_parser

    return [
        add_generate_parser,
        add_chat_parser,
        add_info_parser,
        add_convert_parser,
        add_bench_parser,
        add_eval_parser,
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxevict",
        description="Run long chain-of-thought models on MLX with an entropy-evicting KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"mlxevict {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _command_adders():
        add(sub)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one line for people (the library's source location means nothing to them)."""
    print(f"mlxevict: warning: {message}", file=file or sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        # Only the real command re-executes (tests call main with a list).
        reexec_with_openblas(sys.argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            join_ranks(args)  # under mlx.launch: one seed, rank 0 reads and prints (mlxevict/launch.py)
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`mlxevict generate ... | head`): stop quietly, as Unix tools do;
        # stdout goes to devnull so the interpreter's final flush cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE
    except RuntimeError as err:
        if not lost_peer(err):
            raise
        print(f"mlxevict: error: {lost_peer_message(err)}", file=sys.stderr)
        return 1
    except (MlxEvictError, FileNotFoundError, NotADirectoryError) as err:
        if args.debug:
            traceback.print_exc()
        print(f"mlxevict: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
