"""Telemetry's old import path: runtime memory, model geometry and budget sizing, now three modules.

:mod:`mlxevict.memory` (what MLX and the machine hold; the memory guard),
:mod:`mlxevict.geometry` (what a token costs a model) and :mod:`mlxevict.budget`
(a budget as written, and the tokens a memory buys). Which storage and how many
tokens a cache gets is decided in :mod:`mlxevict.plan`.
"""

from __future__ import annotations

from .budget import (
    AUTO_FRACTION,
    DEFAULT_BUDGET_TEXT,
    MIN_AUTO_BUDGET,
    BudgetRequest,
    budget_tokens,
    fit_budget,
    held_nbytes,
    parse_budget,
    parse_size,
    storage_nbytes,
    tokens_within,
)
from .geometry import (
    KVShape,
    config_dtype_size,
    context_limit,
    folder_dtype_size,
    kv_bytes_per_token,
    kv_shape,
    model_dtype,
    read_config,
    weights_nbytes,
)
from .memory import (
    DEFAULT_CHECK_EVERY,
    DEFAULT_MARGIN,
    MemoryGuard,
    MemorySnapshot,
    format_bytes,
    kv_nbytes,
    memory_snapshot,
)
from .plan import memory_storage

__all__ = [
    "AUTO_FRACTION", "DEFAULT_BUDGET_TEXT", "MIN_AUTO_BUDGET", "BudgetRequest", "budget_tokens", "fit_budget",
    "held_nbytes", "parse_budget", "parse_size", "storage_nbytes", "tokens_within", "KVShape", "config_dtype_size",
    "context_limit", "folder_dtype_size", "kv_bytes_per_token", "kv_shape", "model_dtype", "read_config",
    "weights_nbytes", "DEFAULT_CHECK_EVERY", "DEFAULT_MARGIN", "MemoryGuard", "MemorySnapshot", "format_bytes",
    "kv_nbytes", "memory_snapshot", "memory_storage",
]  # fmt: skip
