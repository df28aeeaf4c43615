"""Quantized KV storage: kept entries in 8, 4 or split bits, the newest in a recent window apart.

Entries are stored with ``mx.quantize`` (packed ``uint32`` words plus a scale and
a bias per group of ``kv_group_size`` values, as mlx-lm's ``QuantizedKVCache``).
The newest ``full_precision_window`` tokens stay in the model's dtype, or in 8
bits with ``window_bits=8``, and are folded into quantized storage one by one as
newer tokens arrive (KIVI, https://arxiv.org/abs/2402.02750, keeps such a residual
too); the cache never evicts them while they are in the window (``protected``).

Slots keep their meaning from the cache: of its ``size`` kept entries, the first
``size - n_full`` are quantized (arrays of ``C - full_precision_window`` slots, so
the window costs no quantized rows) and the last ``n_full`` live in the window
buffers ``fp_keys``/``fp_values``. Because those are the newest and always kept,
compaction only gathers the quantized arrays.

Below 8 bits (or with ``kv_rotate``), entries are stored rotated by
:func:`mlxevict.rotation.rotation_matrix`; attention
(:func:`mlxevict.quantized_attention.quantized_attention`) rotates the queries in
and the output back, and ``dense_keys`` rotates the keys back for policies.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .dense_storage import fit_slots
from .quantized_attention import Entries, _first_rows, _quantized, quantized_attention
from .kvstorage import DEFAULT_GROUP_SIZE, KVBits, check, key_value_bits
from .rotation import rotation_matrix


def quantized_zeros(shape: tuple[int, int, int, int], dtype: mx.Dtype, bits: int, group_size: int) -> Entries:
    """Empty per-token quantized entries for ``(B, H, C, D)``: packed codes, scales, biases (as ``mx.quantize``)."""
    B, H, C, D = shape
    groups = D // group_size
    return (
        mx.zeros((B, H, C, D * bits // 32), mx.uint32),  # mx.quantize packs D * bits bits per row
        mx.zeros((B, H, C, groups), dtype),
        mx.zeros((B, H, C, groups), dtype),
    )


class QuantizedStorage:
    """Quantized keys and values plus a recent window; see the module docstring.

    Args:
        kv_bits: 8 or 4, or ``(key bits, value bits)`` such as ``(5, 3)``. Default 8.
        kv_group_size: values per scale and bias: 32, 64 or 128. Default 64 (mlx-lm's).
        full_precision_window: the newest tokens kept apart, in the model's dtype or
            ``window_bits``; 0 quantizes every token at once, as mlx-lm's ``QuantizedKVCache``.
        kv_rotate: store rotated; ``None`` (default): when keys or values are under 8 bits.
        window_bits: ``None`` keeps the window in the model's dtype; 8 (with storage
            under 8 bits) stores it in 8 bits.
    """

    demotes = False  # one tier (TieredStorage demotes)

    def __init__(
        self,
        kv_bits: KVBits = 8,
        kv_group_size: int = DEFAULT_GROUP_SIZE,
        full_precision_window: int = 0,
        kv_rotate: Optional[bool] = None,
        window_bits: Optional[int] = None,
    ):
        check(kv_bits, kv_group_size, window_bits=window_bits)
        full = full_precision_window
        if not isinstance(full, int) or isinstance(full, bool) or full < 0:
            raise ValueError(f"full_precision_window={full!r} must be a number of tokens >= 0")
        self.kv_bits = kv_bits if isinstance(kv_bits, int) else key_value_bits(kv_bits)
        self.key_bits, self.value_bits = key_value_bits(kv_bits)
        self.kv_group_size, self.full_precision_window = kv_group_size, full
        self.kv_rotate = min(self.key_bits, self.value_bits) < 8 if kv_rotate is None else bool(kv_rotate)
        self.window_bits = window_bits
        self.keys: Optional[tuple[mx.array, ...]] = None
        self.values: Optional[tuple[mx.array, ...]] = None
        self.fp_keys: Optional[Entries] = None
        self.fp_values: Optional[Entries] = None
        self.n_full = 0  # newest tokens held in fp_keys/fp_values (the recent window)

    @property
    def protected(self) -> int:
        """The window's tokens are never evicted while there (the cache's room counts them: :mod:`mlxevict.room`)."""
        return self.full_precision_window

    def empty(self) -> bool:
        return self.keys is None

    # ---- layout ------------------------------------------------------------
    def _zeros(self, B: int, H: int, C: int, D: int, dtype: mx.Dtype, bits: int) -> Entries:
        return quantized_zeros((B, H, C, D), dtype, bits, self.kv_group_size)

    def _quantized_capacity(self, capacity: int) -> int:
        return max(0, capacity - self.full_precision_window)

    def allocate(self, B: int, H: int, D: int, Dv: int, dtype: mx.Dtype, capacity: int) -> None:
        check(self.kv_bits, self.kv_group_size, head_dims=(D, Dv))
        quantized = self._quantized_capacity(capacity)
        self.keys = self._zeros(B, H, quantized, D, dtype, self.key_bits)
        self.values = self._zeros(B, H, quantized, Dv, dtype, self.value_bits)
        F = self.full_precision_window
        if self.window_bits:
            self.fp_keys = self._zeros(B, H, F, D, dtype, self.window_bits)
            self.fp_values = self._zeros(B, H, F, Dv, dtype, self.window_bits)
        else:
            self.fp_keys, self.fp_values = mx.zeros((B, H, F, D), dtype), mx.zeros((B, H, F, Dv), dtype)

    @property
    def shape(self) -> tuple[int, int, int, int, mx.Dtype]:
        """``(B, H, D, Dv, dtype)`` of the keys and values as the model made them."""
        B, H, _, groups = self.keys[1].shape
        return B, H, groups * self.kv_group_size, self.values[1].shape[3] * self.kv_group_size, self.keys[1].dtype

    def arrays(self) -> list[mx.array]:
        """Every array the storage holds (none before the first token): what :attr:`nbytes` counts."""
        if self.keys is None:
            return []
        return [x for _, x in tree_flatten((self.keys, self.values, self.fp_keys, self.fp_values))]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.arrays())

    @property
    def rotation(self) -> Optional[mx.array]:
        """The ``(D, D)`` matrix keys and values are stored multiplied by, or ``None``."""
        if not self.kv_rotate or self.keys is None:
            return None
        return rotation_matrix(self.shape[2])

    def _dense(self, entries: Entries, bits: Optional[int]) -> mx.array:
        if _quantized(entries):
            return mx.dequantize(*entries, group_size=self.kv_group_size, bits=bits)
        return entries

    # ---- write and read ------------------------------------------------------
    def write(self, keys: mx.array, values: mx.array, start: int) -> None:
        """Append ``S`` tokens (slots from ``start``) to the window, folding its oldest into quantized storage."""
        S, F, n_full = keys.shape[2], self.full_precision_window, self.n_full
        rotation = self.rotation
        if rotation is not None:
            rotation = rotation.astype(keys.dtype)
            keys, values = keys @ rotation, values @ rotation
        n_quant = start - n_full
        fold = max(0, n_full + S - F)  # oldest rows of (window + fresh) that go to quantized storage
        from_window = min(fold, n_full)
        stays = n_full - from_window
        kinds = ((self.keys, keys, self.fp_keys, self.key_bits), (self.values, values, self.fp_values, self.value_bits))
        for stored, fresh, window, bits in kinds:
            if fold:
                parts = [self._dense(_first_rows(window, from_window), self.window_bits)] if from_window else []
                if fold > from_window:
                    parts.append(fresh[..., : fold - from_window, :])
                folded = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
                for x, p in zip(stored, mx.quantize(folded, group_size=self.kv_group_size, bits=bits)):
                    x[..., n_quant : n_quant + fold, :] = p
                if stays:  # shift what stays as it is stored: 8-bit rows are not quantized twice
                    for x in window if _quantized(window) else (window,):
                        x[..., :stays, :] = x[..., from_window:n_full, :]
            self._write_window(window, fresh[..., fold - from_window :, :], stays)
        self.n_full = n_full + S - fold

    def _write_window(self, window: Entries, rows: mx.array, start: int) -> None:
        """Write ``(B, H, S, D)`` model-dtype ``rows`` into the recent window from slot ``start``."""
        end = start + rows.shape[2]
        if end == start:
            return
        if _quantized(window):
            for x, p in zip(window, mx.quantize(rows, group_size=self.kv_group_size, bits=self.window_bits)):
                x[..., start:end, :] = p
        else:
            window[..., start:end, :] = rows

    def fetch(self, size: int):
        """``((quantized keys, window keys), (quantized values, window values))`` of the ``size`` kept entries."""
        n_quant = size - self.n_full
        keys = _first_rows(self.keys, n_quant), _first_rows(self.fp_keys, self.n_full)
        values = _first_rows(self.values, n_quant), _first_rows(self.fp_values, self.n_full)
        return keys, values

    def attend(self, queries, keys, values, scale, mask, sinks=None) -> mx.array:
        """Attention over what :meth:`fetch` returned (the patched attention calls this)."""
        if sinks is not None:
            raise ValueError("quantized KV storage does not support attention sinks; use kv_bits=None")
        return quantized_attention(
            queries, keys, values, scale, mask, group_size=self.kv_group_size, bits=self.kv_bits,
            rotation=self.rotation, window_bits=self.window_bits,
        )  # fmt: skip

    def limit_groups(self, rank_key: mx.array, n_keep: int, size: int, budget: int) -> tuple[mx.array, int]:
        """The cache's ``(B, H, C)`` keep-priority and ``n_keep`` as they are: any set of slots can be kept."""
        return rank_key, n_keep

    def slots(self) -> list[mx.array]:
        """The quantized arrays (fewer slots than the cache: the window lives apart and is always kept)."""
        return [*self.keys, *self.values]

    def set_slots(self, arrays: list[mx.array]) -> None:
        self.keys, self.values = tuple(arrays[:3]), tuple(arrays[3:6])

    def resize(self, capacity: int) -> None:
        quantized = self._quantized_capacity(capacity)
        self.keys = tuple(fit_slots(x, quantized, 0) for x in self.keys)
        self.values = tuple(fit_slots(x, quantized, 0) for x in self.values)

    def dense_keys(self, size: int, capacity: int) -> mx.array:
        """``(B, H, C, D)`` keys dequantized to the model's dtype (a transient copy, for policies)."""
        B, H, D, _, dtype = self.shape
        n_quant = size - self.n_full
        parts = []
        if n_quant:
            parts.append(self._dense(_first_rows(self.keys, n_quant), self.key_bits))
        if self.n_full:
            parts.append(self._dense(_first_rows(self.fp_keys, self.n_full), self.window_bits))
        if capacity > size:
            parts.append(mx.zeros((B, H, capacity - size, D), dtype))
        keys = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
        rotation = self.rotation
        return keys if rotation is None else keys @ rotation.T.astype(keys.dtype)

    # ---- save / load: the layout of QuantizedEvictingKVCache's state since 0.1 ----
    @property
    def state(self) -> tuple[Any, Any]:
        if self.keys is None:
            return None, None
        window = (self.fp_keys, self.fp_values) if self.window_bits else ((self.fp_keys,), (self.fp_values,))
        return (*self.keys, *window[0]), (*self.values, *window[1])

    @state.setter
    def state(self, v: tuple[Any, Any]) -> None:
        if v[0] is None:
            return
        # an 8-bit window is a triple, else one array
        self.keys, self.fp_keys = tuple(v[0][:3]), tuple(v[0][3:]) if self.window_bits else v[0][3]
        self.values, self.fp_values = tuple(v[1][:3]), tuple(v[1][3:]) if self.window_bits else v[1][3]

    def meta(self) -> dict[str, Any]:
        return {
            "kv_bits": self.kv_bits,
            "kv_group_size": self.kv_group_size,
            "full_precision_window": self.full_precision_window,
            "n_full": self.n_full,
            "kv_rotate": self.kv_rotate,
            "window_bits": self.window_bits,
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> QuantizedStorage:
        """Rebuild from :meth:`meta` (older saves lack ``kv_rotate`` and ``window_bits``)."""
        storage = cls(
            kv_bits=meta["kv_bits"] if isinstance(meta["kv_bits"], int) else tuple(meta["kv_bits"]),
            kv_group_size=meta["kv_group_size"],
            full_precision_window=meta["full_precision_window"],
            kv_rotate=meta.get("kv_rotate", False),
            window_bits=meta.get("window_bits"),
        )
        storage.n_full = meta["n_full"]
        return storage
