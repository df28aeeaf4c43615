"""Quantized storage for the evicting cache: kept entries in 8 or 4 bits, the newest in full precision.

``QuantizedEvictingKVCache`` evicts exactly like :class:`EvictingKVCache` but
stores what it keeps with ``mx.quantize`` (packed ``uint32`` words plus a scale
and a bias per group of ``kv_group_size`` values, as mlx-lm's
``QuantizedKVCache``). The newest ``full_precision_window`` tokens (the recent
window) stay in the model's dtype, or in 8 bits under storage below 8 bits with
``window_bits=8``, and are folded into quantized storage one by one as newer
tokens arrive (KIVI, https://arxiv.org/abs/2402.02750, keeps such a residual
too); they are never evicted while in the window.

Keys and values may take different bits (``kv_bits=(5, 3)``: the bytes of 4 bits):
on the test model the error of 4-bit storage comes from the keys (8-bit keys with
4-bit values: KL 0.0024; the reverse: 0.0089; README, "Keys and values apart").

Below 8 bits, keys and values are stored rotated by a fixed orthogonal matrix ``R``
(a Hadamard matrix with random signs; QuaRot, https://arxiv.org/abs/2404.00456):
``(qR)·(kR) = q·k``, so attention only rotates the queries in and the output back,
while the rotation spreads the few large key channels that make per-token 4-bit
groups coarse; on the test model it lowers the KL divergence of 4-bit storage to a
full cache (``tests/test_quantized_real.py``). 8-bit storage is not rotated by
default, so it stays equal to mlx-lm's ``QuantizedKVCache``.

Slots keep their meaning from the plain cache: ``positions``/``stats`` have
``C`` slots in time order. The first ``size - n_full`` are quantized (arrays of
``C - full_precision_window`` slots, so the window costs no quantized rows); the
last ``n_full`` live in the window buffers ``fp_keys``/``fp_values``. Because
those are the newest and always kept, compaction only gathers the quantized arrays.

Attention over this storage, :func:`quantized_attention`, runs inside the
patched ``scaled_dot_product_attention`` (see :mod:`mlxevict.patch`): quantized
matmuls over the quantized part, plain (or 8-bit) matmuls over the window, one
softmax over both. Policies score ``dense_keys``, dequantized and rotated back when
statistics are folded in (once per eviction), so no dense copy stays alive between
evictions.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import math
from functools import lru_cache

import mlx.core as mx
from mlx.utils import tree_flatten

from .cache import DEFAULT_BUDGET, GROW_STEP, EvictingKVCache, default_window, fit_slots
from .defaults import DEFAULT_GROUP_SIZE
from .policies import Policy

KV_BITS = (8, 4)
PAIR_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize supports, for a (key bits, value bits) pair
KVBits = Union[int, tuple[int, int]]
SPLIT_BITS = (5, 3)  # keys finer than values, at the bytes of 4 bits: the keys carry the error (README)
# A block of entries: model-dtype ``(B, H, N, D)``, or ``mx.quantize``'s (packed, scales, biases).
Entries = Union[mx.array, tuple[mx.array, mx.array, mx.array]]
GROUP_SIZES = (32, 64, 128)  # what mx.quantize supports


def check_storage(
    kv_bits: Any, group_size: Any, head_dims: tuple[int, ...] = (), window_bits: Any = None
) -> None:
    """Raise a ``ValueError`` naming the bad value and the fix.

    Args:
        kv_bits: 8 or 4, or a ``(key bits, value bits)`` pair of 2, 3, 4, 5, 6 or 8.
        group_size: 32, 64 or 128, dividing every head dim.
        head_dims: the key and value head dims, when known.
        window_bits: ``None`` or 8 (when keys and values are both under 8 bits).
    """
    if not _supported_bits(kv_bits):
        raise ValueError(
            f"kv_bits={kv_bits!r} is not supported; use 8 or 4, a (key bits, value bits) pair of "
            f"{', '.join(map(str, PAIR_BITS))} such as (5, 3), or None to store the model's dtype"
        )
    if window_bits is not None and (window_bits not in KV_BITS or window_bits <= max(key_value_bits(kv_bits))):
        raise ValueError(
            f"window_bits={window_bits!r} with kv_bits={kv_bits}: the recent window is stored in 8 bits under "
            "storage below 8 bits, or in the model's dtype (window_bits=None)"
        )
    if group_size not in GROUP_SIZES or isinstance(group_size, bool):
        raise ValueError(f"kv_group_size={group_size!r} is not supported by mx.quantize; use 32, 64 or 128")
    for dim in head_dims:
        if dim % group_size:
            fits = [str(g) for g in GROUP_SIZES if dim % g == 0]
            fix = f"use --kv-group-size {' or '.join(fits)}" if fits else "store this model's KV unquantized"
            raise ValueError(f"kv_group_size={group_size} does not divide the head dim {dim}; {fix}")


def _supported_bits(kv_bits: Any) -> bool:
    if isinstance(kv_bits, (tuple, list)):
        return len(kv_bits) == 2 and all(b in PAIR_BITS and not isinstance(b, bool) for b in kv_bits)
    return kv_bits in KV_BITS and not isinstance(kv_bits, bool)


def key_value_bits(kv_bits: KVBits) -> tuple[int, int]:
    """``(key bits, value bits)`` of ``kv_bits`` (one number means both)."""
    return (kv_bits, kv_bits) if isinstance(kv_bits, int) else (int(kv_bits[0]), int(kv_bits[1]))


def bits_label(kv_bits: KVBits) -> str:
    """``"4-bit"``, or ``"5/3-bit"`` for keys in 5 and values in 3."""
    key_bits, value_bits = key_value_bits(kv_bits)
    return f"{key_bits}-bit" if key_bits == value_bits else f"{key_bits}/{value_bits}-bit"


@lru_cache(maxsize=8)
def rotation_matrix(dim: int) -> mx.array:
    """A fixed ``(dim, dim)`` orthogonal matrix (float32) that spreads outlier channels.

    A power-of-two ``dim`` gets a normalised Hadamard matrix with seeded random row
    signs; any other ``dim`` the orthogonal factor of a seeded Gaussian matrix. The
    seed is fixed, so a saved cache reloads with the same matrix.
    """
    key = mx.random.key(0)
    if dim & (dim - 1) == 0:
        h = mx.array([[1.0]])
        while h.shape[0] < dim:
            h = mx.concatenate([mx.concatenate([h, h], axis=1), mx.concatenate([h, -h], axis=1)], axis=0)
        signs = mx.where(mx.random.bernoulli(0.5, (dim, 1), key=key), 1.0, -1.0)
        return signs * h / math.sqrt(dim)
    q, _ = mx.linalg.qr(mx.random.normal((dim, dim), key=key), stream=mx.cpu)
    return q


def model_head_dim(model: Any) -> int:
    """The attention head dim of an mlx-lm model, from its ``ModelArgs``."""
    args = model.args
    return getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads


def storage_bytes(
    dim: int, dtype_size: int, bits: Optional[int] = None, group_size: int = DEFAULT_GROUP_SIZE
) -> int:
    """Bytes one stored key (or value) vector of ``dim`` elements takes.

    Model dtype: ``dim × dtype_size``; quantized: ``dim × bits / 8`` plus a scale
    and a bias (model dtype) per group.
    """
    if bits is None:
        return dim * dtype_size
    return dim * bits // 8 + 2 * (dim // group_size) * dtype_size


def _quantized(entries: Entries) -> bool:
    return not isinstance(entries, mx.array)  # mx.quantize returns a list, our storage a tuple


def _rows(entries: Entries) -> int:
    return (entries[0] if _quantized(entries) else entries).shape[-2]


def _first_rows(entries: Entries, n: int) -> Entries:
    if _quantized(entries):
        return tuple(x[..., :n, :] for x in entries)
    return entries[..., :n, :]


def _matmul(x: mx.array, entries: Entries, transpose: bool, group_size: int, bits: Optional[int]) -> mx.array:
    """``x @ entries.T`` (``transpose``) or ``x @ entries``, quantized or not.

    On the CPU a step of several queries (a prompt chunk) dequantizes first: MLX's
    CPU quantized matmul does not use BLAS, and one dequantized copy costs less than
    the product (README, "Quality per byte": prefill about 2x). One query (decoding),
    and any step on the GPU, use the quantized matmul, as mlx-lm does.
    """
    if _quantized(entries):
        if x.shape[-2] == 1 or mx.default_device() != mx.cpu:
            return mx.quantized_matmul(x, *entries, transpose=transpose, group_size=group_size, bits=bits)
        entries = mx.dequantize(*entries, group_size=group_size, bits=bits)
    return x @ (entries.swapaxes(-1, -2) if transpose else entries)


def quantized_attention(
    queries: mx.array,
    keys: tuple[Entries, Entries],
    values: tuple[Entries, Entries],
    scale: float,
    mask: Any,
    group_size: int,
    bits: KVBits,
    rotation: Optional[mx.array] = None,
    window_bits: Optional[int] = None,
) -> mx.array:
    """Attention over quantized entries followed by full-precision ones, one softmax.

    With no full-precision entries and no rotation this is mlx-lm's
    ``quantized_scaled_dot_product_attention``, operation for operation, for one
    query; a chunk of queries on the CPU uses dequantized entries (see ``_matmul``).

    Args:
        queries: ``(B, H*G, L, D)`` after RoPE.
        keys, values: ``((packed, scales, biases), recent)`` from
            :meth:`QuantizedEvictingKVCache.update_and_fetch`: quantized
            ``(B, H, Q, ·)`` arrays, then the ``F`` newer entries: ``(B, H, F, D)``
            in the model's dtype, or quantized in ``window_bits``.
        scale: the attention scale.
        mask: ``None``, ``"causal"`` or an array over the ``Q + F`` entries.
        group_size, bits: the quantization (``bits``: one number, or keys' and values').
        rotation: ``(D, D)`` orthogonal matrix the entries were stored
            multiplied by (:func:`rotation_matrix`), or ``None``.
        window_bits: the bits of the newer entries when they are quantized.

    Returns:
        ``(B, H*G, L, Dv)``.
    """
    (q_keys, f_keys), (q_values, f_values) = keys, values
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = q_keys[0].shape[1]
    n_repeats = n_q_heads // n_kv_heads
    n_quant, n_full = _rows(q_keys), _rows(f_keys)
    queries = queries * scale  # not in place: the patched attention shows the queries to the policy
    if rotation is not None:
        rotation = rotation.astype(queries.dtype)
        queries = queries @ rotation  # (qR)·(kR) = q·k
    if n_repeats > 1:
        queries = mx.reshape(queries, (B, n_kv_heads, n_repeats, L, D))
        q_keys, q_values, f_keys, f_values = [
            tuple(mx.expand_dims(x, -3) for x in e) if _quantized(e) else mx.expand_dims(e, -3)
            for e in (q_keys, q_values, f_keys, f_values)
        ]
    key_bits, value_bits = key_value_bits(bits)
    stored = ((q_keys, q_values, key_bits, value_bits), (f_keys, f_values, window_bits, window_bits))
    blocks = [block for block in stored if _rows(block[0])]  # (mx.quantized_matmul cannot take zero rows)
    parts = [_matmul(queries, k, True, group_size, b) for k, _, b, _ in blocks]
    scores = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)  # ..., L, Q + F
    if mask is not None:
        if isinstance(mask, str):
            qL, kL = scores.shape[-2:]
            mask = mx.arange(kL - qL, kL)[:, None] >= mx.arange(kL)[None]
        if n_repeats > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores += mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    if len(blocks) == 1:
        out = _matmul(scores, blocks[0][1], False, group_size, blocks[0][3])
    else:
        out = _matmul(scores[..., :n_quant], q_values, False, group_size, value_bits)
        out = out + _matmul(scores[..., n_quant:], f_values, False, group_size, window_bits)
    if n_repeats > 1:
        out = mx.reshape(out, (B, n_q_heads, L, -1))
    if rotation is not None:
        out = out @ rotation.T  # the values were stored as vR
    return out


class QuantizedEvictingKVCache(EvictingKVCache):
    """An :class:`EvictingKVCache` that stores its entries in 8 or 4 bits (or keys and values apart).

    Build it with ``make_cache(model, policy, budget, kv_bits=8)``, which also
    patches the model: attention over this storage needs the patched attention.

    Args:
        policy, budget, sinks, window, slack, prompt_mode, pinned, policy_kwargs:
            see :class:`EvictingKVCache`.
        kv_bits: 8 or 4, or ``(key bits, value bits)`` such as ``(5, 3)``. Default 8.
        kv_group_size: values per scale and bias: 32, 64 or 128, dividing the
            head dim. Default 64 (mlx-lm's).
        full_precision_window: the newest tokens kept in the model's dtype
            (never evicted while there). Default ``min(32, budget // 8)`` (the
            cache's usual recent window, whatever the policy's); 0 quantizes every
            token at once, as mlx-lm's ``QuantizedKVCache`` does.
        kv_rotate: store keys and values rotated by :func:`rotation_matrix`
            (exact in attention, smaller 4-bit error). Default ``None``: rotate
            when keys or values are under 8 bits.
        window_bits: ``None`` (default) keeps the recent window in the model's
            dtype; 8 (with storage under 8 bits) stores it in 8 bits, which on the test
            model costs it almost nothing in quality for half its bytes.
    """

    def __init__(
        self,
        policy: str | Policy = "default",
        budget: int = DEFAULT_BUDGET,
        *,
        kv_bits: KVBits = 8,
        kv_group_size: int = DEFAULT_GROUP_SIZE,
        full_precision_window: Optional[int] = None,
        kv_rotate: Optional[bool] = None,
        window_bits: Optional[int] = None,
        **kwargs: Any,
    ):
        check_storage(kv_bits, kv_group_size, window_bits=window_bits)
        super().__init__(policy, budget, **kwargs)
        full = default_window(self.budget) if full_precision_window is None else full_precision_window
        if not isinstance(full, int) or isinstance(full, bool) or full < 0:
            raise ValueError(f"full_precision_window={full!r} must be a number of tokens >= 0")
        self.kv_bits = kv_bits if isinstance(kv_bits, int) else key_value_bits(kv_bits)
        self.key_bits, self.value_bits = key_value_bits(kv_bits)
        self.kv_group_size, self.full_precision_window = kv_group_size, full
        self.kv_rotate = min(self.key_bits, self.value_bits) < 8 if kv_rotate is None else bool(kv_rotate)
        self.window_bits = window_bits
        protected = self.sinks + self.protected_window + self.pinned_tokens + self.slack
        if full > self.window and self.budget <= protected:
            raise ValueError(
                f"full_precision_window={full} leaves no room to evict at budget={self.budget}: "
                f"sinks + full_precision_window + slack = {protected} (full-precision tokens are never "
                "evicted); lower full_precision_window or raise --budget"
            )
        self.fp_keys: Optional[Entries] = None
        self.fp_values: Optional[Entries] = None
        self.n_full = 0  # newest tokens held in fp_keys/fp_values (the recent window)

    @property
    def protected_window(self) -> int:
        return max(self.window, getattr(self, "full_precision_window", 0))

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        arrays = (self.keys, self.values, self.fp_keys, self.fp_values)
        return sum(x.nbytes for _, x in tree_flatten(arrays))

    @property
    def dense_shape(self) -> tuple[int, int, int, int, mx.Dtype]:
        """``(B, H, D, Dv, dtype)`` of the keys and values as the model made them."""
        B, H, _, groups = self.keys[1].shape
        return B, H, groups * self.kv_group_size, self.values[1].shape[3] * self.kv_group_size, self.keys[1].dtype

    @property
    def dense_keys(self) -> mx.array:
        """``(B, H, C, D)`` keys dequantized to the model's dtype (a transient copy, for policies)."""
        B, H, C = self.positions.shape
        _, _, D, _, dtype = self.dense_shape
        n_quant = self._size - self.n_full
        parts = []
        if n_quant:
            parts.append(self._dense(_first_rows(self.keys, n_quant), self.key_bits))
        if self.n_full:
            parts.append(self._dense(_first_rows(self.fp_keys, self.n_full), self.window_bits))
        if C > self._size:
            parts.append(mx.zeros((B, H, C - self._size, D), dtype))
        keys = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
        rotation = self.rotation
        return keys if rotation is None else keys @ rotation.T.astype(keys.dtype)

    @property
    def rotation(self) -> Optional[mx.array]:
        """The ``(D, D)`` matrix keys and values are stored multiplied by, or ``None``."""
        if not self.kv_rotate or self.keys is None:
            return None
        return rotation_matrix(self.dense_shape[2])

    def _dense(self, entries: Entries, bits: Optional[int]) -> mx.array:
        if _quantized(entries):
            return mx.dequantize(*entries, group_size=self.kv_group_size, bits=bits)
        return entries

    # ---- storage -----------------------------------------------------------
    def _quantized_capacity(self, capacity: int) -> int:
        return max(0, capacity - self.full_precision_window)

    def _zeros(self, B: int, H: int, C: int, D: int, dtype: mx.Dtype, bits: int) -> Entries:
        groups = D // self.kv_group_size
        return (
            mx.zeros((B, H, C, D * bits // 32), mx.uint32),  # mx.quantize packs D * bits bits per row
            mx.zeros((B, H, C, groups), dtype),
            mx.zeros((B, H, C, groups), dtype),
        )

    def _allocate(self, B: int, H: int, D: int, Dv: int, dtype: mx.Dtype) -> None:
        check_storage(self.kv_bits, self.kv_group_size, (D, Dv))
        capacity = self.budget if self.policy.evicts else GROW_STEP
        quantized = self._quantized_capacity(capacity)
        self.keys = self._zeros(B, H, quantized, D, dtype, self.key_bits)
        self.values = self._zeros(B, H, quantized, Dv, dtype, self.value_bits)
        F = self.full_precision_window
        if self.window_bits:
            self.fp_keys = self._zeros(B, H, F, D, dtype, self.window_bits)
            self.fp_values = self._zeros(B, H, F, Dv, dtype, self.window_bits)
        else:
            self.fp_keys, self.fp_values = mx.zeros((B, H, F, D), dtype), mx.zeros((B, H, F, Dv), dtype)
        self.positions = mx.full((B, H, capacity), -1, mx.int32)
        self.stats = mx.zeros((B, H, capacity), mx.float32)

    def _resize(self, capacity: int) -> None:
        quantized = self._quantized_capacity(capacity)
        self.keys = tuple(fit_slots(x, quantized, 0) for x in self.keys)
        self.values = tuple(fit_slots(x, quantized, 0) for x in self.values)
        self.positions, self.stats = fit_slots(self.positions, capacity, -1), fit_slots(self.stats, capacity, 0)

    def _write(self, keys: mx.array, values: mx.array, start: int) -> None:
        """Append ``S`` tokens to the recent window, folding its oldest into quantized storage."""
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

    def _fetch(self):
        n_quant = self._size - self.n_full
        keys = _first_rows(self.keys, n_quant), _first_rows(self.fp_keys, self.n_full)
        values = _first_rows(self.values, n_quant), _first_rows(self.fp_values, self.n_full)
        return keys, values

    def _slots(self) -> list[mx.array]:
        return [self.positions, *self.keys, *self.values, self.stats]

    def _set_slots(self, arrays: list[mx.array]) -> None:
        self.positions, self.stats = arrays[0], arrays[7]
        self.keys, self.values = tuple(arrays[1:4]), tuple(arrays[4:7])

    # ---- save / load ---------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return {
            **super()._meta(),
            "kv_bits": self.kv_bits,
            "kv_group_size": self.kv_group_size,
            "full_precision_window": self.full_precision_window,
            "n_full": self.n_full,
            "kv_rotate": self.kv_rotate,
            "window_bits": self.window_bits,
        }

    def _restore(self, meta: dict[str, Any], **storage: Any) -> None:
        super()._restore(
            meta,
            kv_bits=meta["kv_bits"],  # a pair comes back from JSON as a list; the constructor makes it a tuple
            kv_group_size=meta["kv_group_size"],
            full_precision_window=meta["full_precision_window"],
            kv_rotate=meta.get("kv_rotate", False),
            window_bits=meta.get("window_bits"),
        )
        self.n_full = meta["n_full"]

    @property
    def state(self):
        self._flush()
        keys = values = None
        if self.keys is not None:
            window = (self.fp_keys, self.fp_values) if self.window_bits else ((self.fp_keys,), (self.fp_values,))
            keys, values = (*self.keys, *window[0]), (*self.values, *window[1])
        queries = (self.recent_queries, self.recent_query_pos)
        return (keys, values, self.positions, self.stats, *queries, self.meta_state)

    @state.setter
    def state(self, v) -> None:
        self.meta_state = v[6]
        self.positions, self.stats = v[2], v[3]
        self.recent_queries, self.recent_query_pos = v[4:6]
        if v[0] is not None:
            # meta_state (set above) restored window_bits: an 8-bit window is a triple, else one array
            self.keys, self.fp_keys = tuple(v[0][:3]), tuple(v[0][3:]) if self.window_bits else v[0][3]
            self.values, self.fp_values = tuple(v[1][:3]), tuple(v[1][3:]) if self.window_bits else v[1][3]
