"""``QuantizedEvictingKVCache``: the evicting cache with quantized storage, by its name of 0.1.

It evicts exactly like :class:`~mlxevict.cache.EvictingKVCache` (it *is* one, with a
:class:`~mlxevict.quantized_storage.QuantizedStorage` component); the class keeps the
constructor arguments and the name that saved caches and mlx-lm's ``load_prompt_cache``
know. The parts live apart: what can be stored (:mod:`mlxevict.kvstorage`), the
rotation (:mod:`mlxevict.rotation`), attention over quantized entries
(:mod:`mlxevict.quantized_attention`) and the storage (:mod:`mlxevict.quantized_storage`);
their names are importable from here as before.
"""

from __future__ import annotations

from typing import Any, Optional

from .cache import DEFAULT_BUDGET, EvictingKVCache
from .policies import Policy
from .quantized_attention import Entries, quantized_attention
from .geometry import model_head_dim
from .kvstorage import (
    DEFAULT_GROUP_SIZE,
    GROUP_SIZES,
    KV_BITS,
    PAIR_BITS,
    SPLIT_BITS,
    KVBits,
    bits_label,
    check,
    key_value_bits,
    storage_bytes,
)
from .quantized_storage import QuantizedStorage
from .room import check_budget, full_window
from .rotation import rotation_matrix

__all__ = [
    "QuantizedEvictingKVCache",
    "QuantizedStorage",
    "quantized_attention",
    "rotation_matrix",
    "key_value_bits",
    "bits_label",
    "model_head_dim",
    "storage_bytes",
    "Entries",
    "KVBits",
    "KV_BITS",
    "PAIR_BITS",
    "SPLIT_BITS",
    "GROUP_SIZES",
    "DEFAULT_GROUP_SIZE",
]



class QuantizedEvictingKVCache(EvictingKVCache):
    """An :class:`EvictingKVCache` that stores its entries in 8 or 4 bits (or keys and values apart).

    Build it with ``make_cache(model, policy, budget, kv_bits=8)``, which also
    patches the model: attention over this storage needs the patched attention.

    Args:
        policy, budget, sinks, window, slack, prompt_mode, pinned, policy_kwargs:
            see :class:`EvictingKVCache`.
        kv_bits: 8 or 4, or ``(key bits, value bits)`` such as ``(5, 3)``. Default 8.
        kv_group_size: values per scale and bias: 32, 64 or 128, dividing the
            head dim. Default 64 (mlx-lm's).
        full_precision_window: the newest tokens kept in the model's dtype
            (never evicted while there). Default ``min(32, budget // 8)`` (the
            cache's usual recent window, whatever the policy's); 0 quantizes every
            token at once, as mlx-lm's ``QuantizedKVCache`` does.
        kv_rotate: store keys and values rotated by :func:`rotation_matrix`
            (exact in attention, smaller 4-bit error). Default ``None``: rotate
            when keys or values are under 8 bits.
        window_bits: ``None`` (default) keeps the recent window in the model's
            dtype; 8 (with storage under 8 bits) stores it in 8 bits, which on the test
            model costs it almost nothing in quality for half its bytes.
    """

    def __init__(
        self,
        policy: str | Policy = "default",
        budget: int = DEFAULT_BUDGET,
        *,
        kv_bits: KVBits = 8,
        kv_group_size: int = DEFAULT_GROUP_SIZE,
        full_precision_window: Optional[int] = None,
        kv_rotate: Optional[bool] = None,
        window_bits: Optional[int] = None,
        **kwargs: Any,
    ):
        check(kv_bits, kv_group_size, window_bits=window_bits)
        check_budget(budget)
        full = full_window(budget, full_precision_window)
        storage = QuantizedStorage(kv_bits, kv_group_size, full, kv_rotate, window_bits)
        super().__init__(policy, budget, storage=storage, **kwargs)
