"""``mlxevict conversions list|remove``: the GGUF conversions kept in ``$MLXEVICT_CACHE/gguf``."""

from __future__ import annotations

import argparse

from ..errors import MlxEvictError
from ..gguf_cache import cache_root, list_conversions, remove_conversions
from ..memory import format_bytes

_EPILOG = """\
A .gguf file given as MODEL (generate, chat, bench) is converted once into this
cache and found again by its content, wherever the file is moved; a changed file
replaces its older conversion.

examples:
  mlxevict conversions list                      # name, size, dtype, source GGUF
  mlxevict conversions remove model.gguf         # the conversions of this file
  mlxevict conversions remove NAME               # one conversion, by the name `list` shows
  mlxevict conversions remove --all
"""


def add_conversions_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``cache`` on the top-level ``mlxevict`` parser."""
    parser = subparsers.add_parser(
        "conversions",
        help="list or remove the cached conversions of GGUF files",
        description="List or remove the GGUF conversions mlxevict keeps in its cache.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", nargs="?", choices=("list", "remove"), default="list", help="default: list")
    parser.add_argument("names", nargs="*", metavar="NAME", help="for remove: a name from `list`, or a .gguf file")
    parser.add_argument("--all", action="store_true", help="for remove: every cached conversion")
    parser.set_defaults(func=run_conversions)


def run_conversions(args: argparse.Namespace) -> int:
    if args.action == "list":
        if args.names or args.all:
            raise MlxEvictError("`conversions list` takes no NAME or --all; did you mean `conversions remove`?")
        entries = list_conversions()
        if not entries:
            print(f"no cached conversions in {cache_root()}")
            return 0
        for c in entries:
            gone = "" if c.source_exists else "  (source file gone)"
            print(f"{c.path.name:<48} {format_bytes(c.nbytes):>10}  {c.dtype or 'as stored':<9}  {c.source}{gone}")
        total = sum(c.nbytes for c in entries)
        print(f"{len(entries)} conversion{'s' if len(entries) != 1 else ''}, {format_bytes(total)} in {cache_root()}")
        return 0
    if not args.names and not args.all:
        raise MlxEvictError(
            "`conversions remove` needs a NAME from `mlxevict conversions list`, a .gguf file, or --all"
        )
    removed = remove_conversions(args.names, everything=args.all)
    freed = format_bytes(sum(c.nbytes for c in removed))
    print(f"removed {len(removed)} conversion{'s' if len(removed) != 1 else ''}, {freed} freed")
    return 0
