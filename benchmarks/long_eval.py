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
"""

from __future__ import annotations

import gc
import json
import math
import time
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import storage_variants as sv
from .caches import (
    MLX_LM_CACHES,
    REFERENCE,
    CacheSettings,
    check_budget,
    entries_within,
    kv_bytes_16bit,
    layer_kv_bytes_per_token,
    make_caches,
    split_storage,
)
from .long_tasks import KINDS, LongRow, make_long_rows, make_long_texts
from .quality import kl_divergence, log_softmax

PROTOCOLS = ("stream", "compress")
CHUNK = 64
TOKEN_FRACTIONS = (0.5, 0.25, 0.125)
MEMORY_FRACTIONS = (0.25, 0.125)
SEEDS = {"tuning": 0, "test": 1}
CHOSEN = "chosen"  # the test half's name for the storage the tuning half picked
TEST_POLICIES = ("default", "window", "snapkv", "entropy", "uncertainty")  # --policies adds tova, h2o, ...
COMPRESS_POLICIES = ("default", "snapkv")
TUNING_VARIANTS = ("kivi-k5v3", "tiers-k3v2")  # measured in docs/results/long; --variants tries the others
PRODUCT_STORAGE = "default:k5v3w8c64"  # the memory-budget rule's storage today (keys per channel, the real kivi-k5v3)
PARTS = ("baselines", "policies", "compress", "memory", "chosen")  # "variants": also every simulated storage

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Run:
    """One cache under one budget and protocol. ``budget_of``: ``"tokens"``, ``"memory"`` or ``None``."""

    cache: str
    budget_of: str | None = None
    fraction: float | None = None
    protocol: str = "stream"

    @property
    def label(self) -> str:
        budget = "" if self.fraction is None else f" @ {self.fraction:g} {self.budget_of}"
        return f"{self.cache} [{self.protocol}]{budget}"


@dataclass(frozen=True)
class LongConfig:
    """What the long suite runs. Sized toward ~30 minutes on an idle 2-core CPU with SmolLM2-135M;
    not yet timed there (docs/results/long/README.md ran a cut-down version on a loaded machine)."""

    lengths: tuple[int, ...] = (1024, 2048)
    kinds: tuple[str, ...] = KINDS
    instances: int = 1
    fidelity_texts: int = 2
    fidelity_length: int = 2048
    fidelity_scored: int = 256
    policies: tuple[str, ...] = TEST_POLICIES
    compress_policies: tuple[str, ...] = COMPRESS_POLICIES
    token_fractions: tuple[float, ...] = TOKEN_FRACTIONS
    memory_fractions: tuple[float, ...] = MEMORY_FRACTIONS
    variants: tuple[str, ...] = TUNING_VARIANTS
    baselines: tuple[str, ...] = ("quantized8", "quantized4", "quantized3")
    splits: tuple[str, ...] = ("tuning", "test")
    parts: tuple[str, ...] = PARTS  # which groups of the test half's runs
    reference_dir: str | None = None  # keep the full cache's outcomes here, for runs split across processes
    chunk: int = CHUNK
    settings: CacheSettings = field(default_factory=CacheSettings)

    def runs(self, split: str) -> list[Run]:
        """The tuning half: the default policy and every storage candidate per memory budget.
        The test half: mlx-lm's caches, every policy per token budget and protocol, and the picked storage."""
        mem = [Run(c, "memory", f) for f in self.memory_fractions for c in ("default", PRODUCT_STORAGE)]
        if split == "tuning":
            storages = (*(("default", PRODUCT_STORAGE) if "memory" in self.parts else ()), *self.variants)
            return [Run(REFERENCE), *(Run(c, "memory", f) for f in self.memory_fractions for c in storages)]
        groups = {
            "baselines": [Run(b) for b in self.baselines] + [Run("rotating", "tokens", f) for f in self.token_fractions],
            "policies": [Run(p, "tokens", f) for p in self.policies for f in self.token_fractions],
            "compress": [Run(p, "tokens", f, "compress") for p in self.compress_policies for f in self.token_fractions],
            "memory": mem,
            "variants": [Run(v, "memory", f) for f in self.memory_fractions for v in self.variants],
            "chosen": [Run(CHOSEN, "memory", f) for f in self.memory_fractions],
        }
        return [Run(REFERENCE), *(r for part in self.parts for r in groups[part])]


@dataclass
class Batch:
    """Rows of one length fed together; logits are kept from ``tail`` on."""

    name: str
    tokens: mx.array  # B, L
    tail: int
    rows: list[LongRow]  # empty for fidelity


def build_batches(tokenizer: Any, config: LongConfig, split: str) -> list[Batch]:
    seed = SEEDS[split]
    batches = []
    for L in config.lengths:
        rows = make_long_rows(tokenizer, L, split, seed, config.kinds, config.instances)
        batches.append(Batch(f"retrieval {L}", mx.array([r.tokens for r in rows]), min(r.question_start for r in rows), rows))
    if config.fidelity_texts:
        texts = make_long_texts(tokenizer, config.fidelity_texts, config.fidelity_length, split, seed)
        batches.append(Batch("fidelity", mx.array(texts), config.fidelity_length - config.fidelity_scored, []))
    return batches


def _chunks(a: int, b: int, step: int) -> list[tuple[int, int]]:
    return [(s, min(s + step, b)) for s in range(a, b, step)]


def feed(model: nn.Module, caches: list[Any], tokens: mx.array, a: int, b: int, step: int) -> list[mx.array]:
    """Feed ``tokens[:, a:b]`` in ``step``-token calls; return each call's logits."""
    out = []
    for s, e in _chunks(a, b, step):
        out.append(model(tokens[:, s:e], cache=caches))
        mx.eval(out[-1], [(c.keys, c.values) for c in caches if not c.empty()])
    return out


def fork(prefilled: list[Any], fresh: list[Any], chunk: int) -> list[Any]:
    """``fresh`` caches (a budget not yet used) holding what ``prefilled`` holds after a compress-mode prefill.

    Before compression a compress-mode cache holds every token whatever its budget; only
    the budget-dependent settings (budget, window, slack, the prompt pin) differ. The
    prompt pin is replayed over the prefill's ``chunk``-token calls, as the patched model
    would have fed it to ``fresh`` (:meth:`~mlxevict.cache.EvictingKVCache.feed_prompt`).
    """
    for old, new in zip(prefilled, fresh):
        for s, e in _chunks(0, old.offset, chunk):
            new.offset = s
            new.feed_prompt(e - s)
        meta, held = new._meta(), old._meta()
        meta.update({k: held[k] for k in ("policy_state", "offset", "size", "evictions", "scale")})
        new.state = (*old.state[:6], json.dumps(meta))
    return fresh


def budget_for(model: nn.Module, run: Run, length: int, settings: CacheSettings) -> int | None:
    """Entries per layer for ``run`` at ``length``; ``None`` for unbudgeted caches."""
    if run.fraction is None or run.cache in sv.VARIANTS:
        return None
    if run.budget_of == "memory" and split_storage(run.cache)[1]:
        return entries_within(model, run.cache, run.fraction, length, settings)
    return max(1, round(run.fraction * length))


def build(model: nn.Module, run: Run, length: int, settings: CacheSettings) -> list[Any]:
    if run.cache in sv.VARIANTS:
        return sv.make_simulated(model, run.cache, run.fraction, length, sinks=settings.sinks, prompt_mode=_mode(run))
    budget = budget_for(model, run, length, settings)
    if run.protocol == "stream":
        return make_caches(model, run.cache, budget, settings)
    import mlxevict

    policy, storage = split_storage(run.cache)
    if storage:
        storage["kv_group_size"] = 64
    return mlxevict.make_cache(
        model, policy, budget, sinks=settings.sinks, window=settings.window, slack=settings.slack,
        prompt_mode="compress", **storage,
    )  # fmt: skip


def _mode(run: Run) -> str:
    return "compress" if run.protocol == "compress" else "evict"


def kv_fraction(model: nn.Module, caches: list[Any], length: int) -> float:
    """KV bytes held (16-bit model) per row, relative to a 16-bit full cache of ``length`` tokens."""
    if caches and isinstance(caches[0], sv.SimulatedStorageCache):
        return sv.simulated_fraction(caches, length, sv.head_dim_of(model))
    rows = next(c for c in caches if not c.empty()).keys
    B = (rows[0] if isinstance(rows, (tuple, list)) else rows).shape[0]
    return kv_bytes_16bit(caches) / (B * length * layer_kv_bytes_per_token(model, 2))


def tail_logits(model: nn.Module, caches: list[Any], batch: Batch, protocol: str, chunk: int, held: bool) -> mx.array:
    """``(B, L - tail, V)`` logits of the tail; ``held``: the context is already in the caches."""
    L = batch.tokens.shape[1]
    if not held:
        feed(model, caches, batch.tokens, 0, batch.tail, chunk)
    step = 1 if protocol == "compress" else chunk
    return mx.concatenate(feed(model, caches, batch.tokens, batch.tail, L, step), axis=1)


@dataclass
class Outcome:
    """What one run did on one batch."""

    correct: list[list[bool]] = field(default_factory=list)  # per row, per answer
    logprobs: mx.array | None = None  # reference only: fidelity tail
    top1: float = math.nan
    kl: float = math.nan
    kv_fraction: float = math.nan


def score(batch: Batch, logits: mx.array, ref: Outcome | None) -> Outcome:
    """Retrieval answers or fidelity against the reference's outcome (``None``: this is the reference)."""
    if batch.rows:
        pred = logits.argmax(axis=-1).tolist()  # B, T
        pad = [0] * batch.tail  # predictions index absolute positions
        return Outcome(correct=[r.correct(pad + p) for r, p in zip(batch.rows, pred)])
    lp = log_softmax(logits)
    if ref is None:
        return Outcome(logprobs=lp, top1=1.0, kl=0.0)
    top1 = (lp.argmax(axis=-1) == ref.logprobs.argmax(axis=-1)).mean().item()
    return Outcome(top1=top1, kl=kl_divergence(ref.logprobs, lp).mean().item())


def _release() -> None:
    gc.collect()
    mx.clear_cache()


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
    result = {"split": split, "seed": SEEDS[split], "rows": rows, "skipped": skipped, "tasks": _describe(batches)}
    runs, picked = [], set()
    for r in config.runs(split):
        if r.cache == CHOSEN and r.fraction not in chosen:
            skipped.append({"split": split, "run": r.label, "reason": "no tuning result: run the tuning half first"})
            continue
        if r.cache == CHOSEN:
            r = Run(chosen[r.fraction], r.budget_of, r.fraction, r.protocol)
            picked.add(r)
        if r not in runs:
            runs.append(r)
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
        same = _same_as(run, rows)
        if same is not None:  # a 16-bit cache's share of bytes is its share of tokens: already measured
            rows.append({**same, "budget_of": "memory", "seconds": 0.0, "picked_on_tuning": run in picked})
            continue
        for batch in batches:
            L = batch.tokens.shape[1]
            _release()
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
        rows.append(_row(run, outcomes, refs, batches, time.perf_counter() - started))
        rows[-1]["picked_on_tuning"] = run in picked
        if on_row:
            on_row(result)
    return result


def reference_path(config: LongConfig, split: str, batch: Batch) -> Path | None:
    """Where the full cache's outcome on ``batch`` is kept between runs (``config.reference_dir``), or ``None``."""
    if not config.reference_dir:
        return None
    digest = zlib.crc32(np.asarray(batch.tokens).tobytes())
    return Path(config.reference_dir) / f"{split}-{batch.name.replace(' ', '')}-{batch.tail}-{digest:08x}"


def save_reference(path: Path, out: Outcome) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if out.logprobs is not None:
        mx.save(str(path.with_suffix(".npy")), out.logprobs)
    path.with_suffix(".json").write_text(json.dumps({"correct": out.correct, "kv_fraction": out.kv_fraction}))


def load_reference(path: Path) -> Outcome:
    meta = json.loads(path.with_suffix(".json").read_text())
    npy = path.with_suffix(".npy")
    logprobs = mx.load(str(npy)) if npy.exists() else None
    top1, kl = (1.0, 0.0) if logprobs is not None else (math.nan, math.nan)
    return Outcome(meta["correct"], logprobs, top1, kl, meta["kv_fraction"])


def _same_as(run: Run, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The token-budget row that a 16-bit cache's memory-budget ``run`` repeats, if measured."""
    if run.budget_of != "memory" or run.cache in sv.VARIANTS or split_storage(run.cache)[1]:
        return None
    match = (run.cache, "tokens", run.fraction, run.protocol)
    return next((r for r in rows if (r["cache"], r["budget_of"], r["fraction"], r["protocol"]) == match), None)


def _row(run: Run, outcomes: dict[str, Outcome], refs: dict[str, Outcome], batches: list[Batch], seconds: float) -> dict[str, Any]:
    row: dict[str, Any] = {
        "cache": run.cache, "budget_of": run.budget_of, "fraction": run.fraction, "protocol": run.protocol,
        "kind": "mlx-lm" if split_storage(run.cache)[0] in MLX_LM_CACHES else "mlxevict", "seconds": round(seconds, 1),
    }  # fmt: skip
    kept, by_length, by_kind = [], {}, {}
    for batch in batches:
        if not batch.rows:
            continue
        solved = refs[batch.name].correct
        for r, ok, ref in zip(batch.rows, outcomes[batch.name].correct, solved):
            hits = [o for o, s in zip(ok, ref) if s]
            kept += hits
            by_length.setdefault(str(batch.tokens.shape[1]), []).extend(hits)
            by_kind.setdefault(r.kind, []).extend(hits)
    row["retrieval"] = [sum(kept), len(kept)]
    row["retrieval_accuracy"] = sum(kept) / len(kept) if kept else None
    row["retrieval_by_length"] = {k: [sum(v), len(v)] for k, v in by_length.items()}
    row["retrieval_by_kind"] = {k: [sum(v), len(v)] for k, v in by_kind.items()}
    fid = outcomes.get("fidelity")
    row["fidelity_top1"] = fid.top1 if fid else None
    row["fidelity_kl"] = fid.kl if fid else None
    fractions = [o.kv_fraction for o in outcomes.values()]
    row["kv_fraction_16bit"] = max(fractions) if fractions else None
    return row


def _describe(batches: list[Batch]) -> list[dict[str, Any]]:
    out = []
    for b in batches:
        out.append({
            "batch": b.name, "rows": int(b.tokens.shape[0]), "tokens": int(b.tokens.shape[1]), "tail_from": b.tail,
            "kinds": [r.kind for r in b.rows], "depths": [[round(d, 2) for d in r.depths] for r in b.rows],
        })  # fmt: skip
    return out


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
    results: dict[str, Any] = {"kind": "long", "config": _config(config), "splits": {}, "chosen": _keys(chosen)}
    with warnings.catch_warnings(), mlxevict.patched(model):
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


def _config(config: LongConfig) -> dict[str, Any]:
    out = {k: getattr(config, k) for k in LongConfig.__dataclass_fields__ if k != "settings"}
    out["settings"] = vars(config.settings)
    out["seeds"] = SEEDS
    return json.loads(json.dumps(out, default=list))


def total_runs(config: LongConfig) -> int:
    return sum(len(config.runs(s)) for s in config.splits)
