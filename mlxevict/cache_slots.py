"""The evicting cache's slots: the storage component's entries, each slot's position and statistics, growth.

:class:`CacheSlots` is the part of :class:`~mlxevict.cache.EvictingKVCache` that
keeps the per-slot bookkeeping beside the storage (which holds the entries:
:mod:`mlxevict.dense_storage`, :mod:`mlxevict.quantized_storage`) and grows or
cuts both together. Storage grows in steps of ``GROW_STEP`` slots up to the
budget (the first ``GROW_STEP`` in steps of ``FIRST_STEP``), so the compiled kernels
trace once per capacity, not per step.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .dense_storage import fit_slots

GROW_STEP = 256  # slots storage grows by, as mlx-lm's KVCache
# A short prompt's storage comes in smaller steps: mlx-lm's KVCache holds 256 slots from its first
# token, and these 64-slot steps leave room under it for what the policy keeps per slot.
FIRST_STEP = 64


def _per_slot(name: str, doc: str) -> property:
    """A per-slot array that gives the slots appended since it was last read their values first."""

    def get(self: Any) -> mx.array | None:
        self._write_fresh()
        return getattr(self, name)

    def put(self: Any, value: mx.array | None) -> None:
        self._write_fresh()
        setattr(self, name, value)

    return property(get, put, doc=doc)


class CacheSlots:
    """Per-slot positions and statistics, and the storage's entries, of :class:`~mlxevict.cache.EvictingKVCache`.

    A part of the cache, not a cache of its own: it reads the cache's ``storage``,
    ``_positions``, ``_stats``, ``_fresh``, ``_size``, ``step``, ``budget`` and ``policy``.
    """

    positions = _per_slot("_positions", "``(B, H, C)`` absolute position of each slot, -1 if empty.")
    stats = _per_slot("_stats", "``(B, H, C)`` float32 per-slot statistics a policy keeps (0 for new slots).")

    def _write_fresh(self) -> None:
        """Give the slots appended since the last read their positions and zero stats."""
        if self._fresh is None:
            return
        slot, position, n = self._fresh
        self._fresh = None
        self._positions[..., slot : slot + n] = mx.arange(position, position + n, dtype=mx.int32)
        self._stats[..., slot : slot + n] = 0.0

    @property
    def capacity(self) -> int:
        return 0 if self._positions is None else self._positions.shape[2]

    # ---- the storage holds the entries, the cache the per-slot bookkeeping ----
    # Settable: a pipelined mlx-lm model ties its send to the last layer's keys (cache.keys = mx.depends(...)).
    keys = property(lambda self: self.storage.keys, lambda self, k: setattr(self.storage, "keys", k),
                    doc="The storage's keys (``None`` before the first token).")
    values = property(lambda self: self.storage.values, doc="The storage's values.")
    kv_bits = property(lambda self: self.storage.kv_bits, doc="Storage bits; ``None``: the model's dtype.")
    # Quantized storage's settings and window (``None`` for dense storage), as caches of 0.1 had them.
    kv_group_size = property(lambda self: getattr(self.storage, "kv_group_size", None))
    full_precision_window = property(lambda self: getattr(self.storage, "full_precision_window", None))
    window_bits = property(lambda self: getattr(self.storage, "window_bits", None))
    kv_rotate = property(lambda self: getattr(self.storage, "kv_rotate", False))
    key_bits = property(lambda self: getattr(self.storage, "key_bits", None))
    value_bits = property(lambda self: getattr(self.storage, "value_bits", None))
    rotation = property(lambda self: getattr(self.storage, "rotation", None))
    n_full = property(lambda self: getattr(self.storage, "n_full", 0))
    fp_keys = property(lambda self: getattr(self.storage, "fp_keys", None))
    fp_values = property(lambda self: getattr(self.storage, "fp_values", None))

    @property
    def dense_keys(self) -> mx.array:
        """``(B, H, C, D)`` keys in the model's dtype, slot by slot: what policies score."""
        return self.storage.dense_keys(self._size, self.capacity)

    @property
    def dense_shape(self) -> tuple[int, int, int, int, mx.Dtype]:
        """``(B, H, D, Dv, dtype)`` of the keys and values as the model made them."""
        return self.storage.shape

    def allocate_full(self, B: int, H: int, D: int, Dv: int, dtype: mx.Dtype) -> None:
        """Hold, empty, the arrays this cache holds once its budget is full: a budget's bytes without a model run."""
        self._allocate(B, H, D, Dv, dtype, self._capacity_for(self.budget))

    def _slots(self) -> list[mx.array]:
        """Every per-slot array, ``positions`` first: what compaction gathers."""
        return [self.positions, *self.storage.slots(), self.stats]

    def _set_slots(self, arrays: list[mx.array]) -> None:
        self.positions, self.stats = arrays[0], arrays[-1]
        self.storage.set_slots(arrays[1:-1])

    def _allocate(self, B: int, H: int, D: int, Dv: int, dtype: mx.Dtype, capacity: int) -> None:
        self.storage.allocate(B, H, D, Dv, dtype, capacity)
        self.positions = mx.full((B, H, capacity), -1, mx.int32)
        self.stats = mx.zeros((B, H, capacity), mx.float32)

    def _resize(self, capacity: int) -> None:
        self.storage.resize(capacity)
        self.positions, self.stats = fit_slots(self.positions, capacity, -1), fit_slots(self.stats, capacity, 0)

    def _capacity_for(self, needed: int) -> int:
        """Slots to hold ``needed`` entries: whole steps, and no more than the budget while it holds them."""
        step = FIRST_STEP if needed <= self.step else self.step
        capacity = -(-needed // step) * step
        if self.policy.evicts and needed <= self.budget:
            capacity = min(capacity, self.budget)
        return capacity

    def _grow(self, needed: int) -> None:
        self._resize(self._capacity_for(needed))
