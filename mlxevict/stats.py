"""Cache statistics as data: what the evicting caches hold, drop and save."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .cache import EvictingKVCache

FULL_CACHE_STEP = 256  # mlx-lm's KVCache grows its arrays by this many slots


@dataclass(frozen=True)
class CacheStats:
    """A snapshot over all layers' caches. Entry counts are per layer (the maximum).

    Attributes:
        policy: the policy name.
        budget: most entries a layer holds.
        effective_budget: the entries the policy holds now (``uncertainty`` adapts it).
        capacity: allocated slots per layer.
        kept: entries stored now.
        evicted: tokens dropped so far (tokens seen − kept).
        tokens_seen: the absolute position, ``offset``.
        nbytes: KV bytes allocated now, all layers.
        full_nbytes: KV bytes a full mlx-lm ``KVCache`` would hold for ``tokens_seen`` (its arrays grow
            in steps of 256 slots, as this cache's do, so a bounded cache never shows above it).
        kv_bits: storage bits, or (key bits, value bits) (``None``: the model's dtype).
        full_precision_window: with ``kv_bits``, the newest tokens kept in the model's dtype
            (or in ``window_bits``).
        window_bits: 8 when that window is stored in 8 bits, else ``None``.
        disk_nbytes: bytes of evicted entries in a page store on disk (``page_dir``), all layers.
        read_nbytes: bytes read back from it so far.
    """

    policy: str
    budget: int
    effective_budget: int
    capacity: int
    kept: int
    evicted: int
    tokens_seen: int
    nbytes: int
    full_nbytes: int
    kv_bits: int | tuple[int, int] | None = None
    full_precision_window: int | None = None
    window_bits: int | None = None
    disk_nbytes: int = 0
    read_nbytes: int = 0

    @property
    def saved_nbytes(self) -> int:
        return max(0, self.full_nbytes - self.nbytes)


def full_cache_slots(tokens: int) -> int:
    """Slots mlx-lm's ``KVCache`` holds after ``tokens`` tokens fed one step at a time: whole steps of 256."""
    return -(-tokens // FULL_CACHE_STEP) * FULL_CACHE_STEP


def bytes_per_token(cache: EvictingKVCache) -> int:
    """KV bytes one token costs a full cache in one layer (keys + values, all kv-heads, model dtype)."""
    if cache.keys is None:
        return 0
    B, H, D, Dv, dtype = cache.dense_shape
    return B * H * (D + Dv) * dtype.size


def cache_stats(caches: Sequence[EvictingKVCache]) -> CacheStats:
    """Summarise a model's list of evicting caches (as returned by ``make_cache``)."""
    evicting = [c for c in caches if isinstance(c, EvictingKVCache)]
    if not evicting:
        raise ValueError("cache_stats needs the caches made by mlxevict.make_cache")
    first = evicting[0]
    kept = max(c.size() for c in evicting)
    return CacheStats(
        policy=first.policy_name,
        budget=first.budget,
        effective_budget=first._last_budget,
        capacity=max(c.capacity for c in evicting),
        kept=kept,
        evicted=first.offset - kept,
        tokens_seen=first.offset,
        nbytes=sum(c.nbytes for c in evicting),
        full_nbytes=sum(full_cache_slots(c.offset) * bytes_per_token(c) for c in evicting),
        kv_bits=first.kv_bits,
        full_precision_window=first.full_precision_window if first.kv_bits else None,
        window_bits=first.window_bits if first.kv_bits else None,
        disk_nbytes=sum(getattr(c.storage, "disk_bytes", 0) for c in evicting),
        read_nbytes=sum(getattr(c.storage, "bytes_read", 0) for c in evicting),
    )
