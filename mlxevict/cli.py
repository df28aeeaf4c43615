"""The ``mlxevict`` command line: one subcommand per verb, one clear line per error.

Start-up is kept light: this module imports nothing heavy, the OpenBLAS re-exec
is decided first, and only the command asked for is imported (MLX and mlx-lm
load when a command runs, not for ``--help``).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import traceback
import warnings
from importlib import import_module
from typing import Optional, Sequence

from . import __version__
from .defaults import started_by_launcher
from .errors import MlxEvictError, os_error, say_error
from .openblas import reexec_with_openblas

# command -> (module, the function that adds its subparser, its line in `mlxevict --help`).
# Each adder sets ``func`` on its parser.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "generate": ("mlxevict.commands.generate", "add_generate_parser", "generate one answer with an evicting KV cache"),
    "chat": (
        "mlxevict.commands.chat",
        "add_chat_parser",
        "chat with a model in the TUI (or line by line with --plain)",
    ),
    "cache-prompt": (
        "mlxevict.commands.cache_prompt",
        "add_cache_prompt_parser",
        "read a prompt into an evicting cache and save it for generate --prompt-cache-file",
    ),
    "calibrate": (
        "mlxevict.commands.calibrate",
        "add_calibrate_parser",
        "find the layers to keep in 8 bits under a memory budget (once per model)",
    ),
    "info": (
        "mlxevict.commands.info",
        "add_info_parser",
        "show a model's memory plan: weights, KV per token, the budget that fits",
    ),
    "convert": ("mlxevict.convert.cli", "add_convert_parser", "convert a GGUF model into an MLX model folder"),
    "bench": (
        "mlxevict.benchmarks.cli",
        "add_bench_parser",
        "speed and memory: decode/prefill tok/s, peak memory, KV bytes",
    ),
    "eval": (
        "mlxevict.benchmarks.cli",
        "add_eval_parser",
        "quality vs budget and KV bytes: retrieval, fidelity, generation agreement",
    ),
    "serve": (
        "mlxevict.commands.serve",
        "add_serve_parser",
        "serve the OpenAI API (chat/completions) with a KV budget for every conversation",
    ),
    "conversions": (
        "mlxevict.commands.conversions",
        "add_conversions_parser",
        "list or remove the cached conversions of GGUF files",
    ),
}


NO_REEXEC = {"-h", "--help", "--version"}


def command_of(argv: Sequence[str]) -> Optional[str]:
    """The command named in ``argv``: its first word that is not a top-level option."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The top-level parser; only ``command``'s own parser is built (its module imported), the rest are named."""
    parser = argparse.ArgumentParser(
        prog="mlxevict",
        description="Run long chain-of-thought models on MLX with an entropy-evicting KV cache.",
        epilog="mlxevict COMMAND --help shows a command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"mlxevict {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, adder, help_line) in COMMANDS.items():
        if name == command:
            getattr(import_module(module), adder)(sub)
        else:
            sub.add_parser(name, help=help_line, add_help=False)
    return parser


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def nearest(word: str, known: Sequence[str]) -> str:
    """``"; did you mean X?"`` for the closest of ``known``, else ``""``."""
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def refuse_unknown(parser: argparse.ArgumentParser, command: Optional[str], extras: Sequence[str]) -> None:
    """Exit 2 naming the first unknown argument and the nearest known option of its command."""
    owner = subparser(parser, command) if command in COMMANDS else parser
    first = extras[0]
    if first.startswith("-"):
        flag = first.split("=", 1)[0]
        options = [option for option in owner._option_string_actions if option.startswith("--")]
        owner.error(f"unknown option {flag}{nearest(flag, options)}")
    owner.error(f"unexpected argument{'s' if len(extras) > 1 else ''}: {' '.join(extras)}")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one line for people (the library's source location means nothing to them)."""
    print(f"mlxevict: warning: {message}", file=file or sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    if sys.stdout is None:  # started with stdout closed (`>&-`): the answer would go nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # so no file we open lands on fd 1
        say_error("stdout is closed; redirect it to a file (> out.txt) or to /dev/null")
        return 1
    if argv is None:
        argv = sys.argv[1:]
        # Only the real command re-executes (tests call main with a list), before anything heavy is
        # imported, and not to print help or the version (no BLAS call there).
        if not NO_REEXEC.intersection(argv):
            reexec_with_openblas(argv)
    argv = [str(arg) for arg in argv]
    command = command_of(argv)
    parser = build_parser(command)
    if command is not None and command not in COMMANDS:
        parser.error(f"unknown command {command!r}{nearest(command, list(COMMANDS))}")
    args, extras = parser.parse_known_args(argv)
    if extras:
        refuse_unknown(parser, command, extras)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if hasattr(args, "model_flag"):
            from .commands.flags import finish_args

            finish_args(args)
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            if started_by_launcher():
                from .launch import join_ranks

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
        from .distributed import lost_peer
        from .launch import lost_peer_message, stopping

        if not lost_peer(err):
            raise
        stopping()  # a SIGTERM from mlx.launch now lets this line out instead of ending the rank without it
        say_error(lost_peer_message(err))
        return 1
    except (MlxEvictError, FileNotFoundError, NotADirectoryError) as err:
        if args.debug:
            traceback.print_exc()
        say_error(str(err))
        return 1
    except OSError as err:  # a file-system fault nothing closer caught: a full disk under stdout, EIO
        if args.debug:
            traceback.print_exc()
        if err.filename is None:  # a write that names no file: the output stream (`> /dev/full`)
            err.filename = "stdout"
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the final flush must not fail again
        say_error(str(os_error(err, None, "write somewhere else")))
        return 1


if __name__ == "__main__":
    sys.exit(main())
