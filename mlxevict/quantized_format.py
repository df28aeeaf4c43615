"""What quantized KV storage can hold: bits, group sizes, bytes per vector, checked in one place.

``mx.quantize`` packs each group of ``kv_group_size`` values into ``bits`` bits per
value plus a scale and a bias (model dtype), as mlx-lm's ``QuantizedKVCache``
stores them. Keys and values may take different bits (``kv_bits=(5, 3)``: the
bytes of 4 bits): on the test model the error of 4-bit storage comes from the keys.
"""

from __future__ import annotations

from typing import Any, Optional, Union

KV_BITS = (8, 4)
PAIR_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize supports, for a (key bits, value bits) pair
KVBits = Union[int, tuple[int, int]]
SPLIT_BITS = (5, 3)  # keys finer than values, at the bytes of 4 bits: the keys carry the error (README)
GROUP_SIZES = (32, 64, 128)  # what mx.quantize supports
DEFAULT_GROUP_SIZE = 64  # mlx-lm's --kv-group-size default


def check_storage(
    kv_bits: Any, group_size: Any, head_dims: tuple[int, ...] = (), window_bits: Any = None
) -> None:
    """Raise a ``ValueError`` naming the bad value and the fix.

    Args:
        kv_bits: 8 or 4, or a ``(key bits, value bits)`` pair of 2, 3, 4, 5, 6 or 8.
        group_size: 32, 64 or 128, dividing every head dim.
        head_dims: the key and value head dims, when known.
        window_bits: ``None`` or 8 (when keys and values are both under 8 bits).
    """
    if not _supported_bits(kv_bits):
        raise ValueError(
            f"kv_bits={kv_bits!r} is not supported; use 8 or 4, a (key bits, value bits) pair of "
            f"{', '.join(map(str, PAIR_BITS))} such as (5, 3), or None to store the model's dtype"
        )
    if window_bits is not None and (window_bits not in KV_BITS or window_bits <= max(key_value_bits(kv_bits))):
        raise ValueError(
            f"window_bits={window_bits!r} with kv_bits={kv_bits}: the recent window is stored in 8 bits under "
            "storage below 8 bits, or in the model's dtype (window_bits=None)"
        )
    if group_size not in GROUP_SIZES or isinstance(group_size, bool):
        raise ValueError(f"kv_group_size={group_size!r} is not supported by mx.quantize; use 32, 64 or 128")
    for dim in head_dims:
        if dim % group_size:
            fits = [str(g) for g in GROUP_SIZES if dim % g == 0]
            fix = f"use --kv-group-size {' or '.join(fits)}" if fits else "store this model's KV unquantized"
            raise ValueError(f"kv_group_size={group_size} does not divide the head dim {dim}; {fix}")


def _supported_bits(kv_bits: Any) -> bool:
    if isinstance(kv_bits, (tuple, list)):
        return len(kv_bits) == 2 and all(b in PAIR_BITS and not isinstance(b, bool) for b in kv_bits)
    return kv_bits in KV_BITS and not isinstance(kv_bits, bool)


def key_value_bits(kv_bits: KVBits) -> tuple[int, int]:
    """``(key bits, value bits)`` of ``kv_bits`` (one number means both)."""
    return (kv_bits, kv_bits) if isinstance(kv_bits, int) else (int(kv_bits[0]), int(kv_bits[1]))


def bits_label(kv_bits: KVBits) -> str:
    """``"4-bit"``, or ``"5/3-bit"`` for keys in 5 and values in 3."""
    key_bits, value_bits = key_value_bits(kv_bits)
    return f"{key_bits}-bit" if key_bits == value_bits else f"{key_bits}/{value_bits}-bit"


def model_head_dim(model: Any) -> int:
    """The attention head dim of an mlx-lm model, from its ``ModelArgs``."""
    args = model.args
    return getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads


def storage_bytes(
    dim: int, dtype_size: int, bits: Optional[int] = None, group_size: int = DEFAULT_GROUP_SIZE
) -> int:
    """Bytes one stored key (or value) vector of ``dim`` elements takes.

    Model dtype: ``dim × dtype_size``; quantized: ``dim × bits / 8`` plus a scale
    and a bias (model dtype) per group.
    """
    if bits is None:
        return dim * dtype_size
    return dim * bits // 8 + 2 * (dim // group_size) * dtype_size
