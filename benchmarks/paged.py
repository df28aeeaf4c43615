"""Evicted entries paged back: a pilot, measured before anything like it is built.

At 12.5% of a 16-bit cache's bytes every storage must evict most of a 2k context, and what is
evicted is gone: no policy keeps the facts asked later (docs/tiers.md). The way out that Quest
(Tang et al. 2024, https://arxiv.org/abs/2406.10774) and ArkVale (Chen et al. 2024) take is to keep
the evicted entries elsewhere (on a Mac: the SSD) and bring back, at each step, the pages the
current queries would attend to most. This module asks whether that would recover the facts,
before any SSD store is written: ``paged-K`` is the ``default`` policy on 16-bit entries under the
budget, plus every evicted entry kept aside (in memory here, counted nowhere) in pages of
``PAGE`` entries in the order they were evicted; each call reads the ``K`` pages with the highest
Quest bound (per kv-head: ``max`` over the call's queries of ``Σ_d max(q_d·min_d, q_d·max_d)``
over the page's keys) and the unfinished last page, and attends to them beside the kept entries.

``quest-K`` selects as Quest does, per query head and per token: each query attends to its own K
pages (and the unfinished one), so a kv-head reads the union of its query heads' and tokens' pages.
``shared-K`` selects per token and kv-head: the ``K`` pages with the highest bound for any of the
kv-head's query heads (``max`` over them), read once and attended to by all of them. A suffix ``bN``
(``shared-64b4``) keeps the pages in ``N`` bits (per entry, groups of 64 channels, as mlx-lm's
``QuantizedKVCache``; the bound and the attention both read them so). A suffix ``sN`` (``shared-64s2``)
scores the pages from an ``N``-bit copy of every evicted key instead of Quest's bound: a page's score for
a query is the attention mass its keys would take, ``logsumexp`` of ``scale · q·k̂`` over its entries.
At 2 bits (groups of 64 channels, a 16-bit scale and bias each) the copy is 2.5 bits a channel per
evicted key, against Quest's 2 (a 16-bit min and max a channel per 16-entry page): about the same
bytes kept in memory to choose with, one estimate per entry instead of one bound per page.

What it costs, were the pages on an SSD, is ``K · PAGE`` entries read per layer and kv-head per
call (``quest-K``: the union, up to ``K · PAGE`` per query head in a decode step; ``shared-K``: ``K · PAGE``
per kv-head in a decode step); the long suite measures what it buys, ``benchmarks/paged_reads.py``
what it reads.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

import mlxevict
from mlxevict.cache import EvictingKVCache
from mlxevict.dense_storage import DenseStorage
from mlxevict.paged_storage import held_mask

from .storage_variants import fake_quant

PAGE = 16  # entries per page (Quest's page size)
PREFIXES = {"paged-": "call", "quest-": "query", "shared-": "kvhead"}  # name: what one page choice serves


def _parse(name: str) -> Optional[tuple[int, str, Optional[int], Optional[int]]]:
    match = re.fullmatch(f"({'|'.join(PREFIXES)})" + r"(\d+)(?:s([234568]))?(?:b([234568]))?", name)
    if match is None:
        return None
    prefix, pages, score_bits, bits = match.groups()
    return int(pages), PREFIXES[prefix], int(bits) if bits else None, int(score_bits) if score_bits else None


def is_paged(name: str) -> bool:
    """``paged-K``, ``quest-K`` or ``shared-K``, K a whole number of pages (``-0`` reads nothing back: the plain
    cache), optionally ``sN``: pages scored from ``N``-bit keys, and ``bN``: pages kept in ``N`` bits, each one of
    mx.quantize's 2-6 or 8 (``shared-64b4``, ``shared-64s2b4``)."""
    return _parse(name) is not None


class PagedStorage(DenseStorage):
    """Dense entries under the budget, plus every entry compaction dropped, read back by page.

    The cache's compaction gathers the kept slots to the front in time order and the dropped ones
    after them (:func:`mlxevict.kernels.compact`), so the slots ``[n_keep, size)`` it hands back are
    exactly the entries evicted, oldest first: :meth:`set_slots` moves them aside.
    """

    def __init__(self, pages: int, select: str = "call", bits: Optional[int] = None,
                 score_bits: Optional[int] = None) -> None:
        super().__init__()
        self.pages, self.select, self.bits, self.score_bits = pages, select, bits, score_bits
        self.spilled: Optional[tuple[mx.array, mx.array]] = None  # (B, H, N, D) keys, values
        self.sketch: Optional[mx.array] = None  # (B, H, N, D) the spilled keys in score_bits, to score pages
        self._cut: Optional[tuple[int, int]] = None
        # Set to a list to count the whole pages read (per-query selections): (queries, pages a kv-head
        # reads, of them pages it did not read in the call before); None: not counted (no sync).
        self.reads: Optional[list[tuple[int, float, float]]] = None
        self._last: Optional[mx.array] = None

    def limit_groups(self, rank_key: mx.array, n_keep: int, size: int, budget: int) -> tuple[mx.array, int]:
        self._cut = (n_keep, size)  # the compaction that follows drops slots [n_keep, size)
        return rank_key, n_keep

    def set_slots(self, arrays: list[mx.array]) -> None:
        super().set_slots(arrays)
        if self._cut is None:
            return
        a, b = self._cut
        self._cut = None
        dropped = (self.keys[..., a:b, :], self.values[..., a:b, :])
        if self.score_bits:
            sketch = fake_quant(dropped[0], self.score_bits)
            self.sketch = sketch if self.sketch is None else mx.concatenate([self.sketch, sketch], axis=2)
            mx.eval(self.sketch)
        if self.bits:  # what reading them back from pages in fewer bits would give
            dropped = tuple(fake_quant(x, self.bits) for x in dropped)
        if self.spilled is None:
            self.spilled = dropped
        else:
            self.spilled = tuple(mx.concatenate([s, d], axis=2) for s, d in zip(self.spilled, dropped))
        mx.eval(self.spilled)

    def attend(self, queries, keys, values, scale, mask, sinks=None) -> Optional[mx.array]:
        if self.spilled is None or sinks is not None or not self.pages:
            return None
        if self.select != "call":
            return self._attend_per_query(queries, keys, values, scale, mask)
        sk, sv = self.spilled
        B, H, N, _ = sk.shape
        full = N // PAGE
        k = min(self.pages, full)
        idx = mx.arange(full * PAGE, N)  # the unfinished page: always read
        idx = mx.broadcast_to(idx, (B, H, N - full * PAGE))
        if k:
            bound = self._bounds(queries, full, scale)  # one choice for all of a kv-head's queries
            top = mx.argpartition(-bound.max(axis=2), k - 1, axis=-1)[..., :k]  # B, H, k
            picked = (mx.sort(top, axis=-1)[..., None] * PAGE + mx.arange(PAGE)).reshape(B, H, k * PAGE)
            idx = mx.concatenate([picked, idx], axis=-1)
        take = lambda x: mx.take_along_axis(x, idx[..., None], axis=2)  # noqa: E731
        keys = mx.concatenate([take(sk), keys], axis=2)
        values = mx.concatenate([take(sv), values], axis=2)
        if isinstance(mask, mx.array):  # the pages precede every query: seen (True, or 0 added)
            seen = mx.full((*mask.shape[:-1], idx.shape[-1]), mask.dtype == mx.bool_, mask.dtype)
            mask = mx.concatenate([seen, mask], axis=-1)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    def _bounds(self, queries: mx.array, full: int, scale: float) -> mx.array:
        """``(B, H, G*L, full)``: each query's score for each whole page of spilled keys (a kv-head's ``G`` query
        heads, then the ``L`` positions): Quest's bound on its dot products, or with ``score_bits`` the
        attention mass the page's sketched keys would take."""
        sk = self.spilled[0] if self.sketch is None else self.sketch
        B, H, _, D = sk.shape
        pages = sk[..., : full * PAGE, :].reshape(B, H, full, PAGE, D)
        q = queries.reshape(B, H, -1, D)
        if self.sketch is not None:
            s = (scale * q) @ pages.reshape(B, H, full * PAGE, D).swapaxes(-1, -2)  # B, H, G*L, full*PAGE
            return mx.logsumexp(s.reshape(*s.shape[:-1], full, PAGE), axis=-1)
        lo, hi = pages.min(axis=3), pages.max(axis=3)  # B, H, pages, D
        return mx.maximum(q, 0) @ hi.swapaxes(-1, -2) + mx.minimum(q, 0) @ lo.swapaxes(-1, -2)

    def _attend_per_query(self, queries, keys, values, scale, mask) -> mx.array:
        """Every spilled entry beside the kept ones, each query masked to its K pages and the unfinished one
        (its own, or its token's in its kv-head: ``select``)."""
        sk, sv = self.spilled
        B, _, N, _ = sk.shape
        _, Hq, L, _ = queries.shape
        S, full = keys.shape[2], N // PAGE
        k = min(self.pages, full)  # 0 only when no page is whole: every spilled entry is the unfinished page
        seen = mx.ones((B, Hq, L, N - full * PAGE), mx.bool_)  # the unfinished page
        if k:
            bound = self._bounds(queries, full, scale)  # B, H, G*L, full
            H = bound.shape[1]
            bound = bound.reshape(B, H, Hq // H, L, full)
            if self.select == "kvhead":
                bound = bound.max(axis=2, keepdims=True)
            kth = mx.sort(bound, axis=-1)[..., -k:][..., :1]
            chosen = mx.broadcast_to(bound >= kth, (B, H, Hq // H, L, full))
            if self.reads is not None:
                self._count(chosen.any(axis=(2, 3)), L)
            chosen = mx.repeat(chosen.reshape(B, Hq, L, full), PAGE, axis=-1)
            seen = mx.concatenate([chosen, seen], axis=-1)
        kept = held_mask(mask, (B, Hq, L, S))
        keys, values = mx.concatenate([sk, keys], axis=2), mx.concatenate([sv, values], axis=2)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=mx.concatenate([seen, kept], axis=-1))  # fmt: skip

    def _count(self, union: mx.array, queries: int) -> None:
        """Log the ``(B, H, full)`` pages read this call, and how many were not read the call before."""
        last = self._last if self._last is not None else mx.zeros(union.shape[:-1] + (0,), mx.bool_)
        last = mx.pad(last, [(0, 0), (0, 0), (0, union.shape[-1] - last.shape[-1])])
        new = union & ~last
        self._last = union
        self.reads.append((queries, union.sum(axis=-1).mean().item(), new.sum(axis=-1).mean().item()))


def make_paged(model: nn.Module, name: str, budget: int, **kwargs: Any) -> list[EvictingKVCache]:
    """One ``default``-policy cache per layer of ``model`` holding ``budget`` entries, reading back ``paged-K``'s pages."""
    parsed = _parse(name)
    if parsed is None:
        raise ValueError(f"{name!r} is not a paged cache (paged-K, quest-K or shared-K, K pages of {PAGE} entries, "
                         "then sN, bN)")
    mlxevict.patch(model)
    return [EvictingKVCache("default", budget, storage=PagedStorage(*parsed), **kwargs) for _ in model.layers]
