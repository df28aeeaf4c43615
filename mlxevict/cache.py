"""``EvictingKVCache``: KV storage that a policy keeps under a budget.

The cache speaks mlx-lm's cache protocol, so any supported model takes it in
place of ``KVCache``. Storage grows in steps (256 slots, as ``KVCache`` does, or
a sixteenth of the budget for budgets over 4096) up to ``budget`` slots, then
stays flat: when new tokens would not fit in the budget, the policy's scores pick
the entries to keep, and the kept entries are gathered to the front in time order
(compiled kernels). So KV memory never exceeds a full cache's by more than one
step, nor ``budget`` entries, and shapes change only at those few fixed
capacities (the compiled kernels trace once per capacity, not per step).
``offset`` stays the absolute position (RoPE needs it); ``size()`` is the number
of stored entries.

Eviction happens *before* a chunk is appended, using statistics the policy
collected from earlier queries; it frees ``slack`` extra entries so the next
``slack`` tokens append without another compaction.
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_causal_mask

from .defaults import DEFAULT_BUDGET, DEFAULT_SINKS, DEFAULT_WINDOW  # noqa: F401 (read from here too)
from .channel_storage import ChannelStorage
from .dense_storage import DenseStorage, fit_slots
from .distributed import UNSHARDED, Shard
from .kernels import compact_compiled, priority_compiled
from .pins import Pins
from .policies import Policy, make_policy
from .quantized_storage import QuantizedStorage
from .queries import PENDING_LIMIT, QueryLog

DEFAULT_SLACK = 16  # at most; never more than budget // 16 unless asked
GROW_STEP = 256  # slots storage grows by, as mlx-lm's KVCache
MAX_CAPACITIES = 16  # most capacities an evicting cache passes through: bounds the kernels' traces
PROMPT_MODES = ("evict", "compress")


def default_window(budget: int, policy: Policy | None = None) -> int:
    """Recent positions kept when no ``window`` is given: the policy's share of the budget, capped."""
    if policy is not None and policy.recent_window is not None:
        cap, divisor = policy.recent_window
        return max(1, min(cap, budget // divisor))
    return max(1, min(DEFAULT_WINDOW, budget // 8))


def default_slack(budget: int) -> int:
    return min(DEFAULT_SLACK, budget // 16)


def grow_step(budget: int) -> int:
    """Slots an evicting cache of ``budget`` grows by: ``GROW_STEP``, or more so it grows at most 16 times."""
    return GROW_STEP * max(1, -(-budget // (GROW_STEP * MAX_CAPACITIES)))


def storage_from_meta(meta: dict[str, Any]) -> Any:
    """The storage component a saved cache's metadata describes (quantized ones save ``kv_bits``)."""
    if meta.get("key_group"):
        return ChannelStorage.from_meta(meta)
    return DenseStorage() if meta.get("kv_bits") is None else QuantizedStorage.from_meta(meta)


def check_budget(budget: int) -> None:
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise ValueError(f"budget={budget!r} must be a positive number of tokens")


def validate_budget(budget: int, sinks: int, window: int, slack: int, pinned_tokens: int = 0) -> None:
    """Raise a ``ValueError`` that says what to change when the numbers cannot work."""
    check_budget(budget)
    for name, value in (("sinks", sinks), ("window", window), ("slack", slack)):
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0")
    protected = sinks + window + pinned_tokens
    if budget <= protected + slack:
        what = "sinks + window" + (" + pinned" if pinned_tokens else "") + " + slack"
        raise ValueError(
            f"budget={budget} leaves no room to evict: {what} = {protected + slack}; "
            "raise --budget or lower --window/--sinks"
        )


NOT_PATCHED = (
    "this cache is driven by a model that mlxevict has not patched: its attention would not feed the "
    "policy (or read quantized storage), and the output would silently differ; call mlxevict.patch(model) "
    "first, or load a saved cache with mlxevict.load_cache(path, model)"
)


class EvictingKVCache(_BaseCache):
    """A KV cache that holds at most ``budget`` entries, evicting by a policy.

    How entries are held is its ``storage`` component: :class:`~mlxevict.dense_storage.DenseStorage`
    (the model's dtype, the default) or :class:`~mlxevict.quantized_storage.QuantizedStorage`
    (``make_cache(..., kv_bits=8)``, which builds a
    :class:`~mlxevict.quantized.QuantizedEvictingKVCache`). The cache decides which
    slots are kept; the storage holds them.

    Args:
        policy: a registry name (``"entropy"``, ``"uncertainty"``, ``"window"``,
            ``"h2o"``, ``"tova"``, ``"snapkv"``, ``"rkv"``, ``"knorm"``,
            ``"random"``, ``"full"``, ``"default"``) or a :class:`Policy`.
        budget: most entries held (per layer and kv-head). Default 2048.
        sinks: first positions always kept (attention sinks). Default 4.
        window: most recent positions always kept. Default ``min(32, budget // 8)``
            (``anchored``, the default policy: ``min(64, budget // 4)``).
        slack: extra entries freed per eviction, so compaction runs once per
            ``slack + 1`` tokens. 0 evicts every step. Default ``min(16, budget // 16)``.
        prompt_mode: ``"evict"`` keeps the budget during prefill (memory stays
            flat); ``"compress"`` holds the whole prompt and compresses it to the
            budget when decoding starts (kvpress style, needs prompt-sized memory).
        pinned: absolute ``(start, end)`` spans always kept, e.g. the user prompt.
        storage: a fresh storage component; default :class:`DenseStorage`.
        policy_kwargs: arguments for the policy class.
    """

    shard: Shard = UNSHARDED  # the block of KV heads this rank holds (make_cache sets it under mlx.launch)

    def __init__(
        self,
        policy: str | Policy = "default",
        budget: int = DEFAULT_BUDGET,
        *,
        sinks: int = DEFAULT_SINKS,
        window: int | None = None,
        slack: int | None = None,
        prompt_mode: str = "evict",
        pinned: Sequence[tuple[int, int]] = (),
        storage: DenseStorage | QuantizedStorage | None = None,
        **policy_kwargs: Any,
    ):
        self.policy_name = policy if isinstance(policy, str) else policy.name
        self.policy = make_policy(policy, **policy_kwargs) if isinstance(policy, str) else policy
        if prompt_mode not in PROMPT_MODES:
            raise ValueError(f"prompt_mode={prompt_mode!r}; choose one of {PROMPT_MODES}")
        self.pins = Pins(pinned, pin_prompt=bool(self.policy.pins_prompt))
        check_budget(budget)
        window = default_window(budget, self.policy) if window is None else window
        slack = default_slack(budget) if slack is None else slack
        validate_budget(budget, sinks, window, slack, self.pinned_tokens)
        self.storage = DenseStorage() if storage is None else storage
        self.storage.check_budget(budget, sinks + self.pinned_tokens + slack, window)
        self.budget, self.sinks, self.window, self.slack = budget, sinks, window, slack
        self.prompt_mode = prompt_mode
        self.step = grow_step(budget) if self.policy.evicts else GROW_STEP
        # Slots appended since positions/stats were last read: (first slot, first position,
        # count). Written in one go on the next read, not one scatter per token.
        self._fresh: tuple[int, int, int] | None = None
        self._positions: mx.array | None = None
        self._stats: mx.array | None = None
        self.queries = QueryLog(self.policy)
        self.scale = 1.0
        self.offset = 0  # absolute position: tokens seen so far
        # Set by the patched model's call (mlxevict.patch); a cache loaded or built apart from a
        # patched model refuses to run until one drives it.
        self.model_patched = False
        self._size = 0  # entries stored
        self.evictions = 0
        self._last_budget = budget

    # ---- per-slot bookkeeping ---------------------------------------------
    @property
    def positions(self) -> mx.array | None:
        """``(B, H, C)`` absolute position of each slot, -1 if empty."""
        self._write_fresh()
        return self._positions

    @positions.setter
    def positions(self, value: mx.array | None) -> None:
        self._write_fresh()
        self._positions = value

    @property
    def stats(self) -> mx.array | None:
        """``(B, H, C)`` float32 per-slot statistics a policy keeps (0 for new slots)."""
        self._write_fresh()
        return self._stats

    @stats.setter
    def stats(self, value: mx.array | None) -> None:
        self._write_fresh()
        self._stats = value

    def _write_fresh(self) -> None:
        """Give the slots appended since the last read their positions and zero stats."""
        if self._fresh is None:
            return
        slot, position, n = self._fresh
        self._fresh = None
        self._positions[..., slot : slot + n] = mx.arange(position, position + n, dtype=mx.int32)
        self._stats[..., slot : slot + n] = 0.0

    # ---- mlx-lm protocol -------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self._positions is None else self._positions.shape[2]

    @property
    def protected_window(self) -> int:
        """The newest positions an eviction never drops (the storage may hold a window of its own)."""
        return max(self.window, self.storage.protected)

    @property
    def pinned_tokens(self) -> int:
        return self.pins.tokens

    @property
    def pinned(self) -> list[tuple[int, int]]:
        """Absolute ``(start, end)`` spans always kept (the prompt's among them)."""
        return self.pins.spans

    @property
    def max_chunk(self) -> int:
        """The longest chunk one call may append while the budget holds."""
        if not self.policy.evicts or self.prompt_mode == "compress":
            return GROW_STEP
        return self.budget - self.sinks - self.protected_window - self.pinned_tokens - self.slack

    def size(self) -> int:
        return self._size

    def empty(self) -> bool:
        return self.storage.empty()

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    def is_trimmable(self) -> bool:
        return False

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store ``(B, H, S, D)`` keys/values for ``S`` new tokens; return all kept entries."""
        if not self.model_patched:
            raise ValueError(NOT_PATCHED)
        B, H, S, D = keys.shape
        if self.storage.empty():
            self._allocate(B, H, D, values.shape[-1], keys.dtype, self._capacity_for(S))
        elif self.dense_shape[:3] != (B, H, D):
            b, h, d = self.dense_shape[:3]
            raise ValueError(
                f"this cache holds keys shaped (B={b}, H={h}, D={d}) but got (B={B}, H={H}, D={D}); "
                "it was made for another model: build a new one with mlxevict.make_cache(model)"
            )
        n_keep = self._plan(S)
        if n_keep is None and self.queries.count >= PENDING_LIMIT:
            self.flush()
        if n_keep is not None:
            self._evict(n_keep)
        if self._size + S > self.capacity:
            self._grow(self._size + S)
        start, end = self._size, self._size + S
        self.storage.write(keys, values, start)
        if self._fresh is None:
            self._fresh = (start, self.offset, S)
        else:
            self._fresh = (*self._fresh[:2], self._fresh[2] + S)
        self._size = end
        self.offset += S
        if self.prompt_mode == "compress" and S == 1 and self.policy.evicts and self.capacity > self.budget:
            self._resize(self.budget)  # the prompt is compressed: back to a fixed capacity
        return self.storage.fetch(self._size)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The causal mask for a chunk of ``N`` queries over the entries kept after this step."""
        if window_size is not None:
            raise ValueError("EvictingKVCache does not support sliding-window attention layers")
        if N == 1:
            return None
        if return_array:
            n_keep = self._plan(N)
            before = self._size if n_keep is None else n_keep
            return create_causal_mask(N, before)
        return "causal"

    @classmethod
    def merge(cls, caches):
        raise NotImplementedError(
            "EvictingKVCache cannot be batched by mlx-lm's server (batching would drop eviction); "
            "serve one request at a time"
        )

    # ---- attention statistics (called by the patched attention) ----------
    recent_queries = property(lambda self: self.queries.recent, doc="``(B, H*G, W, D)`` the newest queries.")
    recent_query_pos = property(lambda self: self.queries.recent_pos, doc="``(W,)`` their positions.")

    def observe(self, queries: mx.array, scale: float) -> None:
        """Queue the step's ``(B, H*G, S, D)`` post-RoPE queries for the policy (:mod:`mlxevict.queries`)."""
        self.scale = scale
        if self.queries.add(queries, self.offset):
            self.flush(compute=queries.shape[2] > 1)

    def feed_prediction_entropy(self, entropy: mx.array) -> None:
        """Queue ``H(p_t)`` (``(B, S)`` nats) of the step's positions for the policy."""
        self.queries.add_entropy(entropy)

    def flush(self, compute: bool = False) -> None:
        """Fold the queued queries into the policy's statistics; ``compute``: start computing them now
        (for a prompt chunk, so its queries are freed before the whole forward is evaluated)."""
        taken = self.queries.take()
        if taken is None:
            return
        queries, query_pos, entropy = taken
        if self.policy.observes:
            self.policy.observe(self, queries, query_pos)
        if self.policy.uses_prediction_entropy and entropy is not None:
            self.policy.feed_prediction_entropy(self, queries, query_pos, entropy)
        if compute:
            mx.async_eval(self._stats, self.queries.recent)

    # ---- eviction ---------------------------------------------------------
    def _plan(self, S: int) -> int | None:
        """How many entries to keep before appending ``S`` tokens, or ``None``: no eviction."""
        if not self.policy.evicts or (self.prompt_mode == "compress" and S > 1):
            return None
        compressing = self.prompt_mode == "compress" and self._size > self.budget
        if not compressing and self._size + S <= self.budget:
            return None  # storage grows (if need be) instead
        if S > self.max_chunk:
            raise ValueError(
                f"a chunk of {S} tokens does not fit budget={self.budget} with sinks={self.sinks}, "
                f"window={self.window}, slack={self.slack}; feed at most {self.max_chunk} tokens per "
                "call (mlxevict.patch splits longer prompts for you)"
            )
        self.flush()  # the policy's statistics (and effective budget) must be current
        self._last_budget = min(self.budget, self.policy.effective_budget(self.budget))
        floor = self.sinks + self.protected_window + self.pinned_tokens
        return min(self._size, max(floor, self._last_budget - S - self.slack))

    def _evict(self, n_keep: int) -> None:
        if n_keep >= self._size:
            return
        pinned = mx.array(self.pinned or [(0, 0)], dtype=mx.int32)
        rank_key = priority_compiled(
            self.policy.score(self), self.positions, mx.array(self.offset), self.sinks, self.protected_window, pinned
        )
        rank_key, n_keep = self.storage.limit_groups(rank_key, n_keep, self._size, self.budget)  # storage's bound
        self._set_slots(compact_compiled(rank_key, mx.array(n_keep), self._slots()))
        self.evictions += 1
        self._size = n_keep

    # ---- storage: the component holds the entries, the cache the per-slot bookkeeping ----
    keys = property(lambda self: self.storage.keys, doc="The storage's keys (``None`` before the first token).")
    values = property(lambda self: self.storage.values, doc="The storage's values.")
    kv_bits = property(lambda self: self.storage.kv_bits, doc="Storage bits; ``None``: the model's dtype.")
    # Quantized storage's settings and window (``None`` for dense storage), as caches of 0.1 had them.
    kv_group_size = property(lambda self: getattr(self.storage, "kv_group_size", None))
    full_precision_window = property(lambda self: getattr(self.storage, "full_precision_window", None))
    window_bits = property(lambda self: getattr(self.storage, "window_bits", None))
    kv_rotate = property(lambda self: getattr(self.storage, "kv_rotate", False))
    key_bits = property(lambda self: getattr(self.storage, "key_bits", None))
    value_bits = property(lambda self: getattr(self.storage, "value_bits", None))
    rotation = property(lambda self: getattr(self.storage, "rotation", None))
    n_full = property(lambda self: getattr(self.storage, "n_full", 0))
    fp_keys = property(lambda self: getattr(self.storage, "fp_keys", None))
    fp_values = property(lambda self: getattr(self.storage, "fp_values", None))

    @property
    def dense_keys(self) -> mx.array:
        """``(B, H, C, D)`` keys in the model's dtype, slot by slot: what policies score."""
        return self.storage.dense_keys(self._size, self.capacity)

    @property
    def dense_shape(self) -> tuple[int, int, int, int, mx.Dtype]:
        """``(B, H, D, Dv, dtype)`` of the keys and values as the model made them."""
        return self.storage.shape

    def _slots(self) -> list[mx.array]:
        """Every per-slot array, ``positions`` first: what compaction gathers."""
        return [self.positions, *self.storage.slots(), self.stats]

    def _set_slots(self, arrays: list[mx.array]) -> None:
        self.positions, self.stats = arrays[0], arrays[-1]
        self.storage.set_slots(arrays[1:-1])

    def _allocate(self, B: int, H: int, D: int, Dv: int, dtype: mx.Dtype, capacity: int) -> None:
        self.storage.allocate(B, H, D, Dv, dtype, capacity)
        self.positions = mx.full((B, H, capacity), -1, mx.int32)
        self.stats = mx.zeros((B, H, capacity), mx.float32)

    def _resize(self, capacity: int) -> None:
        self.storage.resize(capacity)
        self.positions, self.stats = fit_slots(self.positions, capacity, -1), fit_slots(self.stats, capacity, 0)

    def _capacity_for(self, needed: int) -> int:
        """Slots to hold ``needed`` entries: whole steps, and no more than the budget while it holds them."""
        capacity = -(-needed // self.step) * self.step
        if self.policy.evicts and needed <= self.budget:
            capacity = min(capacity, self.budget)
        return capacity

    def _grow(self, needed: int) -> None:
        self._resize(self._capacity_for(needed))

    # ---- save / load ------------------------------------------------------
    @property
    def meta_state(self) -> str:
        return json.dumps(self._meta())

    @meta_state.setter
    def meta_state(self, text: str) -> None:
        self._restore(json.loads(text))

    def _meta(self) -> dict[str, Any]:
        """Settings and host-side counters, JSON-serialisable."""
        return {
            "policy": self.policy_name,
            "policy_config": self.policy.config(),
            "policy_state": self.policy.runtime_state(),
            "budget": self.budget,
            "sinks": self.sinks,
            "window": self.window,
            "slack": self.slack,
            "prompt_mode": self.prompt_mode,
            "offset": self.offset,
            "size": self._size,
            "evictions": self.evictions,
            "scale": self.scale,
            **self.pins.meta(),
            **self.storage.meta(),
        }

    def _restore(self, meta: dict[str, Any]) -> None:
        """Rebuild from :meth:`_meta`, the storage too (whichever class loads it)."""
        EvictingKVCache.__init__(
            self,
            meta["policy"],
            meta["budget"],
            sinks=meta["sinks"],
            window=meta["window"],
            slack=meta["slack"],
            prompt_mode=meta["prompt_mode"],
            pinned=[tuple(p) for p in meta["pinned"]],
            storage=storage_from_meta(meta),
            **meta["policy_config"],
        )
        self.policy.load_runtime_state(meta["policy_state"])
        self.offset, self._size = meta["offset"], meta["size"]
        self.evictions, self.scale = meta["evictions"], meta["scale"]
        self.pins.restore(meta, self.offset)

    @property
    def state(self):
        # mlx-lm's save_prompt_cache stores only ``state``, so the metadata rides along.
        # (keys, values, positions, stats, recent queries, their positions, metadata): the layout of 0.1.
        self.flush()
        queries = (self.queries.recent, self.queries.recent_pos)
        return (*self.storage.state, self.positions, self.stats, *queries, self.meta_state)

    @state.setter
    def state(self, v) -> None:
        self.meta_state = v[6]  # rebuilds the storage its metadata names
        self.storage.state = v[0], v[1]
        self.positions, self.stats = v[2], v[3]
        self.queries.recent, self.queries.recent_pos = v[4:6]

    def feed_prompt(self, S: int) -> None:
        """Pin the prompt as it arrives (:class:`~mlxevict.pins.Pins`): the patched model calls this
        before each call of ``S`` tokens; a prompt too long to pin is named once, when it ends."""
        room = self.budget - self.sinks - self.protected_window - self.slack
        warning = self.pins.feed_prompt(self.offset, S, room)
        if warning:
            warnings.warn(warning, stacklevel=2)

    def pin(self, start: int, end: int) -> None:
        """Always keep absolute positions ``[start, end)`` from now on (e.g. the user prompt)."""
        validate_budget(
            self.budget, self.sinks, self.protected_window, self.slack, self.pinned_tokens + max(0, end - start)
        )
        self.pins.add(start, end)
