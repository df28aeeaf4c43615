"""The one planner: a budget (tokens, ``"1.5GB"``, ``"auto"``) and a storage become a cache's tokens and storage.

Every caller that sizes a cache (``make_cache``, each CLI command, the chat
REPL's ``/budget``, the TUI's settings, ``info``) calls :func:`plan_cache`, so a
budget means the same everywhere: the storage rule for a budget in memory, the cap
at the model's context, the check that the budget leaves room to evict, and the
messages that say so.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from .budget import BudgetRequest, budget_tokens, parse_budget, request_nbytes, storage_nbytes
from .errors import MlxEvictError
from .geometry import context_limit, head_share, kv_shape
from .kvstorage import DEFAULT_GROUP_SIZE, DTYPE, SPLIT_BITS, KVStorage
from .page_store import PAGE
from .paged_storage import DEFAULT_PAGES, sketch_bytes
from .policies import make_policy
from .room import default_slack, default_window, full_window, room_needed

KEY_GROUP = 64  # tokens per key scale of the memory rule's per-channel keys (the one measured)
# The memory rule's precision tiers, (keys, values) bits of the high tier and of the low tier (docs/tiers.md): a
# 5/4 high tier kept as many answers or more than 5/3 at 25% and 18.75% on the tuning half, with lower KL.
TIER_BITS = ((5, 4), (3, 2))
# Below this share of a 16-bit full cache of the tokens expected, the tiers are 5/3 over 4/3 instead: where the cache
# must evict most of the context, a 4/3 low tier had the lowest KL at 12.5% in two tuning runs, and a 5/3 high tier
# over it kept 3 answers of 19 where 5/4 kept 1 (docs/tiers.md).
HEAVY_SHARE, HEAVY_TIER_BITS = 0.14, (SPLIT_BITS, (4, 3))
# A model's calibrated layers go to 8 bits when the budget is at least this share of a 16-bit full cache of the
# tokens expected: on the tuning half they gained at 25% and 18.75%, lost at 15.6% and 12.5% (docs/tiers.md).
EIGHT_BIT_SHARE = 0.18
# From this share of a 16-bit full cache of the tokens expected, a budget in memory that would evict keeps what it
# evicts in a page store (the system's temp folder) instead of precision tiers: on the test half at 25% and 12.5% it
# kept 17/17 and 15/17 answers where the tiers kept 15/17 and 3/17, with lower KL (docs/tiers.md). Below it the
# sketch of the evicted keys (7.8% of a 16-bit entry each) leaves too little to hold, and it was not measured.
PAGED_SHARE = 0.12


@dataclass(frozen=True)
class CachePlan:
    """What a cache will be: its budget in tokens per layer and its storage.

    Attributes:
        tokens: the budget, entries per layer (at most ``context_limit``, except with precision tiers:
            entries at their low tier's bytes, which may pass the context).
        storage: how the entries are stored.
        context_limit: the model's context length (``None``: unknown).
        request: the budget as it was asked for.
        notes: what the user should be told (a budget capped at the context), one line each.
    """

    tokens: int
    storage: KVStorage
    context_limit: Optional[int]
    request: BudgetRequest
    notes: tuple[str, ...] = ()

    def nbytes(self, model_or_config: Any) -> int:
        """KV bytes of the full cache, all layers (its window at its own size)."""
        return storage_nbytes(model_or_config, self.tokens, self.storage)


def memory_storage(
    request: BudgetRequest,
    model_or_config: Any,
    limit: Optional[int] = None,
    available: Optional[int] = None,
    eight_bit_layers: Sequence[int] = (),
    expected_tokens: Optional[int] = None,
) -> KVStorage:
    """What a budget in memory (or ``auto``) stores when no storage is asked for.

    The finest storage that holds the model's whole context (its dtype, then 8 bits, then
    keys in 5 bits, values in 3 and the newest tokens in 8: nothing is ever evicted, so
    nothing is gained by fewer bits); else precision tiers (:func:`tiers_storage`): keys quantized
    per channel over 64 tokens (KIVI, :mod:`mlxevict.channel_storage`), a high tier of 5/4 bits and
    a low tier of 3/2 bits that the policy's lowest-ranked entries are demoted to before any is
    evicted (:mod:`mlxevict.tiered_storage`), which the long-context suite's tuning half picked over
    one 5/3 tier at 25% and 12.5% of a 16-bit cache's bytes (docs/tiers.md); 5/3 over 4/3 bits when
    the budget is under ``HEAVY_SHARE`` of a 16-bit full cache of ``expected_tokens``; unless its 96
    tokens held in 8 bits would take more than half the budget (then per-token 5/3 bits); with
    ``eight_bit_layers`` (a model's :mod:`~mlxevict.calibrate` layers) those layers in 8 bits, the
    same tokens in every layer, when the budget is at least ``EIGHT_BIT_SHARE`` of a 16-bit full cache of
    ``expected_tokens`` (default: the model's context) and that still leaves room to evict. Ask
    for ``--kv-bits 5,3 --window-bits 8`` (``--key-group 64``) to keep per-token keys (one
    tier). The dtype when no group size divides the head dim.

    Args:
        request: a budget in memory or ``auto``.
        model_or_config: the model, or its folder (see :func:`~mlxevict.geometry.kv_shape`).
        limit: the model's context length (``None``: unknown, so 5/3 bits).
        available: free bytes for ``auto`` (default: what the system has now).
        eight_bit_layers: layers to keep in 8 bits when the rule picks precision tiers.
        expected_tokens: the tokens the cache will see (prompt and answer), for the low tier's bits and
            ``eight_bit_layers``.
    """
    group = quant_group(model_or_config)
    if group is None:
        return DTYPE
    per_token = KVStorage.of(SPLIT_BITS, group, window_bits=8)
    whole = whole_context_storage(request, model_or_config, limit, available)
    if whole is not None:
        return whole
    share = budget_share(request, model_or_config, expected_tokens or limit, available)
    tiers = tiers_storage(share, group, eight_bit_layers)
    # Without the 8-bit layers when their bytes leave no room to evict.
    for storage in [tiers] + ([replace(tiers, eight_bit_layers=())] if tiers.eight_bit_layers else []):
        tokens = budget_tokens(request, model_or_config, storage, available=available)
        # Its 8-bit window and unfinished key group (96 tokens) must leave room to evict: at most half the budget.
        if tokens >= 2 * (default_window(tokens) + KEY_GROUP):
            return storage
    return per_token


def quant_group(model_or_config: Any) -> Optional[int]:
    """The memory rule's quantization group: 64 channels, or 32 for a head dim 64 does not divide (``None``: neither)."""
    head_dim = kv_shape(model_or_config).head_dim
    return next((g for g in (DEFAULT_GROUP_SIZE, 32) if head_dim % g == 0), None)


def whole_context_storage(
    request: BudgetRequest, model_or_config: Any, limit: Optional[int], available: Optional[int] = None
) -> Optional[KVStorage]:
    """The finest storage in which a budget in memory holds the model's whole context (its dtype, 8 bits, then
    5/3 bits with an 8-bit window): nothing is ever evicted. ``None``: none does, or the context is unknown."""
    group = quant_group(model_or_config)
    if not limit or group is None:
        return None
    for storage in (DTYPE, KVStorage.of(8, group), KVStorage.of(SPLIT_BITS, group, window_bits=8)):
        if budget_tokens(request, model_or_config, storage, available=available) >= limit:
            return storage
    return None


def tiers_storage(share: float, group: int, eight_bit_layers: Sequence[int] = ()) -> KVStorage:
    """The precision tiers for a budget at ``share`` of a 16-bit full cache of the tokens expected (0: unknown):
    ``TIER_BITS``, or ``HEAVY_TIER_BITS`` under ``HEAVY_SHARE``, ``eight_bit_layers`` in 8 bits from
    ``EIGHT_BIT_SHARE`` (the rule :func:`memory_storage` applies, and the long eval's product row)."""
    high, low = HEAVY_TIER_BITS if 0 < share < HEAVY_SHARE else TIER_BITS
    layers = tuple(eight_bit_layers) if share >= EIGHT_BIT_SHARE else ()
    return KVStorage.of(high, group, window_bits=8, key_group=KEY_GROUP, low_bits=low, eight_bit_layers=layers)


def budget_share(request: BudgetRequest, model_or_config: Any, tokens: Optional[int], available: Optional[int] = None) -> float:
    """A budget in memory as a share of a 16-bit full cache of ``tokens`` (0 when ``tokens`` is unknown)."""
    if not tokens:
        return 0.0
    return request_nbytes(request, available) / (kv_shape(model_or_config, 2).bytes_per_token * tokens)


def sketch_bytes_per_token(shape: Any) -> int:
    """Bytes a paged cache keeps in memory per evicted token, all layers: the sketch of its keys (a
    :class:`~mlxevict.geometry.KVShape`'s head dim, kv-heads and layers; scales in its dtype).

    Raises:
        MlxEvictError: a head dim the sketch cannot group.
    """
    return sketch_bytes(shape.head_dim, scale_bytes=shape.dtype_size) * shape.kv_heads * shape.layers


def paged_tokens(
    request: BudgetRequest,
    model_or_config: Any,
    expected_tokens: Optional[int] = None,
    pages: int = DEFAULT_PAGES,
    available: Optional[int] = None,
    dtype_size: Optional[int] = None,
) -> int:
    """Entries held per layer by a paged cache (:mod:`mlxevict.paged_storage`) whose memory fits a budget in memory
    at ``expected_tokens`` (default: the model's context): the entries held (the model's dtype), the sketch of the
    rest, each layer's unfinished page, and one layer's ``pages`` read back (``dtype_size``: bytes per value, by
    default the model's).

    Raises:
        MlxEvictError: the sketch and pages alone take the budget.
    """
    shape = kv_shape(model_or_config, dtype_size)
    tokens = expected_tokens or context_limit(model_or_config)
    if not tokens:
        raise MlxEvictError("a paged cache with a budget in memory needs the tokens expected (the model's context is unknown)")
    entry = shape.bytes_per_token // shape.layers  # one layer's keys and values of one token
    sketch = sketch_bytes_per_token(shape)  # all layers
    fixed = shape.layers * (PAGE - 1) * entry + pages * PAGE * entry
    room = request_nbytes(request, available) - fixed - sketch * tokens
    held = min(tokens, max(0, room) // (shape.layers * entry - sketch))
    if held < 1:
        raise MlxEvictError(
            f"--budget {request.text} holds no token with a page store: the sketch of {tokens} tokens and "
            f"{pages} pages read back take {(fixed + sketch * tokens) / 2**20:.1f} MiB: raise it"
        )
    return held


def paged_plan(
    model_or_config: Any, budget: "int | str | BudgetRequest", pages: int = DEFAULT_PAGES,
    expected_tokens: Optional[int] = None,
) -> CachePlan:
    """The plan of a paged cache (:mod:`mlxevict.paged_storage`): entries held in the model's dtype, a budget in
    tokens as the dtype's plan sizes it (capped at the context, with a note), a budget in memory by
    :func:`paged_tokens` at ``expected_tokens`` (default: the model's context)."""
    request = parse_budget(budget)
    if request.tokens is not None:
        return plan_cache(model_or_config, request, DTYPE)
    tokens = paged_tokens(request, model_or_config, expected_tokens, pages)
    return CachePlan(tokens, DTYPE, context_limit(model_or_config), request)


PageDir = Union[str, Path, bool, None]


def rule_pages(
    model_or_config: Any, budget: "int | str | BudgetRequest", expected_tokens: Optional[int] = None,
    pages: int = DEFAULT_PAGES, available: Optional[int] = None, dtype_size: Optional[int] = None,
) -> bool:
    """Whether the memory rule keeps what a budget evicts in a page store: a budget in memory that holds no
    storage's whole context (:func:`whole_context_storage`), at least ``PAGED_SHARE`` of a 16-bit full cache of
    ``expected_tokens`` (default: the model's context), that a paged cache can be sized in
    (:func:`paged_tokens`, entries of ``dtype_size`` bytes a value: default the model's); on a model whose heads
    are not split over ranks (a page store was not tried there)."""
    request = parse_budget(budget)
    if request.tokens is not None or hasattr(model_or_config, "layers") and head_share(model_or_config) != 1:
        return False
    limit = context_limit(model_or_config)
    expected = expected_tokens or limit
    if not expected or whole_context_storage(request, model_or_config, limit, available) is not None:
        return False
    if budget_share(request, model_or_config, expected, available) < PAGED_SHARE:
        return False
    try:
        paged_tokens(request, model_or_config, expected, pages, available, dtype_size)
    except MlxEvictError:
        return False
    return True


def page_folder(
    page_dir: PageDir, model_or_config: Any, budget: "int | str | BudgetRequest", *, storage_asked: bool = False,
    expected_tokens: Optional[int] = None, pages: int = DEFAULT_PAGES, available: Optional[int] = None,
) -> Optional["str | Path"]:
    """Where a cache's evicted entries go: ``page_dir`` when one is given, nowhere for ``False``, and for ``None``
    the memory rule's choice (:func:`rule_pages`; never when a storage is asked for): the system's temp folder
    (the file has no name there, so nothing is left behind)."""
    if page_dir is False:
        return None
    if page_dir is not None:
        return page_dir
    if storage_asked or not rule_pages(model_or_config, budget, expected_tokens, pages, available):
        return None
    return tempfile.gettempdir()


def calibrated_layers(model_or_config: Any) -> tuple[int, ...]:
    """The layers the calibration of a model or model folder keeps in 8 bits (:mod:`mlxevict.calibrate`); ``()``
    for none, or for a config (no weights to name it by)."""
    from .calibrate import saved_calibration

    found = saved_calibration(model_or_config)
    return found.layers if found else ()


def protected_room(
    budget: int,
    policy: str = "default",
    *,
    sinks: int,
    window: Optional[int] = None,
    slack: Optional[int] = None,
    pinned: Sequence[tuple[int, int]] = (),
    storage: KVStorage = DTYPE,
) -> int:
    """Entries a budget must exceed to evict anything: sinks + window + pinned + slack.

    ``window``/``slack`` of ``None`` take the cache's budget-scaled defaults (the policy's
    recent window); a quantized cache's full-precision window is never evicted either.
    The rule is :func:`mlxevict.room.room_needed`, the one the cache checks when it is made.
    """
    window = default_window(budget, make_policy(policy)) if window is None else window
    if storage.quantized:
        window = max(window, full_window(budget, storage.full_precision_window) + storage.held_extra)
    slack = default_slack(budget) if slack is None else slack
    return room_needed(sinks, window, slack, sum(end - start for start, end in pinned))


def plan_cache(
    model_or_config: Any,
    budget: "int | str | BudgetRequest | None" = None,
    storage: Optional[KVStorage] = None,
    *,
    available: Optional[int] = None,
    eight_bit_layers: Optional[Sequence[int]] = None,
    expected_tokens: Optional[int] = None,
) -> CachePlan:
    """Tokens and storage for a budget on a model: the one place this is decided.

    Args:
        model_or_config: a loaded model, its ``ModelArgs``, a config dict or a model folder.
        budget: tokens (``2048`` or ``"2048"``), KV memory for all layers (``"1.5GB"``), ``"auto"``
            (a quarter of the free memory), a :class:`~mlxevict.budget.BudgetRequest`, or ``None``
            (the default budget, 2048 tokens).
        storage: how to store the entries; ``None``: the model's dtype for a budget in tokens,
            :func:`memory_storage` for one in memory.
        available: free bytes for ``auto``; default what the system has available now.
        eight_bit_layers: for :func:`memory_storage`'s precision tiers; ``None``: the layers of the model's
            calibration (:func:`~mlxevict.calibrate.find_calibration`; a model or its folder), else none.
        expected_tokens: the tokens the cache will see (prompt and answer; ``None``: the model's context),
            which decides whether ``eight_bit_layers`` are worth their bytes (:func:`memory_storage`).

    Returns:
        A :class:`CachePlan`; a budget beyond the model's context is capped there, with a note
        (none for the default budget), except with precision tiers (``storage.low_bits``), whose
        budget counts the bytes they may hold.

    Raises:
        MlxEvictError: a budget that is not one, or memory that holds no token.
        ValueError: a storage the model cannot use (its group size does not divide the head dim).
    """
    request = parse_budget(budget)
    limit = context_limit(model_or_config)
    if storage is None and request.tokens is None:
        if eight_bit_layers is None:
            eight_bit_layers = calibrated_layers(model_or_config)
        storage = memory_storage(request, model_or_config, limit, available, eight_bit_layers, expected_tokens)
    if storage is None:
        storage = DTYPE
    shape = kv_shape(model_or_config)
    storage.check_head_dim(shape.head_dim)
    tokens = budget_tokens(request, model_or_config, storage, available=available, context_limit=limit)
    if tokens < 1:
        raise MlxEvictError(
            f"--budget {request.text} holds no token of this model's KV ({shape.storage_bytes(storage)} bytes per "
            "token); give more memory or a number of tokens"
        )
    notes: list[str] = []
    if limit and tokens > limit and not storage.low_bits:
        # The cache can never hold more than the context; a larger budget would only reserve memory. Not so
        # with precision tiers: their budget is entries at the low tier's bytes, and bytes beyond the context's
        # keep entries in the high tier (docs/tiers.md), so a budget in memory is spent whole.
        if not request.default:
            notes.append(
                f"--budget {request.text} is {tokens} tokens, more than the model's context of {limit}; using {limit}"
            )
        tokens = limit
    return CachePlan(tokens, storage, limit, request, tuple(notes))

