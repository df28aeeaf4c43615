"""Attention over quantized entries followed by the recent window, one softmax.

Runs inside the patched ``scaled_dot_product_attention`` (see :mod:`mlxevict.model_patch`)
for quantized storage (:mod:`mlxevict.quantized_storage`): quantized matmuls over
the quantized part, plain (or 8-bit) matmuls over the window.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import mlx.core as mx

from .kvstorage import KVBits, key_value_bits

# A block of entries: model-dtype ``(B, H, N, D)``, or ``mx.quantize``'s (packed, scales, biases).
Entries = Union[mx.array, tuple[mx.array, mx.array, mx.array]]


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
    the product (docs/results/history.md, "Quality per byte": prefill about 2x). One query (decoding),
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
            :meth:`QuantizedStorage.fetch`: quantized
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
    n_kv_heads = (q_keys[0] if _quantized(q_keys) else q_keys).shape[1]
    n_repeats = n_q_heads // n_kv_heads
    n_quant = _rows(q_keys)
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
