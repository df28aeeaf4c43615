"""The policy interface: what a policy scores, and what it needs the cache to collect.

Following kvpress, a policy is a small class with a ``score()``; the selection of
what to keep (sinks, recent window, pinned spans, top-k) lives once in the cache.
One policy instance serves one layer's cache, so it may hold per-layer state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import mlx.core as mx

if TYPE_CHECKING:
    from ..cache import EvictingKVCache


class Policy:
    """Base class. Subclasses set the class flags and implement :meth:`score`.

    Class flags:
        name: the registry name (``--policy NAME``).
        source: the paper or document the policy comes from.
        evicts: ``False`` only for ``full``: the cache grows instead.
        observes: call :meth:`observe` with the queries seen since the last eviction.
        query_window: how many recent queries the cache keeps for :meth:`score`.
        uses_prediction_entropy: the generation side feeds ``H(p_t)`` each step.
        pins_prompt: the prompt (every token before the first single-token call) is never evicted.
        recent_window: ``(cap, divisor)``: without an explicit ``window`` the cache keeps the
            ``min(cap, budget // divisor)`` newest tokens; ``None``: the cache's default.
    """

    name: ClassVar[str] = ""
    source: ClassVar[str] = ""
    evicts: ClassVar[bool] = True
    observes: ClassVar[bool] = False
    query_window: ClassVar[int] = 0
    uses_prediction_entropy: ClassVar[bool] = False
    pins_prompt: ClassVar[bool] = False
    recent_window: ClassVar[tuple[int, int] | None] = None

    def score(self, cache: "EvictingKVCache") -> mx.array:
        """Importance of each slot, ``(B, H, C)`` float32; higher is kept."""
        raise NotImplementedError

    def observe(self, cache: "EvictingKVCache", queries: mx.array, query_pos: mx.array) -> None:
        """Collect statistics from ``(B, H*G, S, D)`` queries at positions ``query_pos``.

        Called in batches (before each eviction): keys added after a query are
        hidden from it by position, so the rows are those of each query's own step.
        """

    def feed_prediction_entropy(
        self, cache: "EvictingKVCache", queries: mx.array, query_pos: mx.array, entropy: mx.array
    ) -> None:
        """Receive ``H(p_t)`` ``(B, S)`` with the queries of those positions, in order."""

    def effective_budget(self, budget: int) -> int:
        """How many entries to hold now; the cache's budget unless the policy adapts it."""
        return budget

    def config(self) -> dict[str, Any]:
        """Constructor arguments, so a saved cache rebuilds the same policy."""
        return {}

    def runtime_state(self) -> dict[str, Any]:
        """Host-side values that must survive save/load (JSON-serialisable)."""
        return {}

    def load_runtime_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`runtime_state` returned."""
