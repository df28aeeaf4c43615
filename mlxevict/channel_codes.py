"""Per-channel key codes: ``mx.quantize``'s codes, bit-packed per token row, and their dequantization.

:mod:`mlxevict.channel_storage` quantizes a group of keys per channel with
``mx.quantize`` (along the tokens) and stores each token's codes as one row
(along the channels), so a slot moves alone when the cache compacts. ``mx.quantize``
packs codes least significant bit first into ``uint32`` words, as
:func:`pack_codes` does (``tests/test_channel_storage.py`` checks the layouts agree
for 2, 3, 4, 5, 6 and 8 bits).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

WORD = 32  # bits per packed word


def _layout(bits: int) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """For 32 codes of ``bits`` in ``bits`` words: each code's word, shift, and the next word's shift."""
    start = np.arange(WORD) * bits
    word, shift = start // WORD, start % WORD
    spill = shift + bits > WORD  # the code continues in the next word
    next_word = np.minimum(word + 1, bits - 1)
    next_shift = np.where(spill, WORD - shift, 0)
    return (
        mx.array(word),
        mx.array(shift.astype(np.uint32)),
        mx.array(next_word),
        mx.array(next_shift.astype(np.uint32)),
    )


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """``(..., D)`` integer codes below ``2**bits`` → ``(..., D * bits // 32)`` ``uint32``, bit-packed LSB first."""
    *lead, D = codes.shape
    word, shift, next_word, next_shift = _layout(bits)
    c = codes.astype(mx.uint32).reshape(*lead, D // WORD, WORD)  # ..., D/32, 32
    low = c << shift  # bits that land in the code's own word (overflow drops off)
    high = mx.where(next_shift > 0, c >> mx.where(next_shift > 0, next_shift, 1), 0)  # bits that spill over
    onehot = mx.arange(bits)[:, None] == word[None]  # bits, 32
    spill_hot = (mx.arange(bits)[:, None] == next_word[None]) & (next_shift[None] > 0)
    # Bits never overlap, so a sum is an OR.
    words = (mx.where(onehot, low[..., None, :], 0) + mx.where(spill_hot, high[..., None, :], 0)).sum(axis=-1)
    return words.astype(mx.uint32).reshape(*lead, D * bits // WORD)


def unpack_codes(words: mx.array, bits: int) -> mx.array:
    """Inverse of :func:`pack_codes`: ``(..., D * bits // 32)`` ``uint32`` → ``(..., D)`` ``uint32`` codes."""
    *lead, W = words.shape
    word, shift, next_word, next_shift = _layout(bits)
    w = words.reshape(*lead, W // bits, bits)  # ..., D/32, bits
    low = mx.take(w, word, axis=-1) >> shift
    high = mx.where(next_shift > 0, mx.take(w, next_word, axis=-1) << next_shift, 0)
    return ((low | high) & ((1 << bits) - 1)).reshape(*lead, W // bits * WORD)


def channel_quantize(x: mx.array, bits: int, group: int) -> tuple[mx.array, mx.array, mx.array]:
    """Quantize ``(B, H, n·G, D)`` keys per channel over each group of ``G`` tokens, with ``mx.quantize``'s rule.

    Returns:
        ``(packed, scales, biases)``: packed codes ``(B, H, n·G, D·bits/32)`` per token row, and
        ``(B, H, n, D)`` scales and biases per (group, channel).
    """
    B, H, N, D = x.shape
    n = N // group
    channels = x.reshape(B, H, n, group, D).swapaxes(-1, -2)  # B, H, n, D, G
    packed, scales, biases = mx.quantize(channels, group_size=group, bits=bits)  # scales: B, H, n, D, 1
    # mx.quantize packs each row's codes LSB first, as pack_codes does: unpack along tokens, repack along channels.
    codes = unpack_codes(packed, bits).swapaxes(-1, -2).reshape(B, H, N, D)
    return pack_codes(codes, bits), scales[..., 0], biases[..., 0]


def channel_dequantize(packed: mx.array, rows: mx.array, scales: mx.array, biases: mx.array, bits: int) -> mx.array:
    """``(B, H, N, D)`` keys from packed codes ``(B, H, N, ·)``, their rows ``(B, H, N)`` and the table's
    ``(B, H, T, D)`` scales and biases."""
    idx = rows.astype(mx.int32)[..., None]  # B, H, N, 1
    s = mx.take_along_axis(scales, idx, axis=2)  # B, H, N, D
    b = mx.take_along_axis(biases, idx, axis=2)
    return unpack_codes(packed, bits).astype(scales.dtype) * s + b
