"""Retrieval and fidelity of policy *variants* (constructor arguments), for tuning a default.

``mlxevict eval`` compares caches by name; this runs the same teacher-forced tasks
(retrieval after reasoning, fidelity on natural text; no generation) for policies
built with keyword arguments, each against the full cache of the same run:

    bash scripts/with-openblas python -m mlxevict.benchmarks.variants --seed 1 --budgets 128,256 \\
        window default 'default|{"observation_window": 32}'

A spec is a cache name (see ``mlxevict eval --help``) or ``policy|{json kwargs}`` for
``mlxevict.make_cache(model, policy, budget, **kwargs)``.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from typing import Any

import mlx.nn as nn
from mlx_lm import load

import mlxevict
from mlxevict.demo_model import demo_model_path

from .caches import CacheSettings, kv_bytes_16bit, make_caches
from .quality import EvalConfig, Workload, answer_correct, build_workload, retained_answers, teacher_force


def make_variant(model: nn.Module, spec: str, budget: int, settings: CacheSettings) -> list[Any]:
    """Caches for ``name`` or ``policy|{json kwargs}``."""
    name, _, kwargs = spec.partition("|")
    if not kwargs:
        return make_caches(model, name, budget, settings)
    return mlxevict.make_cache(model, name, budget, **json.loads(kwargs))


def correct_answers(work: Workload, predicted: list[list[int]]) -> list[list[bool]]:
    """Per retrieval task, per answer: did the greedy prediction match it?"""
    return [answer_correct(task, rows) for task, rows in zip(work.retrieval, predicted)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+", help="cache names or 'policy|{json kwargs}'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budgets", default="128,256", help="entries per layer, comma-separated")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--fidelity", type=int, default=4, help="natural texts (default 4)")
    parser.add_argument("--retrieval", type=int, default=4, help="retrieval tasks (default 4)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # prompt-pinning warnings, once per cache
    model, tokenizer = load(str(demo_model_path("float32")))
    config = EvalConfig(
        names=("kvcache",), context=args.context, fidelity=args.fidelity, retrieval=args.retrieval, seed=args.seed
    )
    work = build_workload(tokenizer, config)
    print(
        f"| spec | budget | retrieval | top-1 | KL (nats) | KV / 16-bit full | seconds |"
        f"  (seed {args.seed}, context {args.context})"
    )
    print("|---|---|---|---|---|---|---|")
    with mlxevict.patched(model):
        full = make_caches(model, "kvcache", None, config.settings)
        predicted, reference, _, _ = teacher_force(model, full, work, config.step, None)
        solved = correct_answers(work, predicted)
        full_bytes = kv_bytes_16bit(full)
        for spec in args.specs:
            for budget in (int(b) for b in args.budgets.split(",")):
                start = time.perf_counter()
                caches = make_variant(model, spec, budget, config.settings)
                predicted, _, top1, kl = teacher_force(model, caches, work, config.step, reference)
                kept = retained_answers(correct_answers(work, predicted), solved)
                seconds = time.perf_counter() - start
                relative = kv_bytes_16bit(caches) / full_bytes
                print(
                    f"| {spec} | {budget} | {sum(kept)}/{len(kept)} | {top1:.3f} | {kl:.4f} | {relative:.3f} "
                    f"| {seconds:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
