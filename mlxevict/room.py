"""The room a budget leaves to evict: the budget-scaled defaults, and the one rule that checks them.

The defaults: the recent window (:func:`default_window`, the policy's share), the slack
(:func:`default_slack`) and a quantized cache's full-precision window (:func:`full_window`,
which the planner and the byte counts of :mod:`mlxevict.budget` read too).

An evicting cache never drops its sinks, its recent window (or a window its storage
holds apart, such as a quantized cache's full-precision tokens) or its pinned spans
(:func:`protected`), and each eviction frees ``slack`` entries more. So a budget must
exceed :func:`room_needed`, sinks + window + pinned + slack, to evict anything.
:func:`check_room` is that rule with its messages: the cache calls it when it is made
and when a span is pinned; the planner's :func:`mlxevict.plan.protected_room` (what
the benchmarks ask before they make a cache) fills in the defaults and calls
:func:`room_needed`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .defaults import DEFAULT_WINDOW

if TYPE_CHECKING:
    from .policies import Policy

DEFAULT_SLACK = 16  # at most; never more than budget // 16 unless asked
# Most tokens the patched model feeds a cache per call (mlxevict.patch splits longer prompts): bounds
# the (S x C) attention statistics, and says how soon an eviction can come (eviction.first_query_read).
STATS_CHUNK = 256


def default_window(budget: int, policy: Optional[Policy] = None) -> int:
    """Recent positions kept when no ``window`` is given: the policy's share of the budget, capped."""
    if policy is not None and policy.recent_window is not None:
        cap, divisor = policy.recent_window
        return max(1, min(cap, budget // divisor))
    return max(1, min(DEFAULT_WINDOW, budget // 8))


def full_window(budget: int, full_precision_window: Optional[int] = None) -> int:
    """A quantized cache's full-precision window at ``budget``: the one given, else the usual recent
    window (:func:`default_window` without a policy, whatever the cache's policy)."""
    return default_window(budget) if full_precision_window is None else full_precision_window


def default_slack(budget: int) -> int:
    return min(DEFAULT_SLACK, budget // 16)


def check_budget(budget: int) -> None:
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise ValueError(f"budget={budget!r} must be a positive number of tokens")


def protected(sinks: int, window: int, pinned_tokens: int = 0) -> int:
    """Entries no eviction drops: the sinks, the recent window and the pinned tokens."""
    return sinks + window + pinned_tokens


def room_needed(sinks: int, window: int, slack: int, pinned_tokens: int = 0) -> int:
    """Entries a budget must exceed to evict anything: :func:`protected` + ``slack``."""
    return protected(sinks, window, pinned_tokens) + slack


def check_room(
    budget: int, sinks: int, window: int, slack: int, pinned_tokens: int = 0, storage_window: int = 0
) -> None:
    """Raise a ``ValueError`` that says what to change when ``budget`` leaves no room to evict.

    Args:
        budget: entries per layer (a positive int).
        sinks, window, slack: the cache's settings (each ``>= 0``).
        pinned_tokens: tokens in pinned spans.
        storage_window: newest tokens the storage holds apart and never lets go while there
            (a quantized cache's ``full_precision_window``; 0 for dense storage).
    """
    check_budget(budget)
    for name, value in (("sinks", sinks), ("window", window), ("slack", slack)):
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0")
    needed = room_needed(sinks, window, slack, pinned_tokens)
    if budget <= needed:
        what = "sinks + window" + (" + pinned" if pinned_tokens else "") + " + slack"
        raise ValueError(
            f"budget={budget} leaves no room to evict: {what} = {needed}; raise --budget or lower --window/--sinks"
        )
    needed = room_needed(sinks, storage_window, slack, pinned_tokens)
    if storage_window > window and budget <= needed:
        raise ValueError(
            f"full_precision_window={storage_window} leaves no room to evict at budget={budget}: "
            f"sinks + full_precision_window + slack = {needed} (full-precision tokens are never "
            "evicted); lower full_precision_window or raise --budget"
        )
