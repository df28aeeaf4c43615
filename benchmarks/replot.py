"""Draw the plots of saved results again from their JSON, without measuring anything.

    python -m mlxevict.benchmarks.replot docs/results

Every ``eval.json`` (-> ``eval.png``, ``eval_bytes.png``), ``long.json`` (-> ``long_<half>.png``), ``bench.json`` (-> ``memory.png``, when it
has a context sweep) and ``kv_bits.json`` (-> ``kv_bits.png``) under the folders given.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .report import plot_bytes, plot_eval, plot_memory
from .style import DEFAULT_POLICY


def replot(json_path: Path) -> list[Path]:
    """The plots drawn again for one results file (next to it)."""
    results = json.loads(json_path.read_text())
    folder, model = json_path.parent, results.get("model", "")
    if json_path.name == "eval.json":
        title = f"mlxevict eval: quality vs KV bytes ({model})"
        default_policy = results.get("default_policy", DEFAULT_POLICY)
        return [
            plot_eval(results, folder / "eval.png"),
            plot_bytes(results["rows"], folder / "eval_bytes.png", title, default_policy),
        ]
    if json_path.name == "long.json":
        from .long_report import plot_long

        return plot_long(results, folder)
    if json_path.name == "bench.json":
        return [plot_memory(results, folder / "memory.png")] if results.get("context") else []
    if json_path.name == "kv_bits.json" and results.get("quality"):
        title = f"evict and quantize: quality vs KV bytes ({model})"
        return [plot_bytes(results["quality"]["rows"], folder / "kv_bits.png", title)]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlxevict.benchmarks.replot", description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="folders searched for results JSON")
    args = parser.parse_args(argv)
    for folder in args.folders:
        for json_path in sorted(folder.rglob("*.json")):
            for path in replot(json_path):
                print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
