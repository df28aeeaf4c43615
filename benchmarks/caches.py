"""The caches under test, by name: every mlxevict policy and mlx-lm's own caches.

mlx-lm's baselines go by these names:

- ``kvcache``: ``KVCache``, the full cache and the reference for quality and speed;
- ``rotating``: ``RotatingKVCache(max_size=budget, keep=sinks)``, mlx-lm's ``--max-kv-size``;
- ``quantized8`` / ``quantized4`` / ``quantized3``: ``QuantizedKVCache(group_size=64, bits=8|4|3)``,
  mlx-lm's ``--kv-bits``; they keep every token, so they take no budget (3 bits is the one that fits
  in a quarter of a 16-bit cache's memory).

Everything else is an mlxevict policy name (``mlxevict.policy_names()``); a policy name
with ``:q8`` or ``:q4`` (``default:q8``) stores what it keeps in 8 or 4 bits; ``:q4w8`` stores
it in 4 bits with the recent window in 8 bits instead of full precision, ``:k5v3w8`` the same
with keys in 5 bits and values in 3 (``make_cache(..., kv_bits=8)``, group size 64, full-precision
window min(32, budget // 8)).
"""

from __future__ import annotations

import gc
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

import mlxevict
from mlxevict.budget import BudgetRequest
from mlxevict.cache import DEFAULT_BUDGET, DEFAULT_SINKS
from mlxevict.errors import MlxEvictError
from mlxevict.geometry import kv_shape, model_head_dim
from mlxevict.kvstorage import KVStorage
from mlxevict.plan import paged_tokens, protected_room

from .paged import is_paged, make_paged

DISK = re.compile(r"disk-(\d+)([ru]?)(m?)")  # the product's paged cache (mlxevict.paged_storage), K pages read back a call


def disk_pages(name: str) -> int | None:
    """``disk-K``: the product's paged cache reading back K pages a call (``disk-Kr``: its sketch rotated,
    ``disk-Ku``: not; ``disk-K``: the product's default); ``None`` for any other name."""
    match = DISK.fullmatch(name)
    return int(match.group(1)) if match else None


def disk_score(name: str) -> str:
    """A ``disk-K`` name's page score: ``disk-Km`` (``disk-Krm``...) scores a page by its best sketched key
    (:data:`mlxevict.paged_storage.PAGE_SCORES`), the others by the mass of its keys (the product's)."""
    return "max" if DISK.fullmatch(name).group(3) else "logsumexp"


def disk_rotate(name: str) -> bool | None:
    """A ``disk-K`` name's sketch rotation: ``True`` (``r``), ``False`` (``u``) or ``None`` (the default)."""
    return {"r": True, "u": False}.get(DISK.fullmatch(name).group(2))

REFERENCE = "kvcache"
QUANTIZED_BASELINES = {"quantized8": 8, "quantized4": 4, "quantized3": 3}  # name: bits
MLX_LM_CACHES = ("kvcache", "rotating", *QUANTIZED_BASELINES)
UNBUDGETED = ("kvcache", *QUANTIZED_BASELINES, "full")
QUANT_GROUP = 64


@dataclass(frozen=True)
class CacheSettings:
    """Settings shared by every cache of a run (mlxevict's ``make_cache`` arguments).

    ``window`` and ``slack`` of ``None`` take mlxevict's budget-scaled defaults.
    """

    sinks: int = DEFAULT_SINKS
    window: int | None = None
    slack: int | None = None

    def protected(self, budget: int, policy: str = "default") -> int:
        """Entries a budget must exceed: sinks + window + slack at this budget for ``policy``."""
        return protected_room(budget, policy, sinks=self.sinks, window=self.window, slack=self.slack)


def cache_names() -> list[str]:
    """Every name :func:`make_caches` accepts: mlx-lm's caches, then mlxevict's policies."""
    return [*MLX_LM_CACHES, *mlxevict.policy_names()]


def default_names(storage: bool = False) -> list[str]:
    """What a run compares unless told otherwise: all, except ``default`` (an alias).

    Args:
        storage: also the default policy in each storage mode (``anchored:q8``,
            ``anchored:q4``, ``anchored:q4w8``), by its own name so it shares a family with its row.
    """
    names = [n for n in cache_names() if n != "default"]
    if storage:
        names += [f"{mlxevict.DEFAULT_POLICY}{suffix}" for suffix in STORAGE_SUFFIXES]
    return names


def parse_names(text: str | None, storage: bool = False) -> list[str]:
    """``"rkv,window"`` → names, checked; ``None`` or ``"all"`` → :func:`default_names`.

    The reference ``kvcache`` is always included (every ratio needs it).

    Args:
        text: comma-separated names, ``"all"`` or ``None``.
        storage: ``"all"`` includes the default policy's storage modes (``mlxevict eval``).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if not text or text == "all":
        return default_names(storage)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if not _known(n)]
    if unknown:
        suffix_error(unknown[0])
        raise MlxEvictError(
            f"unknown cache or policy {', '.join(unknown)}; choose from: {', '.join(cache_names())} "
            "(a policy with :q8 or :q4 stores its KV in 8 or 4 bits, :q4w8 in 4 bits with an 8-bit recent window, "
            ":k5v3w8 keys in 5 bits and values in 3 with an 8-bit recent window)"
        )
    return [REFERENCE, *[n for n in dict.fromkeys(names) if n != REFERENCE]]


def takes_budget(name: str) -> bool:
    return split_storage(name)[0] not in UNBUDGETED


def check_budget(name: str, budget: int, settings: CacheSettings) -> str | None:
    """Why ``budget`` cannot run for ``name`` (one line), or ``None`` when it can."""
    if not takes_budget(name):
        return None
    policy = "default" if is_paged(name) or disk_pages(name) is not None else split_storage(name)[0]
    floor = settings.sinks + 1 if name == "rotating" else settings.protected(budget, policy) + 1
    if budget < floor:
        return (
            f"{name}: budget {budget} is below {floor} (sinks + window + slack + 1); "
            "raise --context or the budget fraction, or lower --window/--slack"
        )
    return None


def make_caches(model: nn.Module, name: str, budget: int | None, settings: CacheSettings) -> list[Any]:
    """One cache per layer of ``model`` for the cache or policy ``name``.

    Args:
        model: an mlx-lm model (patched by ``mlxevict.make_cache`` when ``name`` is a policy).
        name: a name from :func:`cache_names`.
        budget: entries per layer for budgeted caches; ignored by the others.
        settings: sinks, window and slack.
    """
    layers = len(model.layers)
    if name == "kvcache":
        return [KVCache() for _ in range(layers)]
    if name == "rotating":
        return [RotatingKVCache(max_size=budget, keep=settings.sinks) for _ in range(layers)]
    if name in QUANTIZED_BASELINES:
        head_dim = model_head_dim(model)
        if head_dim % QUANT_GROUP:
            raise ValueError(
                f"{name}: head_dim {head_dim} is not a multiple of mlx-lm's group size {QUANT_GROUP}; "
                "leave the quantized caches out of --policies for this model"
            )
        return [QuantizedKVCache(group_size=QUANT_GROUP, bits=QUANTIZED_BASELINES[name]) for _ in range(layers)]
    if is_paged(name):
        return make_paged(model, name, budget, sinks=settings.sinks, window=settings.window, slack=settings.slack)
    if disk_pages(name) is not None:
        caches = mlxevict.make_cache(model, "default", budget, page_dir=tempfile.gettempdir(), pages=disk_pages(name),
                                     kv_rotate=disk_rotate(name), sinks=settings.sinks, window=settings.window,
                                     slack=settings.slack)  # fmt: skip
        for cache in caches:  # a variant's page score (the product's is the default)
            cache.storage.page_score = disk_score(name)
        return caches
    # "full" never evicts: its budget is never reached, any valid number will do.
    size = budget if takes_budget(name) else DEFAULT_BUDGET
    policy, storage = split_storage(name)
    if storage:
        storage["kv_group_size"] = QUANT_GROUP
    return mlxevict.make_cache(
        model, policy, size, sinks=settings.sinks, window=settings.window, slack=settings.slack, **storage
    )


def entries_within(model: nn.Module, name: str, fraction: float, context: int, settings: CacheSettings) -> int:
    """The most entries per layer whose KV fits ``fraction`` of a 16-bit full cache of ``context`` tokens.

    Bytes as :func:`kv_bytes_16bit` counts them. mlxevict's caches grow to their
    budget and then stay flat, so a budget's bytes are measured on the arrays a full
    cache holds (its storage allocated at the capacity it keeps once full), not modelled
    (a window in other bits than the rest is not linear in the budget); no model runs
    (a forward of ``budget + 1`` tokens per probe took 85 of `eval --quick`'s 165 s of
    runs). ``tests/test_benchmarks.py`` checks the result against caches fed by the model.
    ``rotating`` holds 16-bit entries. At most ``context`` entries, except with precision tiers
    (``l32``): their budget is entries at the low tier's bytes, and bytes beyond the context's keep
    entries in the high tier (:func:`mlxevict.plan.plan_cache` does not cap them either).
    """
    limit = int(fraction * context * layer_kv_bytes_per_token(model, 2))
    if disk_pages(name) is not None:  # the entries held, the sketch of the rest, the unfinished pages and one read
        request = BudgetRequest(name, nbytes=limit)  # limit: all layers
        return paged_tokens(request, model, context, disk_pages(name), dtype_size=2)
    if name == "rotating":
        return min(context, limit // layer_kv_bytes_per_token(model, 2))
    shape = kv_shape(model)

    def fits(budget: int) -> bool:
        try:
            caches = make_caches(model, name, budget, settings)
        except ValueError:  # below the protected entries: smaller than any budget that runs
            return True
        for c in caches:  # what a full cache holds: the capacity it keeps once the budget is reached
            c.allocate_full(1, shape.kv_heads, shape.head_dim, shape.head_dim, mx.float16)
        return kv_bytes_16bit(caches, bound=True) <= limit

    if not _known(name):  # an error, not a budget that fits (fits() reads a ValueError as "too small to run")
        raise ValueError(f"unknown cache {name!r}; choose one of: {', '.join(cache_names())}")
    lo, hi = 1, context  # fits(lo) is assumed (one entry); fits(hi) is false after the next lines
    while fits(hi):
        if not split_storage(name)[1].get("low_bits"):
            return context
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def release(reset_peak: bool = True) -> None:
    """Free the last run's buffers (and, with ``reset_peak``, its peak) so the next measurement is its own."""
    gc.collect()
    mx.clear_cache()
    if reset_peak:
        mx.reset_peak_memory()


def kv_bytes(caches: Sequence[Any]) -> int:
    """Bytes the caches hold now (keys, values and, for quantized caches, scales)."""
    return sum(c.nbytes for c in caches if not c.empty())


def kv_bytes_16bit(caches: Sequence[Any], bound: bool = False) -> int:
    """KV bytes as a 16-bit model holds them: packed words as they are, floats at 2 bytes.

    CPU runs use float32 models (float16 matmuls are slow there), but KV memory is
    compared as a 16-bit model holds it; scales, biases and full-precision windows
    are floats, so a plain ``kv_bytes / 2`` would be wrong for quantized caches.
    mlx-lm's caches count the entries they hold (their buffers grow 256 slots at a
    time, so a 512-token run can allocate 756); mlxevict's count their fixed allocation. ``bound``: a
    keys-per-channel storage's scale table counted at the rows it may grow to (``max_rows``), not the
    rows it holds now.
    """
    total = 0
    for c in caches:
        if c.empty():
            continue
        storage = getattr(c, "storage", None)
        if isinstance(c, mlxevict.EvictingKVCache):
            if storage.demotes and bound:  # precision tiers: the bytes they may hold
                B, H, D = storage.shape[:3]
                total += B * H * storage.head_memory(D, 2)
                continue
            arrays, held = storage.arrays(), None
        else:
            arrays, held = [c.keys, c.values], min(c.offset, getattr(c, "max_size", None) or c.offset)
        for _, x in tree_flatten(arrays):
            slots = x.shape[2] if held is None else min(held, x.shape[2])
            total += x.size // max(x.shape[2], 1) * slots * (2 if mx.issubdtype(x.dtype, mx.floating) else x.dtype.size)
        if bound and hasattr(storage, "max_rows"):
            table = storage.keys[2]  # B, H, T, D
            rows = max(0, storage.max_rows(c.budget) - table.shape[2])
            total += 2 * rows * table.shape[0] * table.shape[1] * table.shape[3] * 2  # scales and biases, 16-bit
    return total


# ---- storage modes: "<policy>:q8" / ":q4" / ":q4w8" / ":k5v3w8" ---------------------------
STORAGE_SUFFIXES = (":q8", ":q4", ":q4w8", ":k5v3w8")  # :k5v3w8: keys in 5 bits, values in 3, the bytes of :q4w8
# Also understood, not in the default sweeps: any other suffix KVStorage reads, such as keys per channel over
# 64 tokens (KIVI, ":k5v3w8c64"), whose 96 tokens held in 8 bits do not fit the short suite's small budgets.


def split_storage(name: str) -> tuple[str, dict[str, Any]]:
    """``"default:q4w8"`` → ``("default", {"kv_bits": 4, "window_bits": 8})``; other names → ``(name, {})``.

    The suffix is :attr:`mlxevict.kvstorage.KVStorage.suffix`; the dict holds the arguments it sets.
    """
    base, colon, suffix = name.partition(":")
    if not colon:
        return name, {}
    try:  # any suffix KVStorage reads (":k4v2w8c64" too), not only the swept ones
        storage = KVStorage.from_suffix(colon + suffix)
    except ValueError:
        return name, {}
    return base, {k: v for k, v in storage.options().items() if k in _SUFFIX_SETS and v}


_SUFFIX_SETS = ("kv_bits", "window_bits", "key_group", "low_bits", "eight_bit_layers")  # what a suffix sets; the rest stay make_cache's defaults


def suffix_error(name: str, flag: str = "") -> None:
    """Raise the reason a known policy's storage suffix is not one (``"default:k5v3w8c64l44"``); else nothing."""
    base, colon, suffix = name.partition(":")
    if colon and base in cache_names() and base not in MLX_LM_CACHES:
        try:
            KVStorage.from_suffix(colon + suffix)
        except ValueError as err:
            reason = str(err).removeprefix(f"{colon + suffix!r}: ")  # the name is said once, first
            raise MlxEvictError(f"{flag + ' ' if flag else ''}{name}: {reason}") from None


def check_cache(name: str, flag: str) -> None:
    """One error line (``flag``: the option that named it) for a cache or policy the benchmarks do not know."""
    if not _known(name):
        suffix_error(name, flag)
        raise MlxEvictError(f"{flag} {name}: unknown cache or policy; choose from: {', '.join(cache_names())}")


def _known(name: str) -> bool:
    base, storage = split_storage(name)
    return is_paged(name) or disk_pages(name) is not None or (base in cache_names() and not (storage and base in MLX_LM_CACHES))


def layer_kv_bytes_per_token(model: nn.Module, dtype_size: int) -> int:
    """Bytes one token costs a full cache, all layers (keys + values of every kv-head)."""
    return kv_shape(model, dtype_size).bytes_per_token
