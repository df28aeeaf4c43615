"""Start-up time of the ``mlxevict`` command: wall and user CPU seconds until ``--help`` has printed.

    python -m mlxevict.benchmarks.startup [--repeat 5]

Each command runs ``--repeat`` times as a user runs it (the installed console
script, with its OpenBLAS re-exec); the table shows the median. ``import mlx_lm``
is measured beside it, in the same run, as the cost the help no longer pays.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

COMMANDS = (
    ("mlxevict --help", ["{mlxevict}", "--help"]),
    ("mlxevict generate --help", ["{mlxevict}", "generate", "--help"]),
    ("mlxevict chat --help", ["{mlxevict}", "chat", "--help"]),
    ("python -c 'import mlxevict'", ["{python}", "-c", "import mlxevict"]),
    ("python -c 'import mlx_lm' (reference)", ["{python}", "-c", "import mlx_lm"]),
)


def run_once(argv: list[str]) -> tuple[float, float]:
    """Wall and user+system CPU seconds of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(repeat: int) -> list[tuple[str, float, float]]:
    """``(command, median wall s, median CPU s)`` per command."""
    script = os.path.join(os.path.dirname(sys.executable), "mlxevict")
    rows = []
    for label, template in COMMANDS:
        argv = [part.format(mlxevict=script, python=sys.executable) for part in template]
        runs = [run_once(argv) for _ in range(repeat)]
        rows.append((label, statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlxevict.benchmarks.startup", description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per command (default %(default)s)")
    args = parser.parse_args(argv)
    print(f"| command | wall s (median of {args.repeat}) | CPU s |")
    print("|---|---|---|")
    for label, wall, cpu in measure(args.repeat):
        print(f"| `{label}` | {wall:.2f} | {cpu:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
