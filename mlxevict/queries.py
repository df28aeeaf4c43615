"""The queries a cache's policy reads: queued as the patched attention shows them, handed over in batches.

Queries are batched until the next eviction (or ``PENDING_LIMIT`` tokens): between
evictions the kept keys only grow, so a causal mask by position gives each queued
query exactly the attention row it had at its own step, and one batched kernel
call replaces one call per token. A policy with a ``query_window`` also keeps the
newest ``query_window`` queries (``recent``) for its ``score``.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

PENDING_LIMIT = 64  # queued query tokens before statistics are folded in anyway


class QueryLog:
    """One cache's queued queries (and prediction entropies), and its policy's recent queries.

    Args:
        policy: the cache's policy (its ``query_window``, ``observes`` and
            ``uses_prediction_entropy`` say what is kept).
    """

    def __init__(self, policy) -> None:
        self.policy = policy
        self.pending: list[mx.array] = []  # (B, H*G, S, D) each, consecutive positions
        self.count = 0  # queued query tokens (kept as they come: summing the list at every decode step took 0.5% of a profiled decode)
        self.start = 0  # position of the first queued query
        self.entropy: list[mx.array] = []  # (B, S) each
        self.recent: Optional[mx.array] = None  # (B, H*G, query_window, D)
        self.recent_pos: Optional[mx.array] = None  # (query_window,), -1 before any query

    def add(self, queries: mx.array, offset: int, first_read: int = 0) -> bool:
        """Queue the ``(B, H*G, S, D)`` queries of the positions up to ``offset``; ``True``: fold them in now.

        A policy that only reads its recent window skips queries of positions no eviction will read
        (all below ``first_read``): a short prompt then holds no query state at all.
        """
        policy = self.policy
        if not (policy.query_window or policy.observes or policy.uses_prediction_entropy):
            return False
        S, window = queries.shape[2], policy.query_window
        window_only = not (policy.observes or policy.uses_prediction_entropy)
        if window_only and offset <= first_read:
            return False
        if window_only and S > window:
            # Only the newest query_window queries are read: keep a copy of those, computed now, so
            # this chunk's queries (every layer's) are not held until the caches are next evaluated.
            queries = mx.contiguous(queries[:, :, -window:])
            mx.async_eval(queries)
            self.pending, self.count = [], 0
        if not self.pending:
            self.start = offset - queries.shape[2]
        self.pending.append(queries)
        self.count += queries.shape[2]
        # An observing policy folds a prompt chunk in at once, so its queries are not held past the
        # forward pass, and decoded queries every PENDING_LIMIT (one fed H(p_t) waits for it).
        return policy.observes and not policy.uses_prediction_entropy and (S > 1 or self.count >= PENDING_LIMIT)

    def add_entropy(self, entropy: mx.array) -> None:
        self.entropy.append(entropy)

    def take(self) -> Optional[tuple[mx.array, mx.array, Optional[mx.array]]]:
        """``(queries (B, H*G, P, D), positions (P,), entropy (B, P) or None)`` queued, or ``None``.

        The recent window is updated from them; the queue is emptied.
        """
        if not self.pending:
            return None
        queries = mx.concatenate(self.pending, axis=2)  # B, H*G, P, D
        query_pos = mx.arange(self.start, self.start + queries.shape[2], dtype=mx.int32)
        entropy = mx.concatenate(self.entropy, axis=1) if self.entropy else None
        self.pending, self.entropy, self.count = [], [], 0
        window = self.policy.query_window
        if window:
            if self.recent is None:
                B, HG, _, D = queries.shape
                self.recent = mx.zeros((B, HG, window, D), queries.dtype)
                self.recent_pos = mx.full((window,), -1, mx.int32)
            # a copy, not a view that would hold the whole (window + P)-query buffer
            self.recent = mx.contiguous(mx.concatenate([self.recent, queries], axis=2)[:, :, -window:])
            self.recent_pos = mx.concatenate([self.recent_pos, query_pos])[-window:]
        return queries, query_pos, entropy
