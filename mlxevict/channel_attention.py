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


def channel_scores(queries: mx.array, codes: mx.array, rows: mx.array, scales: mx.array, biases: mx.array,
                   bits: int, dequantize=channel_dequantize) -> mx.array:  # fmt: skip
    """``q·k`` of one query per head over the keys quantized per channel.

    Args:
        queries: ``(B, H, G, 1, D)``, already scaled.
        codes: ``(B, H, N, D·bits/32)`` bit planes; rows: ``(B, H, N)`` each slot's table row.
        scales, biases: ``(B, H, T, D)`` the table.
        bits: the keys' bits.
        dequantize: :func:`~mlxevict.channel_codes.channel_dequantize` or its compiled twin.

    Returns:
        ``(B, H, G, 1, N)``, in the queries' dtype.
    """
    k = dequantize(codes, rows, scales, biases, bits).astype(queries.dtype)  # B, H, N, D
    return queries @ mx.expand_dims(k, 2).swapaxes(-1, -2)  # B, H, G, 1, N


def _qmm(x: mx.array, entries: tuple[mx.array, ...], transpose: bool, group_size: int, bits: int) -> mx.array:
    return mx.quantized_matmul(
        x, *(mx.expand_dims(e, 2) for e in entries), transpose=transpose, group_size=group_size, bits=bits
    )


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
    """
    (key_parts, held_keys), (value_parts, held_values) = keys, values
    part_bits, held_bits = bits
    live = [i for i, part in enumerate(key_parts) if part[0].shape[2] > 0]  # parts without slots are skipped
    B, HG, _, D = queries.shape
    H = held_keys[0].shape[1]
    q = (queries * scale).reshape(B, H, HG // H, 1, D)  # B, H, G, 1, D
    if rotation is not None:
        rotation = rotation.astype(q.dtype)
    q_held = q @ rotation if held_rotated else q
    # At least one part has slots (decodes_here).
    part_scores = [channel_scores(q, *key_parts[i], part_bits[i][0], dequantize[0]) for i in live]  # B, H, G, 1, N_i
    scores = mx.concatenate([*part_scores, _qmm(q_held, held_keys, True, group_size, held_bits)], axis=-1)
    probs = mx.softmax(scores, axis=-1, precise=True)
    out, first = None, 0
    for i, s in zip(live, part_scores):
        n = s.shape[-1]
        dense_values = dequantize[1](*value_parts[i], part_bits[i][1], group_size).astype(q.dtype)  # B, H, N_i, Dv
        part = probs[..., first : first + n] @ mx.expand_dims(dense_values, 2)  # B, H, G, 1, Dv
        out, first = part if out is None else out + part, first + n
    held_out = _qmm(probs[..., first:], held_values, False, group_size, held_bits)
    if rotation is None:
        out = out + held_out
    elif held_rotated:
        out = (out + held_out) @ rotation.T
    else:
        out = out @ rotation.T + held_out
    return out.reshape(B, HG, 1, -1)


# The held rows change shape at every step: compiling the whole step would retrace it each time.
channel_decode_attention_fast = partial(
    channel_decode_attention, dequantize=(channel_dequantize_compiled, token_dequantize_compiled)
)


def decodes_here(queries: mx.array, mask: Optional[object], n_quant: int, n_held: int) -> bool:
    """Whether :func:`channel_decode_attention` takes this call: one query, no mask, both parts non-empty
    (``mx.quantized_matmul`` cannot take zero rows)."""
    return queries.shape[2] == 1 and mask is None and n_quant > 0 and n_held > 0
