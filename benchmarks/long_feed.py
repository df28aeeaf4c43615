"""The long suite's feeding: the rows as batches, the caches a run builds, and the chunks fed to them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import storage_variants as sv
from .caches import CacheSettings, disk_pages, entries_within, kv_bytes_16bit, layer_kv_bytes_per_token, make_caches, split_storage
from .long_runs import SEEDS, LongConfig, Run
from .long_tasks import LongRow, make_long_rows, make_long_texts, make_recall_texts, text_leads


@dataclass
class Batch:
    """Rows of one length fed together; logits are kept from ``tail`` on."""

    name: str
    tokens: mx.array  # B, L
    tail: int
    rows: list[LongRow]  # empty for fidelity
    leads: list[str] = field(default_factory=list)  # fidelity, recall: the source leading each text
    restated_from: list[int] = field(default_factory=list)  # recall: where each restated passage starts


def build_batches(tokenizer: Any, config: LongConfig, split: str) -> list[Batch]:
    seed = SEEDS[split]
    batches = []
    for L in config.lengths_of(split):
        rows = make_long_rows(tokenizer, L, split, seed, config.kinds, config.instances)
        batches.append(Batch(f"retrieval {L}", mx.array([r.tokens for r in rows]), min(r.question_start for r in rows), rows))
    if config.fidelity_texts:
        texts = make_long_texts(tokenizer, config.fidelity_texts, config.fidelity_length, split, seed)
        leads = text_leads(config.fidelity_texts, split)
        batches.append(Batch("fidelity", mx.array(texts), config.fidelity_length - config.fidelity_scored, [], leads))
    if config.recall_texts:
        length, scored = config.fidelity_length, config.fidelity_scored
        texts, starts = make_recall_texts(tokenizer, config.recall_texts, length, scored, split, seed)
        leads = text_leads(config.recall_texts, split)
        batches.append(Batch("recall", mx.array(texts), length - scored, [], leads, starts))
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
    if run.budget_of == "memory" and (split_storage(run.cache)[1] or disk_pages(run.cache) is not None):  # the sketch counted
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
