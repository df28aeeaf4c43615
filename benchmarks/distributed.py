"""Decode speed of one model sharded over 1, 2 and 3 local ranks (``mlx.launch --backend ring``).

Each row is one ``mlxevict generate --json`` run, greedy, same prompt, budget and
policy, started under ``mlx.launch -n N`` (``N`` = 1 runs it alone); the rows of
one call run side by side, so their ratios are what to read on a shared machine.
On one machine the ranks share its cores and talk through local sockets, so more
ranks are slower: the numbers show what the communication costs, not a speed-up.

The demo model's 3 KV heads do not split over 2 ranks, so by default the model is
SmolLM2-135M's shape with 12 query and 6 KV heads of 48 dims (the same hidden
size, MLP and 30 layers; random weights, the demo's tokenizer), built once into
``$MLXEVICT_CACHE/bench-6kv``; pass a model folder to measure another.

    bash scripts/with-openblas python -m mlxevict.benchmarks.distributed --ranks 1,2,3 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from mlxevict.demo_model import cache_dir, demo_model_path

PROMPT = "Explain step by step why the sky is blue, then say it in one sentence."
LAUNCHER = "from mlx._distributed_utils.launch import main; main()"


def bench_model() -> Path:
    """SmolLM2-135M's shape with 6 KV heads (divisible by 1, 2, 3 ranks), random weights; built once."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    demo = demo_model_path("float32")
    folder = cache_dir() / "bench-6kv"
    if (folder / "model.safetensors").exists():
        return folder
    config = json.loads((demo / "config.json").read_text())
    config.update(num_attention_heads=12, num_key_value_heads=6, head_dim=48)
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, folder / name)
    mx.random.seed(0)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def generate_command(model: Path, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable, "-m", "mlxevict.cli", "generate", str(model), "-p", PROMPT, "--json", "--temp", "0",
        "--max-tokens", str(args.max_tokens), "--budget", str(args.budget), "--policy", args.policy,
    ]  # fmt: skip


def run_ranks(model: Path, ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run on ``ranks`` local processes; rank 0's JSON report."""
    command = generate_command(model, args)
    if ranks > 1:
        command = [sys.executable, "-c", LAUNCHER, "-n", str(ranks), "--backend", "ring", "--", *command]
    # stdin stays open: at EOF mlx.launch polls it in a busy loop that takes a core from the ranks.
    read, write = os.pipe()
    try:
        env = os.environ | {"HF_HUB_OFFLINE": "1"}
        done = subprocess.run(command, stdin=read, capture_output=True, text=True, env=env)
    finally:
        os.close(read)
        os.close(write)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"{ranks} ranks: no report\n{done.stderr[-2000:]}")
    return json.loads(lines[-1])


def row(ranks: int, report: dict[str, Any], base: float) -> str:
    alone = {"kv_nbytes": report["cache"]["nbytes"], "mlx_peak": report["memory"]["mlx_peak"]}
    per_rank = report.get("ranks") or [alone]
    kv = " / ".join(f"{r['kv_nbytes'] / 2**20:.2f}" for r in per_rank)
    peak = " / ".join(f"{r['mlx_peak'] / 2**20:.0f}" for r in per_rank)
    speed = report["tokens_per_s"]
    return (
        f"| {ranks} | {speed:.1f} | {speed / base:.2f}x | {report['prompt_tokens_per_s']:.1f} | "
        f"{report['generated_tokens']} | {kv} | {peak} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="model folder (default: the demo's shape with 6 KV heads)")
    parser.add_argument("--ranks", default="1,2,3", help="rank counts, comma-separated (each divides the KV heads)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--policy", default="default")
    parser.add_argument("--repeat", type=int, default=1, help="runs per rank count; the fastest is kept")
    args = parser.parse_args()
    model = Path(args.model) if args.model else bench_model()
    counts = [int(n) for n in args.ranks.split(",")]
    reports = {}
    for _ in range(args.repeat):
        for n in counts:  # interleaved, so a change in the machine's load touches every count alike
            report = run_ranks(model, n, args)
            if n not in reports or report["tokens_per_s"] > reports[n]["tokens_per_s"]:
                reports[n] = report
    answers = {r["answer"] for r in reports.values()}
    print(f"model {model.name}, policy {args.policy}, budget {args.budget}, {args.max_tokens} greedy tokens")
    print("| ranks | decode tok/s | vs 1 rank | prompt tok/s | tokens | KV MiB per rank | peak MiB per rank |")
    print("|---|---|---|---|---|---|---|")
    base = reports[counts[0]]["tokens_per_s"]
    for n in counts:
        print(row(n, reports[n], base))
    print(f"same answer on every rank count: {len(answers) == 1}")


if __name__ == "__main__":
    main()
