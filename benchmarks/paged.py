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

What it costs, were the pages on an SSD, is ``K · PAGE`` entries read per layer and kv-head per
call; this pilot measures what it buys, not that cost.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

import mlxevict
from mlxevict.cache import EvictingKVCache
from mlxevict.dense_storage import DenseStorage

PAGE = 16  # entries per page (Quest's page size)
PREFIX = "paged-"


def is_paged(name: str) -> bool:
    """``paged-K`` with K a whole number of pages (``paged-0`` reads nothing back: the plain cache)."""
    return name.startswith(PREFIX) and name[len(PREFIX) :].isdigit()


class PagedStorage(DenseStorage):
    """Dense entries under the budget, plus every entry compaction dropped, read back by page.

    The cache's compaction gathers the kept slots to the front in time order and the dropped ones
    after them (:func:`mlxevict.kernels.compact`), so the slots ``[n_keep, size)`` it hands back are
    exactly the entries evicted, oldest first: :meth:`set_slots` moves them aside.
    """

    def __init__(self, pages: int) -> None:
        super().__init__()
        self.pages = pages
        self.spilled: Optional[tuple[mx.array, mx.array]] = None  # (B, H, N, D) keys, values
        self._cut: Optional[tuple[int, int]] = None

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
        if self.spilled is None:
            self.spilled = dropped
        else:
            self.spilled = tuple(mx.concatenate([s, d], axis=2) for s, d in zip(self.spilled, dropped))
        mx.eval(self.spilled)

    def attend(self, queries, keys, values, scale, mask, sinks=None) -> Optional[mx.array]:
        if self.spilled is None or sinks is not None or not self.pages:
            return None
        sk, sv = self.spilled
        B, H, N, D = sk.shape
        full = N // PAGE
        k = min(self.pages, full)
        idx = mx.arange(full * PAGE, N)  # the unfinished page: always read
        idx = mx.broadcast_to(idx, (B, H, N - full * PAGE))
        if k:
            pages = sk[..., : full * PAGE, :].reshape(B, H, full, PAGE, D)
            lo, hi = pages.min(axis=3), pages.max(axis=3)  # B, H, pages, D
            q = queries.reshape(B, H, -1, D)  # a kv-head's query heads and positions together
            bound = mx.maximum(q, 0) @ hi.swapaxes(-1, -2) + mx.minimum(q, 0) @ lo.swapaxes(-1, -2)
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


def make_paged(model: nn.Module, name: str, budget: int, **kwargs: Any) -> list[EvictingKVCache]:
    """One ``default``-policy cache per layer of ``model`` holding ``budget`` entries, reading back ``paged-K``'s pages."""
    if not is_paged(name):
        raise ValueError(f"{name!r} is not a paged cache (paged-K, K pages of {PAGE} entries)")
    pages = int(name[len(PREFIX) :])
    mlxevict.patch(model)
    return [EvictingKVCache("default", budget, storage=PagedStorage(pages), **kwargs) for _ in model.layers]
