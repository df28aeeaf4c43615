"""``mlxevict eval`` (the long suite): quality per byte on long natural prose, tuning and test kept apart.

Rows of 1k and 2k tokens (``--long``: also 4k and 8k) hide facts inside the
streamed text (:mod:`.long_tasks`); fidelity rows are 2k-token natural texts whose last
256 tokens are scored (top-1 agreement and ``KL(full ‖ cache)``). Two protocols:

- ``stream``: everything arrives in 64-token chunks under the budget (the product's
  default, as a long chain of thought grows);
- ``compress``: the context is held whole, then compressed to the budget at the first
  single-token step (``prompt_mode="compress"``, kvpress style); the question (or the
  scored tail) follows one token at a time. The held context is the same for every
  budget, so it is prefilled once per cache and copied for each budget.

Budgets are shares of the context in tokens, or of a 16-bit full cache's KV bytes
(``memory``: each storage keeps the entries its bytes hold). The tuning half of the
prose (seed 0) picks the storage for each memory budget (:func:`choose_storage`); the
test half (seed 1) runs the pick beside everything else, and nothing is chosen on it.

The parts: which runs (:mod:`.long_runs`), the batches, caches and feeding
(:mod:`.long_feed`), the scores and result rows (:mod:`.long_score`); this module
runs the two halves.
"""

from __future__ import annotations

import json
import time
import warnings
from typing import Any, Callable

import mlx.nn as nn

from .baseline_attention import dense_prompt_chunks
from .caches import REFERENCE, check_budget, release
from .long_feed import budget_for, build, build_batches, feed, fork, kv_fraction, tail_logits
from .long_runs import CHOSEN, PRODUCT, SEEDS, LongConfig, Run, config_json
from .long_score import (
    Outcome,
    describe_batches,
    load_reference,
    reference_path,
    result_row,
    same_as,
    save_reference,
    score,
)

Progress = Callable[[str], None]


def product_storage(model: nn.Module, fraction: float, length: int) -> str:
    """The memory rule's storage for this model at ``fraction`` of a 16-bit full cache of ``length`` tokens, its
    bytes counted at 16 bits as every row's are: its page store (``disk-32``) where :func:`mlxevict.plan.rule_pages`
    picks it, else its precision tiers (:func:`mlxevict.plan.tiers_storage`, with the model's calibrated layers)."""
    from mlxevict.geometry import kv_shape
    from mlxevict.kvstorage import DEFAULT_GROUP_SIZE
    from mlxevict.paged_storage import DEFAULT_PAGES
    from mlxevict.plan import calibrated_layers, rule_pages, tiers_storage

    budget = f"{int(fraction * length * kv_shape(model, 2).bytes_per_token)}B"
    if rule_pages(model, budget, length, DEFAULT_PAGES, dtype_size=2):
        return f"disk-{DEFAULT_PAGES}"
    return "default" + tiers_storage(fraction, DEFAULT_GROUP_SIZE, calibrated_layers(model)).suffix


def split_runs(
    model: nn.Module, config: LongConfig, split: str, chosen: dict[float, str], skipped: list[dict[str, Any]]
) -> tuple[list[Run], set[Run]]:
    """The runs of ``split`` by the storage each names (:data:`CHOSEN` and :data:`PRODUCT` resolved, repeats
    dropped), and those picked on the tuning half; a chosen run without a tuning result goes to ``skipped``."""
    runs: list[Run] = []
    picked: set[Run] = set()
    shortest = min((*config.lengths_of(split), config.fidelity_length))
    for r in config.runs(split):
        if r.cache == CHOSEN and r.fraction not in chosen:
            skipped.append({"split": split, "run": r.label, "reason": "no tuning result: run the tuning half first"})
            continue
        if r.cache == CHOSEN:
            r = Run(chosen[r.fraction], r.budget_of, r.fraction, r.protocol)
            picked.add(r)
        if r.cache == PRODUCT:  # one storage for every length: the rule's at the shortest
            r = Run(product_storage(model, r.fraction, shortest), r.budget_of, r.fraction, r.protocol)
        if r not in runs:
            runs.append(r)
    return runs, picked


def run_split(
    model: nn.Module,
    tokenizer: Any,
    config: LongConfig,
    split: str,
    chosen: dict[float, str],
    progress: Progress | None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every run of ``split``; ``chosen``: memory fraction -> storage name, for :data:`CHOSEN` runs.

    ``on_row`` gets the split's results so far after each run (to save partial results).
    """
    batches = build_batches(tokenizer, config, split)
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    result = {"split": split, "seed": SEEDS[split], "rows": rows, "skipped": skipped, "tasks": describe_batches(batches)}
    runs, picked = split_runs(model, config, split, chosen, skipped)
    refs: dict[str, Outcome] = {}
    held: dict[tuple[str, str], list[Any]] = {}  # compress-mode prefill per (cache, batch)
    for run in runs:
        if progress:
            progress(f"{split}: {run.label}")
        started, outcomes = time.perf_counter(), {}
        why = None
        for batch in batches:
            L = batch.tokens.shape[1]
            budget = budget_for(model, run, L, config.settings)
            why = why or (budget is not None and check_budget(run.cache, budget, config.settings)) or None
        if why:
            skipped.append({"split": split, "run": run.label, "reason": why})
            continue
        same = same_as(run, rows)
        if same is not None:  # a 16-bit cache's share of bytes is its share of tokens: already measured
            rows.append({**same, "budget_of": "memory", "seconds": 0.0, "picked_on_tuning": run in picked})
            continue
        for batch in batches:
            L = batch.tokens.shape[1]
            release(reset_peak=False)
            stored = reference_path(config, split, batch) if run == Run(REFERENCE) else None
            if stored and stored.with_suffix(".json").exists():
                refs[batch.name] = outcomes[batch.name] = load_reference(stored)
                continue
            caches = build(model, run, L, config.settings)
            key = (run.cache, batch.name)
            shared = run.protocol == "compress" and type(caches[0]).__name__ == "EvictingKVCache"
            if shared and key in held:
                caches = fork(held[key], caches, min(config.chunk, L))
            elif shared:
                prefill = build(model, Run(run.cache, "tokens", 1.0, "compress"), L, config.settings)
                feed(model, prefill, batch.tokens, 0, batch.tail, config.chunk)
                held = {key: prefill}  # one cache's prefill at a time: runs of a cache are consecutive
                caches = fork(prefill, caches, min(config.chunk, L))
            logits = tail_logits(model, caches, batch, run.protocol, config.chunk, held=shared)
            out = score(batch, logits, refs.get(batch.name))
            out.kv_fraction = kv_fraction(model, caches, L)
            if run == Run(REFERENCE):
                refs[batch.name] = out
                if stored:
                    save_reference(stored, out)
            outcomes[batch.name] = out
            del caches, logits
        rows.append(result_row(run, outcomes, refs, batches, time.perf_counter() - started))
        rows[-1]["picked_on_tuning"] = run in picked
        if on_row:
            on_row(result)
    return result


def choose_storage(rows: list[dict[str, Any]], fractions: tuple[float, ...]) -> dict[float, str]:
    """Per memory fraction, the tuning half's best storage: most retrieval answers, then lowest KL."""
    chosen = {}
    for f in fractions:
        cands = [r for r in rows if r["budget_of"] == "memory" and r["fraction"] == f and r["fidelity_kl"] is not None]
        if cands:
            best = min(cands, key=lambda r: (-(r["retrieval_accuracy"] or 0.0), r["fidelity_kl"]))
            chosen[f] = best["cache"]
    return chosen


def run_long(
    model: nn.Module,
    tokenizer: Any,
    config: LongConfig,
    progress: Progress | None = None,
    chosen: dict[float, str] | None = None,
    save: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The tuning half, the storage it picks, then the test half; results as data.

    ``chosen`` (memory fraction -> storage) stands in for a tuning half run earlier
    (``--chosen-from``); a tuning half in ``config.splits`` replaces it. ``save`` gets the
    results so far after every run.

    Returns:
        ``{"kind": "long", "config": ..., "chosen": {fraction: storage}, "splits": {name: {...}}}``.
    """
    import mlxevict

    chosen = dict(chosen or {})
    results: dict[str, Any] = {"kind": "long", "config": config_json(config), "splits": {}, "chosen": _keys(chosen)}
    with warnings.catch_warnings(), mlxevict.patched(model), dense_prompt_chunks():
        warnings.simplefilter("ignore")  # prompt-pinning warnings, once per cache
        for split in config.splits:
            def partial(out: dict[str, Any], split: str = split) -> None:
                results["splits"][split] = out
                if save:
                    save(results)

            out = run_split(model, tokenizer, config, split, chosen, progress, partial)
            results["splits"][split] = out
            if split == "tuning":
                chosen = choose_storage(out["rows"], config.memory_fractions)
                results["chosen"] = _keys(chosen)
    return results


def _keys(chosen: dict[float, str]) -> dict[str, str]:
    return {f"{k:g}": v for k, v in chosen.items()}


def load_chosen(path: str) -> dict[float, str]:
    """The storage picks of an earlier run's ``long.json`` (which must include the tuning half)."""
    with open(path) as f:
        data = json.load(f)
    if "tuning" not in data.get("splits", {}):
        raise ValueError(f"{path} has no tuning half; run with --splits tuning (or both) first")
    return {float(k): v for k, v in data["chosen"].items()}
