"""The evicting cache's eviction: what is always kept, when to compact, and the compaction step.

:class:`CacheEviction` is the part of :class:`~mlxevict.cache.EvictingKVCache` that
decides. Before a chunk is appended, :meth:`~CacheEviction._plan` says how many
entries to keep (``None`` while the budget holds them all), using statistics the
policy collected from earlier queries, and frees ``slack`` entries more so the next
``slack`` tokens append without another compaction; :meth:`~CacheEviction._evict`
ranks the slots (sinks, the recent window and pinned spans first, then the policy's
scores) and gathers the kept ones to the front in time order (compiled kernels,
:mod:`mlxevict.kernels`). Pinned spans live in :class:`~mlxevict.pins.Pins`; how
much a budget protects is :mod:`mlxevict.room`'s rule.
"""

from __future__ import annotations

import warnings
from typing import Optional

import mlx.core as mx

from .cache_slots import GROW_STEP
from .kernels import compact_compiled, priority_compiled
from .room import STATS_CHUNK, check_room, protected


class CacheEviction:
    """Eviction of :class:`~mlxevict.cache.EvictingKVCache` (a part of the cache, not a cache of its own).

    It reads the cache's settings (``budget``, ``sinks``, ``window``, ``slack``,
    ``prompt_mode``), its ``policy``, ``pins``, ``storage`` and slots.
    """

    @property
    def protected_window(self) -> int:
        """The newest positions an eviction never drops (the storage may hold a window of its own)."""
        return max(self.window, self.storage.protected)

    @property
    def pinned_tokens(self) -> int:
        return self.pins.tokens

    @property
    def pinned(self) -> list[tuple[int, int]]:
        """Absolute ``(start, end)`` spans always kept (the prompt's among them)."""
        return self.pins.spans

    @property
    def first_query_read(self) -> int:
        """Queries of positions below this are never read by an eviction, so they need not be kept.

        No eviction comes while the kept entries and the next chunk fit the budget; the patched model
        (which alone feeds queries) calls with at most ``STATS_CHUNK`` tokens and never more than the
        budget less what is protected without pins (the most :attr:`max_chunk` can be); an eviction
        reads the ``policy.query_window`` queries before it. Storage that demotes (precision tiers) ranks
        entries long before any eviction, so it reads every query.
        """
        if self.storage.demotes:
            return -1
        longest = min(STATS_CHUNK, self.budget - protected(self.sinks, self.protected_window) - self.slack)
        return self.budget - longest - self.policy.query_window

    @property
    def max_chunk(self) -> int:
        """The longest chunk one call may append while the budget holds."""
        if not self.policy.evicts or self.prompt_mode == "compress":
            return GROW_STEP
        return self.budget - protected(self.sinks, self.protected_window, self.pinned_tokens) - self.slack

    def _plan(self, S: int) -> Optional[int]:
        """How many entries to keep before appending ``S`` tokens, or ``None``: no eviction."""
        if not self.policy.evicts or (self.prompt_mode == "compress" and S > 1):
            return None
        compressing = self.prompt_mode == "compress" and self._size > self.budget
        if not compressing and self._size + S <= self.budget:
            return None  # storage grows (if need be) instead
        if S > self.max_chunk:
            raise ValueError(
                f"a chunk of {S} tokens does not fit budget={self.budget} with sinks={self.sinks}, "
                f"window={self.window}, slack={self.slack}; feed at most {self.max_chunk} tokens per "
                "call (mlxevict.patch splits longer prompts for you)"
            )
        self.flush()  # the policy's statistics (and effective budget) must be current
        self._last_budget = min(self.budget, self.policy.effective_budget(self.budget))
        floor = protected(self.sinks, self.protected_window, self.pinned_tokens)
        return min(self._size, max(floor, self._last_budget - S - self.slack))

    def _rank_key(self, pins: bool = True) -> mx.array:
        """``(B, H, C)`` keep-priority: protected slots first (sinks, the window, and with ``pins`` the pinned
        spans), then the policy's scores, empty slots last."""
        pinned = mx.array((self.pinned if pins else None) or [(0, 0)], dtype=mx.int32)
        return priority_compiled(
            self.policy.score(self), self.positions, mx.array(self.offset), self.sinks, self.protected_window, pinned
        )

    def _demote(self, k: Optional[int] = None) -> None:
        """Demote the ``k`` (``None``: every) high-tier entries each head ranks lowest to the storage's low tier
        (:class:`~mlxevict.tiered_storage.TieredStorage`): a cut in bits where an eviction would drop them."""
        n_high = self.storage.n_high
        k = n_high if k is None else k
        if k <= 0:
            return
        if k >= n_high:  # all of them (a full budget, or an eviction next): no ranking, no slot moves
            self.storage.demote(None, n_high, self._size)
            return
        n_low = self.storage.n_low(self._size)
        B, H, C = self.positions.shape
        self.flush()  # the policy's statistics must be current
        # Pins keep entries from eviction, not bits: a prompt streamed whole is pinned, and would tie.
        high = self._rank_key(pins=False)[..., n_low : n_low + n_high]  # B, H, n_high
        lowest = mx.argsort(high, axis=-1)
        order = mx.concatenate([mx.sort(lowest[..., :k], axis=-1), mx.sort(lowest[..., k:], axis=-1)], axis=-1)
        # The per-slot arrays move with the entries: the demoted follow the low tier, the rest keep their order.
        before = mx.broadcast_to(mx.arange(n_low), (B, H, n_low))
        after = mx.broadcast_to(mx.arange(n_low + n_high, C), (B, H, C - n_low - n_high))
        moved = mx.concatenate([before, n_low + order, after], axis=-1)
        self.positions = mx.take_along_axis(self.positions, moved, axis=-1)
        self.stats = mx.take_along_axis(self.stats, moved, axis=-1)
        self.storage.demote(order, k, self._size)

    def _evict(self, n_keep: int) -> None:
        if n_keep >= self._size:
            return
        if self.storage.demotes:
            self._demote()  # an eviction moves the low tier only
        rank_key = self._rank_key()
        rank_key, n_keep = self.storage.limit_groups(rank_key, n_keep, self._size, self.budget)  # storage's bound
        self._set_slots(compact_compiled(rank_key, mx.array(n_keep), self._slots()))
        self.evictions += 1
        self._size = n_keep

    def feed_prompt(self, S: int) -> None:
        """Pin the prompt as it arrives (:class:`~mlxevict.pins.Pins`): the patched model calls this
        before each call of ``S`` tokens; a prompt too long to pin is named once, when it ends."""
        room = self.budget - protected(self.sinks, self.protected_window) - self.slack
        warning = self.pins.feed_prompt(self.offset, S, room)
        if warning:
            warnings.warn(warning, stacklevel=2)

    def pin(self, start: int, end: int) -> None:
        """Always keep absolute positions ``[start, end)`` from now on (e.g. the user prompt)."""
        check_room(
            self.budget, self.sinks, self.protected_window, self.slack, self.pinned_tokens + max(0, end - start)
        )
        self.pins.add(start, end)
