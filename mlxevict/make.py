"""``make_cache``: the one call a user needs, mlx-lm's ``make_prompt_cache`` for eviction."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Sequence

import mlx.nn as nn

from .cache import DEFAULT_BUDGET, DEFAULT_SINKS, EvictingKVCache, default_window
from .channel_storage import ChannelStorage
from .tiered_storage import TieredStorage
from .model_patch import check_supported, patch
from .distributed import model_shard
from .kvstorage import DEFAULT_GROUP_SIZE, KVBits, KVStorage
from .paged_storage import DEFAULT_PAGES, ROTATE_SKETCH, PagedStorage
from .geometry import context_limit
from .plan import page_folder, paged_plan, plan_cache
from .quantized import QuantizedEvictingKVCache


def make_cache(
    model: nn.Module,
    policy: str = "default",
    budget: int | str = DEFAULT_BUDGET,
    *,
    sinks: int = DEFAULT_SINKS,
    window: int | None = None,
    slack: int | None = None,
    prompt_mode: str = "evict",
    pinned: Sequence[tuple[int, int]] = (),
    kv_bits: KVBits | None = None,
    kv_group_size: int = DEFAULT_GROUP_SIZE,
    full_precision_window: int | None = None,
    kv_rotate: bool | None = None,
    window_bits: int | None = None,
    key_group: int | None = None,
    low_bits: KVBits | None = None,
    eight_bit_layers: Sequence[int] | None = None,
    expected_tokens: int | None = None,
    page_dir: str | Path | bool | None = None,
    pages: int = DEFAULT_PAGES,
    **policy_kwargs: Any,
) -> list[EvictingKVCache]:
    """Patch ``model`` and build one :class:`EvictingKVCache` per layer.

    The result goes straight to mlx-lm: ``generate(model, tok, prompt,
    prompt_cache=make_cache(model, "entropy", 1024))``. Unlike
    ``make_prompt_cache(model, max_kv_size=...)``, this is not silently ignored
    for models (such as ``llama``) that define their own ``make_cache``.

    Args:
        model: an mlx-lm model of a supported architecture (llama, mistral, qwen2, qwen3).
        policy: registry name; see ``mlxevict.policy_names()``. Default ``"default"``.
        budget: most KV entries per layer (default 2048), or KV memory for all layers:
            ``"1.5GB"``, ``"800MB"``, or ``"auto"`` (a quarter of the free memory). Sized by
            :func:`~mlxevict.plan.plan_cache`, as the CLI sizes ``--budget``: at most the
            model's context (a larger one is capped there, with a warning; not with ``low_bits``,
            whose budget counts the bytes the tiers may hold); without
            ``kv_bits`` a memory budget picks the storage: the model's dtype, 8 bits or 5/3 bits
            when they hold the model's whole context, else (when it would evict) a page store
            (``page_dir``) from 12% of a 16-bit full cache of ``expected_tokens``, and under that
            precision tiers (see :func:`~mlxevict.plan.memory_storage`), the most quality per byte measured.
        sinks, window, slack, prompt_mode, pinned, policy_kwargs: see :class:`EvictingKVCache`.
        kv_bits: ``None`` (default) stores KV in the model's dtype (for a budget in
            tokens; see ``budget`` for one in memory); 8 or 4 store
            it quantized (:class:`~mlxevict.quantized.QuantizedEvictingKVCache`);
            a ``(key bits, value bits)`` pair such as ``(5, 3)`` stores them apart.
        kv_group_size: values per quantization scale: 32, 64 (default) or 128.
        full_precision_window: with ``kv_bits``, the newest tokens kept in the
            model's dtype. Default: ``min(32, budget // 8)``.
        kv_rotate: with ``kv_bits``, store keys and values rotated by a fixed
            orthogonal matrix (exact in attention, smaller 4-bit error).
            Default ``None``: when keys or values are under 8 bits. With ``page_dir``: the 2-bit copy
            of the evicted keys (:class:`~mlxevict.paged_storage.PagedStorage`'s ``rotate``).
        window_bits: with storage under 8 bits, 8 stores the recent window in 8 bits
            instead of the model's dtype. Default ``None``.
        key_group: with key bits under 8 and ``window_bits=8``, quantize keys per channel over
            this many tokens (32, 64 or 128; KIVI, :class:`~mlxevict.channel_storage.ChannelStorage`)
            instead of per token. Default ``None``.
        low_bits: with ``key_group``, precision tiers (:class:`~mlxevict.tiered_storage.TieredStorage`):
            the policy's lowest-ranked entries are demoted to these ``(key bits, value bits)`` (such as
            ``(3, 2)``) before any is evicted, and the budget counts entries at these bits. Default ``None``.
        eight_bit_layers: these layers store their entries in 8 bits, the others in ``kv_bits`` (under 8;
            the same budget in tokens, a memory budget counts their bytes): the layers low-bit storage hurts
            most, found by :func:`mlxevict.calibrate.calibrate` (``mlxevict calibrate``). Default ``None``:
            with ``kv_bits`` none; without it, when a budget in memory picks precision tiers, the model's
            calibration's layers (if it was calibrated) when the budget is at least 18% of a 16-bit full
            cache of ``expected_tokens``; ``()``: none.
        expected_tokens: the tokens the cache will see, prompt and answer (``None``: the model's context).
        page_dir: a folder (on a Mac: the SSD) to write evicted entries to, in the model's dtype, to be read
            back by page when the queries need them (:mod:`mlxevict.paged_storage`); a budget in memory then
            counts the entries held, a 2-bit sketch of every evicted key up to ``expected_tokens`` (7.8% of a
            16-bit entry each), and the pages read (:func:`~mlxevict.plan.paged_tokens`). Not with ``kv_bits``.
            Default ``None``: the memory rule's choice (:func:`~mlxevict.plan.rule_pages`): for a budget in memory
            without ``kv_bits`` that would evict, from 12% of a 16-bit full cache of ``expected_tokens``, the
            system's temp folder; else evicted entries are gone. ``False``: never a page store.
        pages: with a page store, pages of 16 entries read back per call and kv-head. Default 32.

    Returns:
        A list with one cache per layer.

    Raises:
        ValueError: unsupported architecture, unknown policy, a budget that cannot
            work, or a ``kv_bits``/``kv_group_size`` the model cannot use.
    """
    check_supported(model)  # before anything reads the model's geometry
    options: dict[str, Any] = dict(sinks=sinks, window=window, slack=slack, prompt_mode=prompt_mode, pinned=pinned)
    folder = page_folder(page_dir, model, budget, storage_asked=kv_bits is not None or bool(eight_bit_layers),
                         expected_tokens=expected_tokens, pages=pages)  # fmt: skip
    if folder is not None:
        caches = paged_caches(model, policy, budget, folder, pages, expected_tokens, kv_bits, kv_rotate, options,
                              policy_kwargs)  # fmt: skip
    else:
        caches = planned_caches(model, policy, budget, options, policy_kwargs, KVStorage.of(
            kv_bits, kv_group_size if kv_bits is not None else None, full_precision_window, window_bits, kv_rotate,
            key_group=key_group, low_bits=low_bits, eight_bit_layers=eight_bit_layers if kv_bits is not None else (),
        ), eight_bit_layers, expected_tokens)  # fmt: skip
    patch(model)
    shard = model_shard(model)  # a sharded model's caches hold its block of heads
    for cache in caches:
        cache.shard = shard
    return caches


def planned_caches(model: nn.Module, policy: str, budget: int | str, options: dict[str, Any],
                   policy_kwargs: dict[str, Any], given: KVStorage, eight_bit_layers: Sequence[int] | None,
                   expected_tokens: int | None) -> list[EvictingKVCache]:  # fmt: skip
    """``make_cache``'s caches without a page store: the storage asked for (``given``) or the planner's."""
    # Without kv_bits the planner chooses: the dtype for tokens, its memory rule for a budget in memory.
    plan = plan_cache(model, budget, given if given.quantized else None, eight_bit_layers=eight_bit_layers,
                      expected_tokens=expected_tokens)  # fmt: skip
    for note in plan.notes:
        warnings.warn(note, stacklevel=3)
    eight = plan.storage.eight_bit_layers
    beyond = [str(i) for i in eight if i >= len(model.layers)]
    if beyond:
        raise ValueError(f"no layer {', '.join(beyond)} to hold in 8 bits: the model has layers 0 to {len(model.layers) - 1}")
    layer_storage = {i: plan.storage.eight_bit if i in eight else plan.storage.uniform for i in range(len(model.layers))}
    return [layer_cache(policy, plan.tokens, layer_storage[i], options, policy_kwargs) for i in range(len(model.layers))]


def paged_caches(model: nn.Module, policy: str, budget: int | str, page_dir: str | Path, pages: int,
                 expected_tokens: int | None, kv_bits: KVBits | None, kv_rotate: bool | None,
                 options: dict[str, Any], policy_kwargs: dict[str, Any]) -> list[EvictingKVCache]:  # fmt: skip
    """``make_cache`` with a page store: entries held in the model's dtype, the evicted ones written to ``page_dir``."""
    if kv_bits is not None:
        raise ValueError("a paged cache holds its entries in the model's dtype: leave kv_bits out with page_dir")
    plan = paged_plan(model, budget, pages, expected_tokens)
    for note in plan.notes:
        warnings.warn(note, stacklevel=3)
    tokens, limit = plan.tokens, None
    if plan.request.tokens is None:  # a budget in memory holds the sketch of the tokens expected, and no more
        limit = max(0, (expected_tokens or context_limit(model)) - tokens)
    rotate = ROTATE_SKETCH if kv_rotate is None else kv_rotate
    return [EvictingKVCache(policy, tokens, storage=PagedStorage(page_dir, pages, sketch_limit=limit, rotate=rotate),
                            **options, **policy_kwargs) for _ in model.layers]  # fmt: skip


def layer_cache(policy: str, budget: int, storage: KVStorage, options: dict[str, Any],
                policy_kwargs: dict[str, Any]) -> EvictingKVCache:  # fmt: skip
    """One layer's cache of ``budget`` entries in ``storage`` (one without :attr:`~KVStorage.eight_bit_layers`)."""
    if storage.key_group:
        return EvictingKVCache(policy, budget, storage=channel_storage(storage, budget), **options, **policy_kwargs)
    cls = QuantizedEvictingKVCache if storage.quantized else EvictingKVCache
    return cls(policy, budget, **options, **storage.options(), **policy_kwargs)


def channel_storage(storage: KVStorage, budget: int) -> ChannelStorage:
    """A fresh :class:`ChannelStorage` for ``storage`` (keys per channel) and a cache of ``budget`` entries
    (:class:`TieredStorage` with ``low_bits``)."""
    window = default_window(budget) if storage.full_precision_window is None else storage.full_precision_window
    s = storage
    if s.low_bits:
        return TieredStorage(s.kv_bits, s.low_bits, budget, s.group_size, window, s.key_group, s.rotate, s.window_bits)
    return ChannelStorage(s.kv_bits, s.group_size, window, s.key_group, s.rotate, s.window_bits)


def pin(caches: Sequence[EvictingKVCache], start: int, end: int) -> None:
    """Keep absolute positions ``[start, end)`` in every layer from now on."""
    for cache in caches:
        cache.pin(start, end)
