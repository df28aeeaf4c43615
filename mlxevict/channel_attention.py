"""One decode step's attention over :class:`~mlxevict.channel_storage.ChannelStorage`: a plain reference and
a fast twin that dequantizes with compiled kernels.

The keys quantized per channel are dequantized inside the kernel: their codes are
unpacked from bit planes (:func:`mlxevict.channel_codes.unpack_planes`: shifts and masks,
where ``mx.quantize``'s layout needs gathers) and scaled by their table rows, keys
bit-identical to the simulation's and the prompt path's (folding the scales into
the query instead, ``(q∘s_r)·c + q·b_r``, saved 0.05 ms a layer but rounds
differently, enough to move a 3-bit code on a later token of
``tests/test_channel_storage.py``'s decode). The quantized values are dequantized in
the kernel too (bit planes, :func:`~mlxevict.channel_codes.token_dequantize`: faster than
``mx.quantized_matmul`` at 3 bits on the CPU). The 8-bit held rows are read by quantized
matmuls, the held keys with the query rotated (``(qR)·(kR) = q·k``) when they are stored rotated.

Shapes: ``B`` batch, ``H`` kv-heads, ``G`` query heads per kv-head, ``N`` quantized
slots, ``F`` held slots, ``T`` table rows, ``D`` head dim, ``Dv`` value dim; one query.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import mlx.core as mx

from .channel_codes import channel_dequantize, channel_dequantize_compiled, token_dequantize, token_dequantize_compiled


def _qmm(x: mx.array, entries: tuple[mx.array, ...], transpose: bool, group_size: int, bits: int) -> mx.array:
    return mx.quantized_matmul(x, *entries, transpose=transpose, group_size=group_size, bits=bits)


def channel_decode_attention(
    queries: mx.array,
    keys: tuple[tuple[tuple[mx.array, ...], ...], tuple[mx.array, ...]],
    values: tuple[tuple[tuple[mx.array, ...], ...], tuple[mx.array, ...]],
    rotation: Optional[mx.array],
    scale: float,
    group_size: int,
    bits: tuple[tuple[tuple[int, int], ...], int],
    held_rotated: bool,
    dequantize: tuple = (channel_dequantize, token_dequantize),
) -> mx.array:
    """Attention of one query per head over a channel storage's entries, one softmax.

    Args:
        queries: ``(B, H*G, 1, D)`` after RoPE.
        keys: ``(parts, held)``: each part ``N_i`` quantized slots ``(codes, rows, scales, biases)`` as
            :meth:`ChannelStorage.fetch` returns them (one part; :class:`~mlxevict.tiered_storage.TieredStorage`:
            the low tier, then the high), then the ``F ≥ 1`` held keys, an ``mx.quantize`` triple.
        values: ``(parts, held)``: each part's values (codes in bit planes, scales, biases), rotated
            with a rotation, and the ``F`` held ones' ``mx.quantize`` triple.
        rotation: ``(Dv, Dv)`` the values' rotation (and the held keys', with ``held_rotated``), or ``None``.
        scale: the attention scale.
        group_size: channels per scale of the per-token triples.
        bits: ``(((key bits, value bits) per part), held bits)``.
        held_rotated: the held rows are stored rotated.
        dequantize: the keys' and the values' dequantization (plain, or compiled in
            :data:`channel_decode_attention_fast`).

    Returns:
        ``(B, H*G, 1, Dv)`` in the queries' dtype.

    The parts' keys (and values) are dequantized and joined into one ``(B, H, N, ·)`` array, so one
    matmul reads them all; the queries are ``(B, H, G, D)``, the ``G`` query heads of a kv-head as the
    rows of its matmuls. On the CPU each graph node costs a few microseconds whatever its size, so
    fewer nodes is most of what makes a decode step fast here (docs/tiers.md, "Decode speed").
    """
    (key_parts, held_keys), (value_parts, held_values) = keys, values
    part_bits, held_bits = bits
    live = [i for i, part in enumerate(key_parts) if part[0].shape[2] > 0]  # parts without slots are skipped
    B, HG, _, D = queries.shape
    H = held_keys[0].shape[1]
    q = (queries * scale).reshape(B, H, HG // H, D)  # B, H, G, D
    q_held = q @ rotation if held_rotated else q
    # At least one part has slots (decodes_here).
    dense_keys = _joined([dequantize[0](*key_parts[i], part_bits[i][0]) for i in live]).astype(q.dtype)  # B, H, N, D
    n = dense_keys.shape[2]
    scores = mx.concatenate([q @ dense_keys.swapaxes(-1, -2), _qmm(q_held, held_keys, True, group_size, held_bits)], -1)
    probs = mx.softmax(scores, axis=-1, precise=True)  # B, H, G, N + F
    dense_values = _joined([dequantize[1](*value_parts[i], part_bits[i][1], group_size) for i in live])
    out = probs[..., :n] @ dense_values.astype(q.dtype)  # B, H, G, Dv
    held_out = _qmm(probs[..., n:], held_values, False, group_size, held_bits)
    if rotation is None:
        out = out + held_out
    elif held_rotated:
        out = (out + held_out) @ rotation.T
    else:
        out = out @ rotation.T + held_out
    return out.reshape(B, HG, 1, -1)


def _joined(parts: list[mx.array]) -> mx.array:
    """``(B, H, N_i, ·)`` parts as one array along the slots."""
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


# The held rows change shape at every step: compiling the whole step would retrace it each time.
channel_decode_attention_fast = partial(
    channel_decode_attention, dequantize=(channel_dequantize_compiled, token_dequantize_compiled)
)


def decodes_here(queries: mx.array, mask: Optional[object], n_quant: int, n_held: int) -> bool:
    """Whether :func:`channel_decode_attention` takes this call: one query, no mask, both parts non-empty
    (``mx.quantized_matmul`` cannot take zero rows)."""
    return queries.shape[2] == 1 and mask is None and n_quant > 0 and n_held > 0
