"""Dense KV storage: keys and values in the model's dtype, one slot per kept entry.

A storage is the component of :class:`mlxevict.cache.EvictingKVCache` that holds
the entries; the cache decides which slots are kept (positions, statistics,
eviction, growth) and the storage how they are held. Every storage answers the
same calls: ``allocate``, ``write``, ``fetch``, ``slots``/``set_slots`` (what
compaction gathers), ``resize``, ``dense_keys``, ``nbytes``, ``state`` and
``meta``. :class:`mlxevict.quantized_storage.QuantizedStorage` is the other one.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx


def fit_slots(x: mx.array, capacity: int, fill) -> mx.array:
    """``x`` ``(B, H, C, ...)`` cut or padded with ``fill`` to ``capacity`` slots."""
    if x.shape[2] >= capacity:
        return x[:, :, :capacity]
    pad = mx.full((*x.shape[:2], capacity - x.shape[2], *x.shape[3:]), fill, x.dtype)
    return mx.concatenate([x, pad], axis=2)


class DenseStorage:
    """Keys and values ``(B, H, C, D)`` in the model's dtype, slot ``i`` holding the ``i``-th kept entry.

    Attention reads them with the model's own ``scaled_dot_product_attention``.
    """

    kv_bits: Optional[int] = None  # the model's dtype
    protected = 0  # newest entries the storage itself needs kept (a recent window it holds apart)
    demotes = False  # precision tiers: the cache demotes entries before it evicts (TieredStorage)

    def __init__(self) -> None:
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None

    def empty(self) -> bool:
        return self.keys is None

    def allocate(self, B: int, H: int, D: int, Dv: int, dtype: mx.Dtype, capacity: int) -> None:
        self.keys = mx.zeros((B, H, capacity, D), dtype)
        self.values = mx.zeros((B, H, capacity, Dv), dtype)

    @property
    def shape(self) -> tuple[int, int, int, int, mx.Dtype]:
        """``(B, H, D, Dv, dtype)`` of the keys and values as the model made them."""
        B, H, _, D = self.keys.shape
        return B, H, D, self.values.shape[3], self.keys.dtype

    def arrays(self) -> list[mx.array]:
        """Every array the storage holds (none before the first token): what :attr:`nbytes` counts."""
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.arrays())

    def write(self, keys: mx.array, values: mx.array, start: int) -> None:
        """Store ``(B, H, S, D)`` keys/values in slots ``[start, start + S)``."""
        S = keys.shape[2]
        self.keys[..., start : start + S, :] = keys
        self.values[..., start : start + S, :] = values

    def fetch(self, size: int) -> tuple[mx.array, mx.array]:
        """What attention reads: the first ``size`` keys and values, ``(B, H, size, D)`` each."""
        return self.keys[..., :size, :], self.values[..., :size, :]

    def attend(self, queries, keys, values, scale, mask, sinks=None) -> Optional[mx.array]:
        """``None``: the model's own attention reads dense entries."""
        return None

    def limit_groups(self, rank_key: mx.array, n_keep: int, size: int, budget: int) -> tuple[mx.array, int]:
        """The cache's ``(B, H, C)`` keep-priority and ``n_keep`` as they are: any set of slots can be kept."""
        return rank_key, n_keep

    def slots(self) -> list[mx.array]:
        """Every per-slot array, what compaction gathers (in the order :meth:`set_slots` takes)."""
        return [self.keys, self.values]

    def set_slots(self, arrays: list[mx.array]) -> None:
        self.keys, self.values = arrays

    def resize(self, capacity: int) -> None:
        self.keys, self.values = fit_slots(self.keys, capacity, 0), fit_slots(self.values, capacity, 0)

    def dense_keys(self, size: int, capacity: int) -> mx.array:
        """``(B, H, C, D)`` keys in the model's dtype, slot by slot (slots past ``size`` unspecified)."""
        return self.keys

    # ---- save / load: the cache's state holds (keys, values) as they are ----
    @property
    def state(self) -> tuple[Any, Any]:
        return self.keys, self.values

    @state.setter
    def state(self, v: tuple[Any, Any]) -> None:
        self.keys, self.values = v

    def meta(self) -> dict[str, Any]:
        """Settings saved with the cache (none: the arrays say it all)."""
        return {}
