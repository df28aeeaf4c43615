"""A fixed orthogonal rotation that spreads outlier channels before quantizing (QuaRot).

Below 8 bits, keys and values are stored rotated by ``R`` (a Hadamard matrix with
random signs; QuaRot, https://arxiv.org/abs/2404.00456): ``(qR)·(kR) = q·k``, so
attention only rotates the queries in and the output back, while the rotation
spreads the few large key channels that make per-token 4-bit groups coarse.
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx


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


@lru_cache(maxsize=16)
def rotation_in(dim: int, dtype: mx.Dtype) -> mx.array:
    """:func:`rotation_matrix` in ``dtype``, computed once (a decode step reads it in every layer: a cast
    there would be one more graph node per layer and step)."""
    rotation = rotation_matrix(dim).astype(dtype)
    mx.eval(rotation)
    return rotation
