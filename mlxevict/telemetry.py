"""Memory telemetry: what MLX, the machine and the KV caches hold, as data.

:func:`memory_snapshot` reads MLX's allocator (active, peak, cache), the
system's total and available memory (unified memory on Apple Silicon), this
process's RSS and the KV bytes of a model's caches. :func:`kv_bytes_per_token`
is the model's KV cost per token; :func:`fit_budget` and :func:`parse_size`
turn memory into a budget. :class:`MemoryGuard` caps MLX's memory and tells the
generation loop to stop before the machine would swap.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import mlx.core as mx
import psutil

from .cache import EvictingKVCache, default_window
from .distributed import first_reason, head_share
from .errors import MlxEvictError
from .quantized import DEFAULT_GROUP_SIZE, SPLIT_BITS, KVBits, key_value_bits, storage_bytes
from .stats import cache_stats

DEFAULT_MARGIN = 1 * 1024**3  # stop generating when less than this is left to the system
DEFAULT_CHECK_EVERY = 8  # tokens between two guard checks (a check costs ~50 µs)
AUTO_FRACTION = 0.25  # share of the free memory ``--budget auto`` gives the KV cache
MIN_AUTO_BUDGET = 256

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_SAFETENSORS_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}


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


@dataclass(frozen=True)
class KVShape:
    """What one token costs in KV memory: ``layers × kv_heads × head_dim × 2 × dtype_size``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_size: int

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_size

    def storage_bytes_per_token(self, kv_bits: Optional[KVBits] = None, group_size: int = DEFAULT_GROUP_SIZE) -> int:
        """Bytes per token with keys and values stored in ``kv_bits`` (``None``: the dtype).

        A quantized cache holds its recent window at :meth:`window_bytes_per_token`.
        """
        bits = (None, None) if kv_bits is None else key_value_bits(kv_bits)
        vectors = sum(storage_bytes(self.head_dim, self.dtype_size, b, group_size) for b in bits)
        return self.layers * self.kv_heads * vectors

    def window_bytes_per_token(
        self, kv_bits: Optional[KVBits] = None, group_size: int = DEFAULT_GROUP_SIZE, window_bits: Optional[int] = None
    ) -> Optional[int]:
        """Bytes per token of a quantized cache's recent window (dtype, or ``window_bits``);
        ``None`` unquantized, where the window costs what every token does."""
        return None if kv_bits is None else self.storage_bytes_per_token(window_bits, group_size)


def read_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a model folder, as a dict."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise MlxEvictError(f"{file} not found: not an MLX model folder") from None
    except json.JSONDecodeError as err:
        raise MlxEvictError(f"{file} is not valid JSON ({err})") from None


def weights_nbytes(path: str | Path) -> int:
    """Bytes of a model folder's ``*.safetensors`` files."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def _safetensors_dtypes(path: Path) -> dict[str, str]:
    """Tensor name → safetensors dtype (``"F32"``, ``"BF16"``...) from the first file's header."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return {}
    with open(files[0], "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {name: meta["dtype"] for name, meta in header.items() if isinstance(meta, dict) and "dtype" in meta}


def folder_dtype_size(path: str | Path) -> Optional[int]:
    """Bytes per activation of a model folder, read from its weights' float type (``None``: no weights)."""
    dtypes = _safetensors_dtypes(Path(path))
    floats = [d for name, d in dtypes.items() if d in _SAFETENSORS_SIZES and ("scales" in name or "embed" in name)]
    floats = floats or [d for d in dtypes.values() if d in _SAFETENSORS_SIZES]
    return _SAFETENSORS_SIZES[floats[0]] if floats else None


def config_dtype_size(config: Mapping[str, Any]) -> int:
    """Bytes per KV element from a config's ``torch_dtype`` (float16 when absent)."""
    name = str(config.get("torch_dtype") or config.get("dtype") or "float16").replace("torch.", "")
    if name not in _DTYPE_SIZES:
        raise MlxEvictError(f"unknown dtype {name!r} in the model config; expected one of {sorted(_DTYPE_SIZES)}")
    return _DTYPE_SIZES[name]


def model_dtype(model: Any) -> mx.Dtype:
    """The float type a loaded model computes in (its embedding's, or its scales' when quantized)."""
    embed = model.model.embed_tokens if hasattr(model, "model") else model.embed_tokens
    return getattr(embed, "scales", embed.weight).dtype


def kv_shape(model_or_config: Any, dtype_size: Optional[int] = None) -> KVShape:
    """The KV geometry of a loaded mlx-lm model, its ``ModelArgs``, a config dict or a model folder.

    A loaded model sharded over ``N`` ranks (``model.shard()``) counts this rank's
    ``1/N`` of the KV heads. The KV cache is stored in the type the model computes in: a loaded model's
    embedding (or quantization scales) type, a folder's weights type, else the
    config's ``torch_dtype``.

    Args:
        model_or_config: an ``nn.Module`` with ``args``, a ``ModelArgs``, a
            ``config.json`` dict, or a path to a model folder.
        dtype_size: bytes per element, overriding what is read.

    Returns:
        A :class:`KVShape`.
    """
    config: Any = model_or_config
    share = 1
    if isinstance(config, (str, Path)):
        dtype_size = dtype_size or folder_dtype_size(config)
        config = read_config(config)
    elif hasattr(config, "args") and hasattr(config, "layers"):
        dtype_size = dtype_size or model_dtype(config).size
        share = head_share(config)  # a sharded model (mlx.launch) holds its block of the KV heads
        config = config.args
    if not isinstance(config, Mapping):
        config = vars(config)
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError):
        raise MlxEvictError("the model config lacks num_hidden_layers, num_attention_heads or hidden_size") from None
    kv_heads = int(config.get("num_key_value_heads") or heads) // share
    return KVShape(layers, kv_heads, head_dim, dtype_size or config_dtype_size(config))


def kv_bytes_per_token(
    model_or_config: Any,
    dtype_size: Optional[int] = None,
    *,
    kv_bits: Optional[KVBits] = None,
    kv_group_size: int = DEFAULT_GROUP_SIZE,
) -> int:
    """KV bytes one token costs: ``layers × kv_heads × head_dim × 2 × dtype_size``.

    Args:
        model_or_config, dtype_size: see :func:`kv_shape`.
        kv_bits, kv_group_size: quantized storage (see :meth:`KVShape.storage_bytes_per_token`).
    """
    return kv_shape(model_or_config, dtype_size).storage_bytes_per_token(kv_bits, kv_group_size)


def memory_storage(
    request: BudgetRequest, model_or_config: Any, context_limit: Optional[int], available: Optional[int] = None
) -> dict[str, Any]:
    """What a budget in memory stores when no ``kv_bits`` (``--kv-bits``) is given.

    The finest storage that holds the model's whole context (its dtype, then 8 bits:
    nothing is ever evicted, so nothing is gained by fewer bits); else keys in 5 bits,
    values in 3 and the newest tokens in 8, which at a quarter of a 16-bit cache's
    bytes kept every retrieval answer where the 16-bit default and mlx-lm's caches kept
    none (README, "Quality per byte"). The dtype when no group size divides the head dim.

    Args:
        request: a budget in memory or ``auto``.
        model_or_config: the model, or its folder (see :func:`kv_shape`).
        context_limit: the model's context length (``None``: unknown, so 5/3 bits).
        available: free bytes for ``auto`` (default: what the system has now).
    """
    head_dim = kv_shape(model_or_config).head_dim
    group = next((g for g in (DEFAULT_GROUP_SIZE, 32) if head_dim % g == 0), None)
    if group is None:
        return {}
    for storage in ({}, {"kv_bits": 8, "kv_group_size": group}):
        tokens = budget_tokens(request, model_or_config, available=available, **storage)
        if context_limit and tokens >= context_limit:
            return storage
    return {"kv_bits": SPLIT_BITS, "kv_group_size": group, "window_bits": 8}


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


def tokens_within(
    nbytes: int,
    bytes_per_token: int,
    window_bytes_per_token: Optional[int] = None,
    full_precision_window: Optional[int] = None,
) -> int:
    """The most tokens whose KV fits ``nbytes``.

    A quantized cache keeps its newest tokens (``full_precision_window``, default
    ``min(32, budget // 8)``) at ``window_bytes_per_token`` (the model's dtype or
    8 bits), so they are counted at that size; ``None``: every token costs the same.
    """
    tokens = max(0, nbytes) // max(1, bytes_per_token)
    # The window costs at most a few dozen tokens more.
    while tokens > 0 and held_nbytes(tokens, bytes_per_token, window_bytes_per_token, full_precision_window) > nbytes:
        tokens -= 1
    return tokens


def storage_nbytes(
    model_or_config: Any,
    tokens: int,
    *,
    kv_bits: Optional[KVBits] = None,
    kv_group_size: int = DEFAULT_GROUP_SIZE,
    window_bits: Optional[int] = None,
    full_precision_window: Optional[int] = None,
) -> int:
    """KV bytes of a cache of ``tokens`` entries stored as ``make_cache``'s storage arguments say."""
    shape = kv_shape(model_or_config)
    per_token = shape.storage_bytes_per_token(kv_bits, kv_group_size)
    window = shape.window_bytes_per_token(kv_bits, kv_group_size, window_bits)
    return held_nbytes(tokens, per_token, window, full_precision_window)


def held_nbytes(
    tokens: int,
    bytes_per_token: int,
    window_bytes_per_token: Optional[int] = None,
    full_precision_window: Optional[int] = None,
) -> int:
    """KV bytes of ``tokens`` entries, a quantized cache's window at its own size (:func:`tokens_within`)."""
    if window_bytes_per_token is None:
        return tokens * bytes_per_token
    window = min(tokens, default_window(tokens) if full_precision_window is None else full_precision_window)
    return (tokens - window) * bytes_per_token + window * window_bytes_per_token


def fit_budget(
    bytes_per_token: int,
    available: int,
    *,
    fraction: float = AUTO_FRACTION,
    context_limit: Optional[int] = None,
    window_bytes_per_token: Optional[int] = None,
    full_precision_window: Optional[int] = None,
) -> int:
    """The budget (tokens per layer) whose KV takes ``fraction`` of ``available`` bytes.

    Args:
        bytes_per_token: from :func:`kv_bytes_per_token`.
        available: free bytes, after the weights are counted.
        fraction: the share of ``available`` the KV cache may take. Default 0.25.
        context_limit: cap at the model's context length (a budget above it never evicts).
        window_bytes_per_token, full_precision_window: a quantized cache's window (:func:`tokens_within`).

    Returns:
        A positive multiple of 64, at least ``MIN_AUTO_BUDGET``.
    """
    nbytes = int(max(0, available) * fraction)
    tokens = tokens_within(nbytes, bytes_per_token, window_bytes_per_token, full_precision_window)
    if context_limit:
        tokens = min(tokens, context_limit)
    return max(MIN_AUTO_BUDGET, tokens // 64 * 64)


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


@dataclass(frozen=True)
class BudgetRequest:
    """A budget as the user wrote it: tokens, bytes of KV memory, or ``auto`` (both ``None``)."""

    text: str
    tokens: Optional[int] = None
    nbytes: Optional[int] = None

    @property
    def auto(self) -> bool:
        return self.tokens is None and self.nbytes is None


def parse_budget(text: str | int) -> BudgetRequest:
    """Read ``"2048"`` (tokens), ``"1.5GB"``/``"800MB"`` (KV memory, all layers) or ``"auto"``.

    Raises:
        MlxEvictError: anything else, or a budget that is not positive.
    """
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


def budget_tokens(
    request: BudgetRequest,
    model_or_config: Any,
    *,
    available: Optional[int] = None,
    context_limit: Optional[int] = None,
    kv_bits: Optional[KVBits] = None,
    kv_group_size: int = DEFAULT_GROUP_SIZE,
    window_bits: Optional[int] = None,
    full_precision_window: Optional[int] = None,
) -> int:
    """Tokens per layer for a :class:`BudgetRequest` and a model.

    Args:
        request: from :func:`parse_budget`.
        model_or_config: the model (see :func:`kv_shape`), for bytes per token.
        available: free bytes for ``auto``; default what the system has available now.
        context_limit: caps ``auto`` at the model's context length.
        kv_bits, kv_group_size, window_bits, full_precision_window: the cache's storage;
            memory forms buy more tokens quantized, its window counted at its own size.
    """
    if request.tokens is not None:
        return request.tokens
    shape = kv_shape(model_or_config)
    per_token = shape.storage_bytes_per_token(kv_bits, kv_group_size)
    window = dict(
        window_bytes_per_token=shape.window_bytes_per_token(kv_bits, kv_group_size, window_bits),
        full_precision_window=full_precision_window,
    )
    if request.nbytes is not None:
        return tokens_within(request.nbytes, per_token, **window)
    if available is None:
        available = psutil.virtual_memory().available
    return fit_budget(per_token, available, context_limit=context_limit, **window)
