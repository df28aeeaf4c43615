"""Budget sizing: a budget as people write it (tokens, ``1.5GB``, ``auto``) and the tokens a memory buys.

:func:`parse_budget` reads the text into a :class:`BudgetRequest`;
:func:`budget_tokens` turns one into tokens per layer for a model and a
:class:`~mlxevict.kvstorage.KVStorage`, a quantized cache's recent window counted
at its own size. Which storage and how many tokens a cache gets is decided once,
in :func:`mlxevict.plan.plan_cache`, which calls these.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Optional

import psutil

from .defaults import DEFAULT_BUDGET
from .errors import MlxEvictError
from .geometry import kv_shape
from .kvstorage import DTYPE, KVStorage
from .room import full_window

AUTO_FRACTION = 0.25  # share of the free memory ``--budget auto`` gives the KV cache
MIN_AUTO_BUDGET = 256
DEFAULT_BUDGET_TEXT = f"default ({DEFAULT_BUDGET})"

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes from ``"1.5GB"``, ``"800MB"``, ``"2GiB"`` or ``"4096"``.

    ``KB/MB/GB/TB`` are powers of 1000, ``KiB/MiB/GiB/TiB`` of 1024; single
    letters (``"2G"``) mean the decimal units.

    Raises:
        MlxEvictError: not a size.
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise MlxEvictError(f"{text!r} is not a memory size; write it like 1.5GB, 800MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class BudgetRequest:
    """A budget as the user wrote it: tokens, bytes of KV memory, or ``auto`` (both ``None``)."""

    text: str
    tokens: Optional[int] = None
    nbytes: Optional[int] = None

    @property
    def auto(self) -> bool:
        return self.tokens is None and self.nbytes is None

    @property
    def default(self) -> bool:
        """Nobody asked for this budget (no ``--budget``): nothing to tell about it."""
        return self.text == DEFAULT_BUDGET_TEXT


DEFAULT_REQUEST = BudgetRequest(DEFAULT_BUDGET_TEXT, tokens=DEFAULT_BUDGET)


def parse_budget(text: "str | int | BudgetRequest | None") -> BudgetRequest:
    """Read ``"2048"`` or ``2048`` (tokens), ``"1.5GB"``/``"800MB"`` (KV memory, all layers) or ``"auto"``.

    ``None`` is the default budget; a :class:`BudgetRequest` is returned as it is.

    Raises:
        MlxEvictError: anything else, or a budget that is not positive.
    """
    if text is None:
        return DEFAULT_REQUEST
    if isinstance(text, BudgetRequest):
        return text
    if isinstance(text, bool):
        raise MlxEvictError(f"budget={text!r} must be a positive number of tokens")
    text = str(text).strip()
    bad = f"bad --budget {text!r}: give tokens (2048), KV memory (1.5GB, 800MB) or auto"
    if text.lower() == "auto":
        return BudgetRequest(text)
    if text.lstrip("+-").isdigit():
        tokens = int(text)
        if tokens <= 0:
            raise MlxEvictError(f"bad --budget {text!r}: the budget must be a positive number of tokens")
        return BudgetRequest(text, tokens=tokens)
    try:
        nbytes = parse_size(text)
    except MlxEvictError:
        raise MlxEvictError(bad) from None
    if not _SIZE.match(text).group(2):
        raise MlxEvictError(bad)  # "1.5" without a unit is neither tokens nor memory
    if nbytes <= 0:
        raise MlxEvictError(f"bad --budget {text!r}: the KV memory must be positive")
    return BudgetRequest(text, nbytes=nbytes)


def held_nbytes(
    tokens: int,
    bytes_per_token: int,
    window_bytes_per_token: Optional[int] = None,
    full_precision_window: Optional[int] = None,
    held_extra: int = 0,
    fixed: int = 0,
) -> int:
    """KV bytes of ``tokens`` entries, a quantized cache's window at its own size (:func:`tokens_within`).

    ``held_extra``: window slots held beyond the window's tokens (an unfinished key group, whose rows
    also keep their quantized slots: :class:`~mlxevict.channel_storage.ChannelStorage`); ``fixed``: bytes
    held whatever the tokens (its scale table's reserved rows).
    """
    if window_bytes_per_token is None:
        return tokens * bytes_per_token
    window = min(tokens, full_window(tokens, full_precision_window))
    return (tokens - window) * bytes_per_token + (window + held_extra) * window_bytes_per_token + fixed


def tokens_within(
    nbytes: int,
    bytes_per_token: int,
    window_bytes_per_token: Optional[int] = None,
    full_precision_window: Optional[int] = None,
    held_extra: int = 0,
    fixed: int = 0,
) -> int:
    """The most tokens whose KV fits ``nbytes``.

    A quantized cache keeps its newest tokens (``full_precision_window``, default
    ``min(32, budget // 8)``) at ``window_bytes_per_token`` (the model's dtype or
    8 bits), so they are counted at that size; ``None``: every token costs the same.
    """
    costs = dict(bytes_per_token=bytes_per_token, window_bytes_per_token=window_bytes_per_token,
                 full_precision_window=full_precision_window, held_extra=held_extra, fixed=fixed)  # fmt: skip
    return _within(nbytes, [costs])


def storage_nbytes(model_or_config: Any, tokens: int, storage: KVStorage = DTYPE) -> int:
    """KV bytes of a cache of ``tokens`` entries in ``storage``, its window at its own size."""
    return _held(tokens, _parts(model_or_config, storage))


def _parts(model_or_config: Any, storage: KVStorage) -> list[dict[str, Any]]:
    """:func:`_costs` per group of layers stored alike (layers in 8 bits apart: ``storage.eight_bit_layers``)."""
    shape = kv_shape(model_or_config)
    return [_costs(replace(shape, layers=n), s) for n, s in storage.layer_groups(shape.layers)]


def _held(tokens: int, parts: list[dict[str, Any]]) -> int:
    return sum(held_nbytes(tokens, **costs) for costs in parts)


def _within(nbytes: int, parts: list[dict[str, Any]]) -> int:
    """:func:`tokens_within` over every group of layers: the most tokens (the same in each) whose KV fits."""
    tokens = max(0, nbytes) // max(1, sum(c["bytes_per_token"] for c in parts))
    # Windows cost at most a few dozen tokens more.
    while tokens > 0 and _held(tokens, parts) > nbytes:
        tokens -= 1
    return tokens


def _costs(shape: Any, storage: KVStorage) -> dict[str, Any]:
    """Bytes per token, a quantized window's bytes per token and its length, for ``held_nbytes`` and kin."""
    return dict(
        bytes_per_token=shape.storage_bytes(storage),
        window_bytes_per_token=shape.window_bytes(storage),
        full_precision_window=storage.full_precision_window,
        held_extra=storage.held_extra,
        fixed=shape.fixed_bytes(storage),
    )


def fit_budget(
    bytes_per_token: int,
    available: int,
    *,
    fraction: float = AUTO_FRACTION,
    context_limit: Optional[int] = None,
    window_bytes_per_token: Optional[int] = None,
    full_precision_window: Optional[int] = None,
    held_extra: int = 0,
    fixed: int = 0,
) -> int:
    """The budget (tokens per layer) whose KV takes ``fraction`` of ``available`` bytes.

    Args:
        bytes_per_token: from :func:`~mlxevict.geometry.kv_bytes_per_token`.
        available: free bytes, after the weights are counted.
        fraction: the share of ``available`` the KV cache may take. Default 0.25.
        context_limit: cap at the model's context length (a budget above it never evicts).
        window_bytes_per_token, full_precision_window: a quantized cache's window (:func:`tokens_within`).

    Returns:
        A positive multiple of 64, at least ``MIN_AUTO_BUDGET``.
    """
    costs = dict(bytes_per_token=bytes_per_token, window_bytes_per_token=window_bytes_per_token,
                 full_precision_window=full_precision_window, held_extra=held_extra, fixed=fixed)  # fmt: skip
    return _fit(available, [costs], fraction, context_limit)


def _fit(available: int, parts: list[dict[str, Any]], fraction: float = AUTO_FRACTION,
         context_limit: Optional[int] = None) -> int:  # fmt: skip
    """:func:`fit_budget` over every group of layers (:func:`_parts`)."""
    tokens = _within(int(max(0, available) * fraction), parts)
    if context_limit:
        tokens = min(tokens, context_limit)
    return max(MIN_AUTO_BUDGET, tokens // 64 * 64)


def request_nbytes(request: BudgetRequest, available: Optional[int] = None) -> int:
    """The KV bytes a budget in memory stands for: its size, or for ``auto`` ``AUTO_FRACTION`` of ``available``
    (default: what the system has available now)."""
    if request.nbytes is not None:
        return request.nbytes
    if available is None:
        available = psutil.virtual_memory().available
    return int(max(0, available) * AUTO_FRACTION)


def budget_tokens(
    request: BudgetRequest,
    model_or_config: Any,
    storage: KVStorage = DTYPE,
    *,
    available: Optional[int] = None,
    context_limit: Optional[int] = None,
) -> int:
    """Tokens per layer for a :class:`BudgetRequest`, a model and a storage (not capped at the context).

    Args:
        request: from :func:`parse_budget`.
        model_or_config: the model (see :func:`~mlxevict.geometry.kv_shape`), for bytes per token.
        storage: the cache's storage; memory forms buy more tokens quantized, its window counted
            at its own size.
        available: free bytes for ``auto``; default what the system has available now.
        context_limit: caps ``auto`` at the model's context length.
    """
    if request.tokens is not None:
        return request.tokens
    parts = _parts(model_or_config, storage)
    if request.nbytes is not None:
        return _within(request.nbytes, parts)
    if available is None:
        available = psutil.virtual_memory().available
    return _fit(available, parts, context_limit=context_limit)
