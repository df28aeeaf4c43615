"""GGUF tensor bytes -> MLX arrays, as MLX affine quantizations (group size 32) where the GGUF is quantized.

Three ways in, from exact to approximate:

* Repacked exactly. GGUF's Q4_0, Q4_1 and Q8_0 are affine with 32 values per group,
  the shape of ``mx.quantize(..., group_size=32, mode="affine")``: MLX stores
  ``w = scale * q + bias`` packed little end first into uint32 words, so only the
  packing order and the bias differ:
    Q4_1: w = d * q + m,           q in 0..15, low nibbles hold values 0..15, high 16..31
    Q4_0: w = d * (q - 8),         same nibble layout      -> bias = -8 d
    Q8_0: w = d * q,               q int8 in -128..127      -> q + 128, bias = -128 d
* Repacked from K-quant sub-blocks. Q4_K and Q5_K hold 256 values as 8 sub-blocks of 32,
  each ``w = (d * sc) * q - (dmin * m)`` with 6-bit ``sc``/``m``: an affine group of 32
  with scale ``d * sc`` and bias ``-dmin * m``. Q4_K becomes MLX 4-bit, Q5_K (q in 0..31)
  8-bit; the values are the same, only scale and bias are rounded to float16.
* Re-quantized. Every other type the ``gguf`` package can decode (Q6_K, Q2_K, Q3_K,
  Q5_0, Q5_1, the IQ and TQ types, MXFP4) is dequantized to float32 and quantized again
  with ``mx.quantize``: to 8 bits if the GGUF type spends more than 4.5 bits per
  weight, else to 4 bits (:data:`REQUANT_BITS`). docs/faults.md gives the measured error.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxevict.errors import MlxEvictError

GROUP_SIZE = 32
FLOAT_TYPES = ("F32", "F16", "BF16")
BITS: dict[str, int] = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}  # repacked exactly
KQUANT_BITS: dict[str, int] = {"Q4_K": 4, "Q5_K": 8}  # repacked from sub-blocks of 32
# Dequantized with the gguf package, then quantized again to this many bits.
REQUANT_BITS: dict[str, int] = {
    "Q6_K": 8, "Q5_0": 8, "Q5_1": 8,
    "Q2_K": 4, "Q3_K": 4, "IQ4_NL": 4, "IQ4_XS": 4, "IQ3_S": 4, "IQ3_XXS": 4, "IQ2_S": 4,
    "IQ2_XS": 4, "IQ2_XXS": 4, "IQ1_S": 4, "IQ1_M": 4, "TQ1_0": 4, "TQ2_0": 4, "MXFP4": 4,
}  # fmt: skip
QK_K = 256  # values per K-quant super-block
REQUANT_CHUNK = 1 << 22  # values dequantized at a time, so a large embedding never doubles in float32


def mlx_bits(type_name: str) -> int | None:
    """Bits of the MLX affine tensor a GGUF type becomes; None for float types."""
    return BITS.get(type_name) or KQUANT_BITS.get(type_name) or REQUANT_BITS.get(type_name)


def precision_note(type_name: str) -> str:
    """How much of a GGUF type's precision the conversion keeps, in a few words."""
    if type_name in FLOAT_TYPES:
        return "kept as stored"
    if type_name in BITS:
        return f"repacked exactly as MLX {BITS[type_name]}-bit affine (group {GROUP_SIZE})"
    if type_name in KQUANT_BITS:
        return (
            f"repacked as MLX {KQUANT_BITS[type_name]}-bit affine (group {GROUP_SIZE}): same values, "
            "scales rounded to float16"
        )
    bits = REQUANT_BITS[type_name]
    # Relative RMS error added, measured by scripts/measure_requant.py (docs/faults.md).
    added = "about 0.3-0.5%" if bits == 8 else "about 3-12%"
    return f"re-quantized to MLX {bits}-bit affine (group {GROUP_SIZE}): {added} RMS error added"


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
        type_name: a float type, or any type :func:`mlx_bits` knows.

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
    bits = mlx_bits(type_name)
    if bits is None:
        raise MlxEvictError(f"tensor type {type_name} cannot be decoded; supported: F32, F16, BF16, {', '.join(BITS)}")
    if shape[-1] % GROUP_SIZE:
        raise MlxEvictError(f"a {type_name} tensor of shape {shape} has rows not divisible by {GROUP_SIZE}")
    if type_name in BITS:
        q, scales, biases = _legacy_groups(raw, type_name)
    elif type_name in KQUANT_BITS:
        q, scales, biases = _kquant_groups(raw, type_name)
    else:
        return _requantize(raw, shape, type_name, bits)
    if bits == 4:
        q = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)  # two values per byte, low first
    rows = shape[:-1]
    return MlxTensor(
        weight=mx.array(np.ascontiguousarray(q, dtype=np.uint8).view(np.uint32).reshape(*rows, -1)),
        scales=mx.array(scales.astype(np.float16).reshape(*rows, -1)),
        biases=mx.array(biases.astype(np.float16).reshape(*rows, -1)),
        bits=bits,
    )


def _legacy_groups(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0/Q4_1/Q8_0 blocks -> (q ``(n, 32)`` uint8 in value order, scale ``(n, 1)``, bias ``(n, 1)``)."""
    bits = BITS[type_name]
    blocks = raw.reshape(-1, 2 + GROUP_SIZE * bits // 8 + (2 if type_name == "Q4_1" else 0))
    scales = blocks[:, 0:2].copy().view(np.float16)  # (n_blocks, 1)
    if type_name == "Q8_0":
        q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # (n_blocks, 32)
        return q, scales, scales * np.float16(-128)
    start = 4 if type_name == "Q4_1" else 2
    nibbles = blocks[:, start:]  # (n_blocks, 16)
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)  # (n_blocks, 32), values in order
    biases = blocks[:, 2:4].copy().view(np.float16) if type_name == "Q4_1" else scales * np.float16(-8)
    return q, scales, biases


def _kquant_groups(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks -> (q ``(n * 8, 32)``, scale ``(n * 8, 1)``, bias ``(n * 8, 1)``), float32."""
    from gguf.quants import Q4_K

    blocks = raw.reshape(-1, 144 if type_name == "Q4_K" else 176)
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # (n, 1)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # (n, 1)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])  # (n, 8) each, 6-bit
    if type_name == "Q4_K":
        qs, qh = blocks[:, 16:], None
    else:
        qh, qs = blocks[:, 16:48], blocks[:, 48:]
    # Sub-block 2i is the low nibbles of 32 bytes, sub-block 2i+1 their high nibbles.
    q = (qs.reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F  # (n, 4, 2, 32)
    q = q.reshape(n, 8, 32)
    if qh is not None:  # Q5_K: bit j of each qh byte is the fifth bit of sub-block j
        high = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 0x01  # (n, 8, 32)
        q = q | (high << 4)
    scales = (d * sc.astype(np.float32)).reshape(-1, 1)
    biases = -(dmin * m.astype(np.float32)).reshape(-1, 1)
    return q.reshape(-1, 32), scales, biases


def _requantize(raw: np.ndarray, shape: tuple[int, ...], type_name: str, bits: int) -> MlxTensor:
    """Dequantize with the gguf package and quantize again with ``mx.quantize``, a slice of rows at a time."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[type_name]
    cols = shape[-1]
    rows = raw.reshape(-1, raw.size // (int(np.prod(shape)) // cols))  # (rows, bytes per row)
    step = max(1, REQUANT_CHUNK // cols)
    parts: list[tuple[mx.array, ...]] = []
    for start in range(0, rows.shape[0], step):
        values = mx.array(dequantize(np.asarray(rows[start : start + step]), qtype))  # (step, cols) float32
        w, scales, biases = mx.quantize(values, group_size=GROUP_SIZE, bits=bits)
        parts.append((w, scales.astype(mx.float16), biases.astype(mx.float16)))
        mx.eval(parts[-1])
    w, scales, biases = (mx.concatenate(p, axis=0).reshape(*shape[:-1], -1) for p in zip(*parts))
    return MlxTensor(weight=w, scales=scales, biases=biases, bits=bits)
