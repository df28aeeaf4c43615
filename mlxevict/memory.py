"""Runtime memory: what MLX, the machine and the KV caches hold now, as data, and a guard that stops before swap.

:func:`memory_snapshot` reads MLX's allocator (active, peak, cache), the
system's total and available memory (unified memory on Apple Silicon), this
process's RSS and the KV bytes of a model's caches. :class:`MemoryGuard` caps
MLX's memory and tells the generation loop to stop before the machine would swap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import mlx.core as mx
import psutil

from .cache import EvictingKVCache
from .distributed import first_reason
from .errors import MlxEvictError
from .stats import cache_stats

DEFAULT_MARGIN = 1 * 1024**3  # stop generating when less than this is left to the system
DEFAULT_CHECK_EVERY = 8  # tokens between two guard checks (a check costs ~50 µs)


@dataclass(frozen=True)
class MemorySnapshot:
    """Memory at one moment, in bytes.

    Attributes:
        mlx_active: bytes MLX's allocator holds for live arrays.
        mlx_peak: the most ``mlx_active`` has been since the last reset.
        mlx_cache: bytes MLX keeps in its buffer cache for reuse.
        system_total: the machine's memory (unified memory on Apple Silicon).
        system_available: what the system can still hand out without swapping.
        process_rss: this process's resident set size.
        kv_nbytes: KV bytes the caches hold now, all layers (0 without caches).
        kv_full_nbytes: what a full ``KVCache`` would hold for the same tokens.
    """

    mlx_active: int
    mlx_peak: int
    mlx_cache: int
    system_total: int
    system_available: int
    process_rss: int
    kv_nbytes: int = 0
    kv_full_nbytes: int = 0

    @property
    def system_used(self) -> int:
        return self.system_total - self.system_available

    @property
    def kv_saved_nbytes(self) -> int:
        return max(0, self.kv_full_nbytes - self.kv_nbytes)


def kv_nbytes(caches: Optional[Sequence[Any]]) -> tuple[int, int]:
    """``(held, full)`` KV bytes of a model's caches: evicting or mlx-lm's own."""
    if not caches:
        return 0, 0
    if any(isinstance(c, EvictingKVCache) for c in caches):
        stats = cache_stats(caches)
        return stats.nbytes, stats.full_nbytes
    held = sum(getattr(c, "nbytes", 0) for c in caches)
    return held, held


def memory_snapshot(caches: Optional[Sequence[Any]] = None) -> MemorySnapshot:
    """Read MLX, system and process memory now, and the KV bytes of ``caches``.

    Args:
        caches: a model's caches (``make_cache`` or mlx-lm's), or ``None``.

    Returns:
        A :class:`MemorySnapshot`.
    """
    system = psutil.virtual_memory()
    held, full = kv_nbytes(caches)
    return MemorySnapshot(
        mlx_active=mx.get_active_memory(),
        mlx_peak=mx.get_peak_memory(),
        mlx_cache=mx.get_cache_memory(),
        system_total=system.total,
        system_available=system.available,
        process_rss=psutil.Process().memory_info().rss,
        kv_nbytes=held,
        kv_full_nbytes=full,
    )


def format_bytes(n: float) -> str:
    """``1572864`` → ``"1.5 MiB"`` (binary units, as memory is sold; :func:`parse_size` reads them back)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class MemoryGuard:
    """Caps MLX's memory and says when generation must stop before the machine swaps.

    Use as a context manager around generation: entering sets MLX's memory
    limit (``mx.set_memory_limit``), leaving restores the previous one. The
    generation loop calls :meth:`check` every few tokens; a non-empty answer is
    the reason to stop, and the loop keeps the text produced so far.

    Args:
        margin: stop when the system has less than this many bytes available. Default 1 GiB.
        mlx_limit: most bytes MLX may hold; default ``system_total - margin``.
        check_every: tokens between checks. Default 8.
    """

    def __init__(
        self,
        margin: int = DEFAULT_MARGIN,
        mlx_limit: Optional[int] = None,
        check_every: int = DEFAULT_CHECK_EVERY,
    ):
        if margin < 0:
            raise MlxEvictError(f"memory margin {margin} must be >= 0 bytes")
        if mlx_limit is not None and mlx_limit <= 0:
            raise MlxEvictError(f"mlx_limit={mlx_limit} must be a positive number of bytes")
        self.margin = margin
        total = psutil.virtual_memory().total
        self.mlx_limit = mlx_limit if mlx_limit is not None else max(total - margin, total // 2)
        self.check_every = max(1, check_every)
        self._previous_limit: Optional[int] = None

    def __enter__(self) -> "MemoryGuard":
        self._previous_limit = mx.set_memory_limit(self.mlx_limit)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous_limit is not None:
            mx.set_memory_limit(self._previous_limit)
            self._previous_limit = None

    def check(self) -> str:
        """``""`` while memory is fine, else a one-line reason to stop.

        Under ``mlx.launch`` every rank gets the same answer (the first stopping rank's reason),
        so all stop at the same step; every rank must call it at the same step.
        """
        return first_reason(self._reason())

    def _reason(self) -> str:
        available = psutil.virtual_memory().available
        if available < self.margin:
            return (
                f"stopped before the machine would swap: {format_bytes(available)} available, "
                f"below the {format_bytes(self.margin)} margin; lower --budget or close other programs"
            )
        active = mx.get_active_memory()
        if active > self.mlx_limit:
            return (
                f"stopped at the memory limit: MLX holds {format_bytes(active)}, "
                f"over the {format_bytes(self.mlx_limit)} limit; lower --budget or use a smaller model"
            )
        return ""
