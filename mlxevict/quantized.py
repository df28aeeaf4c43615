"""Quantized storage for the evicting cache: kept entries in 8 or 4 bits, the newest in full precision.

``QuantizedEvictingKVCache`` evicts exactly like :class:`EvictingKVCache` but
stores what it keeps with ``mx.quantize`` (packed ``uint32`` words plus a scale
and a bias per group of ``kv_group_size`` values, as mlx-lm's
``QuantizedKVCache``). The newest ``full_precision_window`` tokens stay in the
model's dtype and are folded into quantized storage one by one as newer tokens
arrive (KIVI, https://arxiv.org/abs/2402.02750, keeps such a residual too); they
are never evicted while in full precision.

Slots keep their meaning from the plain cache: ``positions``/``stats`` have
``C`` slots in time order. The first ``size - n_full`` are quantized (arrays of
``C - full_precision_window`` slots, so the window costs no quantized rows); the
last ``n_full`` live in the full-precision buffer. Because those are the newest
and always kept, compaction only gathers the quantized arrays.

Attention over this storage, :func:`quantized_attention`, runs inside the
patched ``scaled_dot_product_attention`` (see :mod:`mlxevict.patch`): quantized
matmuls over the quantized part, plain matmuls over the full-precision part, one
softmax over both. Policies score ``dense_keys``, dequantized when statistics are
folded in (once per eviction), so no dense copy stays alive between evictions.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx

from .cache import DEFAULT_BUDGET, GROW_STEP, EvictingKVCache, default_window, fit_slots
from .policies import Policy

KV_BITS = (8, 4)
GROUP_SIZES = (32, 64, 128)  # what mx.quantize supports
DEFAULT_GROUP_SIZE = 64  # mlx-lm's --kv-group-size default


def check_storage(kv_bits: Any, group_size: Any, head_dims: tuple[int, ...] = ()) -> None:
    """Raise a ``ValueError`` naming the bad value and the fix.

    Args:
        kv_bits: 8 or 4.
        group_size: 32, 64 or 128, dividing every head dim.
        head_dims: the key and value head dims, when known.
    """
    if kv_bits not in KV_BITS or isinstance(kv_bits, bool):
        raise ValueError(f"kv_bits={kv_bits!r} is not supported; use 8 or 4 (or None to store the model's dtype)")
    if group_size not in GROUP_SIZES or isinstance(group_size, bool):
        raise ValueError(f"kv_group_size={group_size!r} is not supported by mx.quantize; use 32, 64 or 128")
    for dim in head_dims:
        if dim % group_size:
            fits = [str(g) for g in GROUP_SIZES if dim % g == 0]
            fix = f"use --kv-group-size {' or '.join(fits)}" if fits else "store this model's KV unquantized"
            raise ValueError(f"kv_group_size={group_size} does not divide the head dim {dim}; {fix}")


def model_head_dim(model: Any) -> int:
    """The attention head dim of an mlx-lm model, from its ``ModelArgs``."""
    args = model.args
    return getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads


def storage_bytes(
    dim: int, dtype_size: int, kv_bits: Optional[int] = None, group_size: int = DEFAULT_GROUP_SIZE
) -> int:
    """Bytes one stored key (or value) vector of ``dim`` elements takes.

    Model dtype: ``dim × dtype_size``; quantized: ``dim × bits / 8`` plus a scale
    and a bias (model dtype) per group.
    """
    if kv_bits is None:
        return dim * dtype_size
    return dim * kv_bits // 8 + 2 * (dim // group_size) * dtype_size


def quantized_attention(
    queries: mx.array,
    keys: tuple[tuple[mx.array, ...], mx.array],
    values: tuple[tuple[mx.array, ...], mx.array],
    scale: float,
    mask: Any,
    group_size: int,
    bits: int,
) -> mx.array:
    """Attention over quantized entries followed by full-precision ones, one softmax.

    With no full-precision entries this is mlx-lm's
    ``quantized_scaled_dot_product_attention``, operation for operation.

    Args:
        queries: ``(B, H*G, L, D)`` after RoPE.
        keys, values: ``((packed, scales, biases), full)`` from
            :meth:`QuantizedEvictingKVCache.update_and_fetch`: quantized
            ``(B, H, Q, ·)`` arrays, then ``(B, H, F, D)`` newer entries.
        scale: the attention scale.
        mask: ``None``, ``"causal"`` or an array over the ``Q + F`` entries.
        group_size, bits: the quantization.

    Returns:
        ``(B, H*G, L, Dv)``.
    """
    (q_keys, f_keys), (q_values, f_values) = keys, values
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = f_keys.shape[1]
    n_repeats = n_q_heads // n_kv_heads
    n_quant, n_full = q_keys[0].shape[2], f_keys.shape[2]
    queries = queries * scale  # not in place: the patched attention shows the queries to the policy
    if n_repeats > 1:
        queries = mx.reshape(queries, (B, n_kv_heads, n_repeats, L, D))
        q_keys, q_values = [tuple(mx.expand_dims(x, -3) for x in kv) for kv in (q_keys, q_values)]
        f_keys, f_values = mx.expand_dims(f_keys, -3), mx.expand_dims(f_values, -3)
    parts = []
    if n_quant:  # mx.quantized_matmul cannot take zero rows
        parts.append(mx.quantized_matmul(queries, *q_keys, transpose=True, group_size=group_size, bits=bits))
    if n_full:
        parts.append(queries @ f_keys.swapaxes(-1, -2))
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
    out = None
    if n_quant:
        weights = scores[..., :n_quant] if n_full else scores
        out = mx.quantized_matmul(weights, *q_values, transpose=False, group_size=group_size, bits=bits)
    if n_full:
        recent = scores[..., n_quant:] @ f_values
        out = recent if out is None else out + recent
    if n_repeats > 1:
        out = mx.reshape(out, (B, n_q_heads, L, -1))
    return out


class QuantizedEvictingKVCache(EvictingKVCache):
    """An :class:`EvictingKVCache` that stores its entries in 8 or 4 bits.

    Build it with ``make_cache(model, policy, budget, kv_bits=8)``, which also
    patches the model: attention over this storage needs the patched attention.

    Args:
        policy, budget, sinks, window, slack, prompt_mode, pinned, policy_kwargs:
            see :class:`EvictingKVCache`.
        kv_bits: 8 or 4. Default 8.
        kv_group_size: values per scale and bias: 32, 64 or 128, dividing the
            head dim. Default 64 (mlx-lm's).
        full_precision_window: the newest tokens kept in the model's dtype
            (never evicted while there). Default ``min(32, budget // 8)`` (the
            cache's usual recent window, whatever the policy's); 0 quantizes every
            token at once, as mlx-lm's ``QuantizedKVCache`` does.
    """

    def __init__(
        self,
        policy: str | Policy = "default",
        budget: int = DEFAULT_BUDGET,
        *,
        kv_bits: int = 8,
        kv_group_size: int = DEFAULT_GROUP_SIZE,
        full_precision_window: Optional[int] = None,
        **kwargs: Any,
    ):
        check_storage(kv_bits, kv_group_size)
        super().__init__(policy, budget, **kwargs)
        full = default_window(self.budget) if full_precision_window is None else full_precision_window
        if not isinstance(full, int) or isinstance(full, bool) or full < 0:
            raise ValueError(f"full_precision_window={full!r} must be a number of tokens >= 0")
        self.kv_bits, self.kv_group_size, self.full_precision_window = kv_bits, kv_group_size, full
        protected = self.sinks + self.protected_window + self.pinned_tokens + self.slack
        if full > self.window and self.budget <= protected:
            raise ValueError(
                f"full_precision_window={full} leaves no room to evict at budget={self.budget}: "
                f"sinks + full_precision_window + slack = {protected} (full-precision tokens are never "
                "evicted); lower full_precision_window or raise --budget"
            )
        self.fp_keys = self.fp_values = None
        self.n_full = 0  # newest tokens held in fp_keys/fp_values

    @property
    def protected_window(self) -> int:
        return max(self.window, getattr(self, "full_precision_window", 0))

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        arrays = (*self.keys, *self.values, self.fp_keys, self.fp_values)
        return sum(x.nbytes for x in arrays)

    @property
    def dense_keys(self) -> mx.array:
        """``(B, H, C, D)`` keys dequantized to the model's dtype (a transient copy, for policies)."""
        B, H, C = self.positions.shape
        n_quant = self._size - self.n_full
        parts = []
        if n_quant:
            packed = [x[..., :n_quant, :] for x in self.keys]
            parts.append(mx.dequantize(*packed, group_size=self.kv_group_size, bits=self.kv_bits))
        if self.n_full:
            parts.append(self.fp_keys[..., : self.n_full, :])
        if C > self._size:
            parts.append(mx.zeros((B, H, C - self._size, self.fp_keys.shape[3]), self.fp_keys.dtype))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    # ---- storage -----------------------------------------------------------
    def _quantized_capacity(self, capacity: int) -> int:
        return max(0, capacity - self.full_precision_window)

    def _zeros(self, B: int, H: int, C: int, D: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array]:
        per_word = 32 // self.kv_bits
        groups = D // self.kv_group_size
        return (
            mx.zeros((B, H, C, D // per_word), mx.uint32),
            mx.zeros((B, H, C, groups), dtype),
            mx.zeros((B, H, C, groups), dtype),
        )

    def _allocate(self, B: int, H: int, D: int, Dv: int, dtype: mx.Dtype) -> None:
        check_storage(self.kv_bits, self.kv_group_size, (D, Dv))
        capacity = self.budget if self.policy.evicts else GROW_STEP
        quantized = self._quantized_capacity(capacity)
        self.keys = self._zeros(B, H, quantized, D, dtype)
        self.values = self._zeros(B, H, quantized, Dv, dtype)
        self.fp_keys = mx.zeros((B, H, self.full_precision_window, D), dtype)
        self.fp_values = mx.zeros((B, H, self.full_precision_window, Dv), dtype)
        self.positions = mx.full((B, H, capacity), -1, mx.int32)
        self.stats = mx.zeros((B, H, capacity), mx.float32)

    def _resize(self, capacity: int) -> None:
        quantized = self._quantized_capacity(capacity)
        self.keys = tuple(fit_slots(x, quantized, 0) for x in self.keys)
        self.values = tuple(fit_slots(x, quantized, 0) for x in self.values)
        self.positions, self.stats = fit_slots(self.positions, capacity, -1), fit_slots(self.stats, capacity, 0)

    def _key_shape(self) -> tuple[int, int, int]:
        B, H, _, D = self.fp_keys.shape
        return B, H, D

    def _write(self, keys: mx.array, values: mx.array, start: int) -> None:
        """Append ``S`` tokens to the full-precision buffer, folding its oldest into quantized storage."""
        S, F, n_full = keys.shape[2], self.full_precision_window, self.n_full
        n_quant = start - n_full
        fold = max(0, n_full + S - F)
        if fold:
            for stored, fresh, full in ((self.keys, keys, self.fp_keys), (self.values, values, self.fp_values)):
                recent = mx.concatenate([full[..., :n_full, :], fresh], axis=2) if n_full else fresh
                packed = mx.quantize(recent[..., :fold, :], group_size=self.kv_group_size, bits=self.kv_bits)
                for x, p in zip(stored, packed):
                    x[..., n_quant : n_quant + fold, :] = p
                if F:
                    full[..., :F, :] = recent[..., fold:, :]
            self.n_full = F
        else:
            self.fp_keys[..., n_full : n_full + S, :] = keys
            self.fp_values[..., n_full : n_full + S, :] = values
            self.n_full = n_full + S

    def _fetch(self):
        n_quant = self._size - self.n_full
        keys = tuple(x[..., :n_quant, :] for x in self.keys), self.fp_keys[..., : self.n_full, :]
        values = tuple(x[..., :n_quant, :] for x in self.values), self.fp_values[..., : self.n_full, :]
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
        }

    def _restore(self, meta: dict[str, Any], **storage: Any) -> None:
        super()._restore(
            meta,
            kv_bits=meta["kv_bits"],
            kv_group_size=meta["kv_group_size"],
            full_precision_window=meta["full_precision_window"],
        )
        self.n_full = meta["n_full"]

    @property
    def state(self):
        self._flush()
        keys = values = None
        if self.keys is not None:
            keys, values = (*self.keys, self.fp_keys), (*self.values, self.fp_values)
        queries = (self.recent_queries, self.recent_query_pos)
        return (keys, values, self.positions, self.stats, *queries, self.meta_state)

    @state.setter
    def state(self, v) -> None:
        self.meta_state = v[6]
        self.positions, self.stats = v[2], v[3]
        self.recent_queries, self.recent_query_pos = v[4:6]
        if v[0] is not None:
            self.keys, self.fp_keys = tuple(v[0][:3]), v[0][3]
            self.values, self.fp_values = tuple(v[1][:3]), v[1][3]
