"""mlx-lm's ``QuantizedKVCache`` baselines on the CPU: prompt chunks through a dense matmul.

MLX's CPU quantized matmul does not use BLAS: in the long suite's default run
``quantized4``'s row took 454 of 2,219 s (docs/results/long). mlxevict's own quantized
storage already dequantizes a chunk of several queries first on the CPU
(:func:`mlxevict.quantized_attention.quantized_attention`); :func:`dense_prompt_chunks`
gives mlx-lm's baselines the same treatment for the length of a quality run, so both
kinds of quantized storage are read the same way. One query (decoding), and any call on
the GPU, still go to mlx-lm's own function unchanged.

Per call the result is mlx-lm's within float rounding (tests/test_baseline_attention.py);
over a model, a rounding difference in a new key can flip its 4-bit code, and that is
carried forward: in the default run (docs/results/long/README.md) the ``quantized4`` row's
KL moved 3% and three of its eight facts changed sides. Speed benchmarks do not use this:
it is for runs that measure quality only.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx
import mlx_lm.models.base as mlx_lm_base

from mlxevict.quantized_attention import quantized_attention


def _dense_chunks(original):
    def attention(queries, q_keys, q_values, scale, mask, group_size=64, bits=8):
        if queries.shape[-2] == 1 or mx.default_device() != mx.cpu:
            return original(queries, q_keys, q_values, scale=scale, mask=mask, group_size=group_size, bits=bits)
        b, heads, _, dim = q_keys[0].shape
        none = mx.zeros((b, heads, 0, dim * 32 // bits), queries.dtype)  # no window after the quantized entries
        return quantized_attention(queries, (q_keys, none), (q_values, none), scale, mask, group_size, bits)

    return attention


@contextmanager
def dense_prompt_chunks() -> Iterator[None]:
    """For the block, mlx-lm's quantized attention reads a chunk of queries on the CPU dequantized."""
    original = mlx_lm_base.quantized_scaled_dot_product_attention
    mlx_lm_base.quantized_scaled_dot_product_attention = _dense_chunks(original)
    try:
        yield
    finally:
        mlx_lm_base.quantized_scaled_dot_product_attention = original
