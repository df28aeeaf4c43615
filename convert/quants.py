"""GGUF tensor bytes -> MLX arrays, keeping Q4_0/Q4_1/Q8_0 blocks quantized in MLX's affine format.

GGUF's Q4_0, Q4_1 and Q8_0 are affine quantizations with 32 values per group, the
same shape as MLX's ``mx.quantize(..., group_size=32, mode="affine")``, so they are
repacked losslessly: MLX stores ``w = scale * q + bias`` with the values of a group
packed little end first into uint32 words. Only the packing order and the bias differ:
  Q4_1: w = d * q + m,           q in 0..15, low nibbles hold values 0..15, high 16..31
  Q4_0: w = d * (q - 8),         same nibble layout      -> bias = -8 d
  Q8_0: w = d * q,               q int8 in -128..127      -> q + 128, bias = -128 d
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxevict.errors import MlxEvictError

GROUP_SIZE = 32
BITS: dict[str, int] = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}


@dataclass(frozen=True)
class MlxTensor:
    """A tensor ready for safetensors: plain, or MLX-quantized with its scales and biases.

    Attributes:
        weight: the plain array, or the packed uint32 array of shape ``(..., cols * bits / 32)``.
        scales: float16, shape ``(..., cols / 32)``; None when not quantized.
        biases: float16, same shape as ``scales``; None when not quantized.
        bits: 4 or 8 when quantized, else None.
    """

    weight: mx.array
    scales: mx.array | None = None
    biases: mx.array | None = None
    bits: int | None = None

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def dequantize(self, dtype: mx.Dtype) -> mx.array:
        """The full-precision values in ``dtype``; scales are widened first so float32 loses nothing."""
        if not self.quantized:
            return self.weight.astype(dtype)
        return mx.dequantize(
            self.weight,
            self.scales.astype(mx.float32),
            self.biases.astype(mx.float32),
            group_size=GROUP_SIZE,
            bits=self.bits,
        ).astype(dtype)


def to_mlx(raw: np.ndarray, shape: tuple[int, ...], type_name: str) -> MlxTensor:
    """Decode one GGUF tensor.

    Args:
        raw: the tensor's bytes (uint8, 1-D), e.g. from ``GGUFFile.read_tensor_bytes``.
        shape: numpy-order shape; quantized groups run along the last axis.
        type_name: one of ``F32, F16, BF16, Q4_0, Q4_1, Q8_0``.

    Returns:
        An MlxTensor; quantized types stay quantized (float16 scales and biases).
    """
    if type_name == "F32":
        return MlxTensor(mx.array(raw.view(np.float32).reshape(shape)))
    if type_name == "F16":
        return MlxTensor(mx.array(raw.view(np.float16).reshape(shape)))
    if type_name == "BF16":
        # numpy has no bfloat16: carry the bits as uint16 and reinterpret in MLX.
        return MlxTensor(mx.array(raw.view(np.uint16).reshape(shape)).view(mx.bfloat16))
    if type_name not in BITS:
        raise MlxEvictError(f"tensor type {type_name} cannot be decoded; supported: F32, F16, BF16, {', '.join(BITS)}")
    if shape[-1] % GROUP_SIZE:
        raise MlxEvictError(f"a {type_name} tensor of shape {shape} has rows not divisible by {GROUP_SIZE}")
    bits = BITS[type_name]
    blocks = raw.reshape(-1, 2 + GROUP_SIZE * bits // 8 + (2 if type_name == "Q4_1" else 0))
    scales = blocks[:, 0:2].copy().view(np.float16)  # (n_blocks, 1)
    if type_name == "Q8_0":
        q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # (n_blocks, 32)
        packed = q
        biases = scales * np.float16(-128)
    else:
        start = 4 if type_name == "Q4_1" else 2
        nibbles = blocks[:, start:]  # (n_blocks, 16)
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)  # (n_blocks, 32), values in order
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)  # two values per byte, low first
        biases = blocks[:, 2:4].copy().view(np.float16) if type_name == "Q4_1" else scales * np.float16(-8)
    rows = shape[:-1]
    return MlxTensor(
        weight=mx.array(np.ascontiguousarray(packed).view(np.uint32).reshape(*rows, -1)),
        scales=mx.array(scales.reshape(*rows, -1)),
        biases=mx.array(biases.reshape(*rows, -1)),
        bits=bits,
    )
