"""Per-channel key codes: ``mx.quantize``'s codes, bit-packed per token row in bit planes, and their dequantization.

:mod:`mlxevict.channel_storage` quantizes a group of keys per channel with
``mx.quantize`` (along the tokens) and stores each token's codes as one row
(along the channels), so a slot moves alone when the cache compacts.

``mx.quantize`` packs codes least significant bit first into ``uint32`` words
(:func:`unpack_codes` reads that layout; ``tests/test_channel_storage.py`` checks it
for 2, 3, 4, 5, 6 and 8 bits). A 5-bit code then straddles words, and unpacking it
takes gathers: 0.25 ms for a layer's 192 slots on the CPU, more than the decode step of
mlx-lm's 4-bit cache. So a row is stored in **bit planes** instead (:func:`pack_planes`):
the codes' low 4 bits, 8 per word, then their next 2 bits, 16 per word, then 1 bit, 32 per
word, as far as ``bits`` needs (5 = 4 + 1, 3 = 2 + 1, 6 = 4 + 2); the same words per row,
and :func:`unpack_planes` is shifts and masks only (0.07 ms). The values, quantized per
token by ``mx.quantize``, are stored in bit planes too (:func:`token_dequantize`): dequantized
and multiplied in one compiled kernel they cost less than ``mx.quantized_matmul`` at 3 bits
(0.10 against 0.16 ms), with the same numbers as ``mx.dequantize``.
"""

from __future__ import annotations

from functools import lru_cache

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


def unpack_codes(words: mx.array, bits: int) -> mx.array:
    """``mx.quantize``'s words ``(..., D * bits // 32)`` ``uint32`` (codes LSB first) → ``(..., D)`` codes."""
    *lead, W = words.shape
    word, shift, next_word, next_shift = _layout(bits)
    w = words.reshape(*lead, W // bits, bits)  # ..., D/32, bits
    low = mx.take(w, word, axis=-1) >> shift
    high = mx.where(next_shift > 0, mx.take(w, next_word, axis=-1) << next_shift, 0)
    return ((low | high) & ((1 << bits) - 1)).reshape(*lead, W // bits * WORD)


def plane_widths(bits: int) -> list[int]:
    """The bit planes of a ``bits``-bit code, low bits first: 5 → ``[4, 1]``, 6 → ``[4, 2]``, 3 → ``[2, 1]``."""
    return [w for w in (4, 2, 1) if bits & w]


def pack_planes(codes: mx.array, bits: int) -> mx.array:
    """``(..., D)`` integer codes below ``2**bits`` → ``(..., D * bits // 32)`` ``uint32`` bit planes
    (``D % 32 == 0``)."""
    *lead, D = codes.shape
    codes, planes, low = codes.astype(mx.uint32), [], 0
    for w in plane_widths(bits):
        per = WORD // w  # codes per word
        part = ((codes >> low) & ((1 << w) - 1)).reshape(*lead, D // per, per)
        # Bits never overlap, so a sum is an OR.
        planes.append((part << mx.arange(0, WORD, w, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32))
        low += w
    return mx.concatenate(planes, axis=-1)


@lru_cache(maxsize=None)
def _plane_shifts(width: int) -> mx.array:
    """``[0, width, 2·width, ...]`` below 32: each code's shift in a word of its plane (built once, so a compiled
    kernel reads it as a constant instead of computing an ``arange`` at every call)."""
    return mx.array(np.arange(0, WORD, width, dtype=np.uint32))  # from host memory: nothing to evaluate


def unpack_planes(words: mx.array, bits: int) -> mx.array:
    """Inverse of :func:`pack_planes`: ``(..., D * bits // 32)`` ``uint32`` → ``(..., D)`` ``uint32`` codes."""
    *lead, W = words.shape
    D, codes, low, first = W * WORD // bits, None, 0, 0
    for w in plane_widths(bits):
        n = D * w // WORD  # words of this plane
        part = (words[..., first : first + n].reshape(*lead, n, 1) >> _plane_shifts(w)) & ((1 << w) - 1)
        part = part.reshape(*lead, D)
        if low:
            part = part << low
        codes = part if codes is None else codes | part
        low, first = low + w, first + n
    return codes


def planes_of(words: mx.array, bits: int) -> mx.array:
    """``mx.quantize``'s words ``(..., D·bits/32)`` (codes along the last axis) → the same codes in bit planes."""
    return pack_planes(unpack_codes(words, bits), bits)


def channel_quantize(x: mx.array, bits: int, group: int) -> tuple[mx.array, mx.array, mx.array]:
    """Quantize ``(B, H, n·G, D)`` keys per channel over each group of ``G`` tokens, with ``mx.quantize``'s rule.

    Returns:
        ``(planes, scales, biases)``: codes ``(B, H, n·G, D·bits/32)`` per token row (:func:`pack_planes`), and
        ``(B, H, n, D)`` scales and biases per (group, channel).
    """
    B, H, N, D = x.shape
    n = N // group
    channels = x.reshape(B, H, n, group, D).swapaxes(-1, -2)  # B, H, n, D, G
    packed, scales, biases = mx.quantize(channels, group_size=group, bits=bits)  # scales: B, H, n, D, 1
    # Unpack mx.quantize's words along the tokens, repack the codes along the channels.
    codes = unpack_codes(packed, bits).swapaxes(-1, -2).reshape(B, H, N, D)
    return pack_planes(codes, bits), scales[..., 0], biases[..., 0]


def token_dequantize(words: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> mx.array:
    """``mx.dequantize`` of per-token codes stored in bit planes: ``(..., D·bits/32)`` words and
    ``(..., D/group_size)`` scales and biases → ``(..., D)``."""
    return _scaled(unpack_planes(words, bits).astype(scales.dtype), scales, biases, group_size)


def _scaled(codes: mx.array, scales: mx.array, biases: mx.array, group_size: int) -> mx.array:
    """``(..., D)`` codes times their ``(..., D/group_size)`` scales plus biases, group by group."""
    if scales.shape[-1] == 1:  # one group per row: the scales broadcast as they are
        return codes * scales + biases
    *lead, D = codes.shape
    groups = codes.reshape(*lead, D // group_size, group_size)
    return (groups * scales[..., None] + biases[..., None]).reshape(*lead, D)


@lru_cache(maxsize=64)
def _head_offsets(B: int, H: int, T: int) -> mx.array:
    """``(B, H, 1)``: where each head's rows start in a ``(B, H, T, ·)`` table flattened over ``(B, H, T)``."""
    # From host memory: an mx.eval here would wait for the whole step queued before it.
    return mx.array((np.arange(B * H, dtype=np.int32) * T).reshape(B, H, 1))


def held_dequantize(words: mx.array, scales: mx.array, biases: mx.array, group_size: int) -> mx.array:
    """``mx.dequantize`` of ``mx.quantize``'s 8-bit triples (the held rows), the same numbers in fewer graph nodes:
    on the CPU ``mx.dequantize`` is some thirty small operations."""
    *lead, W = words.shape
    codes = ((words.reshape(*lead, W, 1) >> _plane_shifts(8)) & 255).reshape(*lead, 4 * W)
    return _scaled(codes.astype(scales.dtype), scales, biases, group_size)


def table_index(rows: mx.array, T: int) -> mx.array:
    """``(B, H, N)`` rows of a ``(B, H, T, ·)`` table → ``(B·H·N,)`` int32 rows of that table flattened over
    ``(B, H, T)``, for ``mx.take`` and scatters."""
    B, H, _ = rows.shape
    return (rows.astype(mx.int32) + _head_offsets(B, H, T)).reshape(-1)


def channel_dequantize(packed: mx.array, rows: mx.array, scales: mx.array, biases: mx.array, bits: int) -> mx.array:
    """``(B, H, N, D)`` keys from bit-plane codes ``(B, H, N, ·)``, their rows ``(B, H, N)`` and the table's
    ``(B, H, T, D)`` scales and biases.

    Each slot's scale and bias rows are picked by ``mx.take`` from the table flattened over
    ``(B, H, T)``: on the CPU, compiled, 0.18 ms for 224 slots of 3 heads and 1.0 ms for 2,000,
    where ``take_along_axis`` took 0.40 and 2.4 (a one-hot matmul over the rows, 0.19 and 13)."""
    T, D = scales.shape[2:]
    flat = table_index(rows, T)
    s = mx.take(scales.reshape(-1, D), flat, axis=0).reshape(*rows.shape, D)  # B, H, N, D
    b = mx.take(biases.reshape(-1, D), flat, axis=0).reshape(*rows.shape, D)
    return unpack_planes(packed, bits).astype(scales.dtype) * s + b


# Compiled twins for the decode step, whose shapes change only when a group completes or the cache compacts
# (a kernel over the held rows too would retrace at every step: slower than none, measured).
channel_dequantize_compiled = mx.compile(channel_dequantize)
token_dequantize_compiled = mx.compile(token_dequantize)
held_dequantize_compiled = mx.compile(held_dequantize)
