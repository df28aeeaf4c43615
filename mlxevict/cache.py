"""``EvictingKVCache``: KV storage that a policy keeps under a budget.

The cache speaks mlx-lm's cache protocol, so any supported model takes it in
place of ``KVCache``. Storage grows in steps of 256 slots, as ``KVCache`` does,
up to ``budget`` slots, then stays flat: when new tokens would not fit in the
budget, the policy's scores pick the entries to keep, and the kept entries are
gathered to the front in time order (compiled kernels). So the cache never holds
more slots than a full cache at the same length, nor ``budget`` entries; shapes
change only once per 256 tokens (the compiled kernels trace once per capacity,
not per step).
``offset`` stays the absolute position (RoPE needs it); ``size()`` is the number
of stored entries.

Eviction happens *before* a chunk is appended, using statistics the policy
collected from earlier queries; it frees ``slack`` extra entries so the next
``slack`` tokens append without another compaction.

The class is made of parts, one module each: the slots beside the storage and
their growth (:mod:`mlxevict.cache_slots`), what is kept and the compaction step
(:mod:`mlxevict.eviction`), save and load (:mod:`mlxevict.cache_state`); the
budget's defaults and the room it must leave to evict are :mod:`mlxevict.room`'s.
This module keeps the constructor, mlx-lm's protocol and the policy's statistics.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_causal_mask

from .cache_slots import GROW_STEP, CacheSlots
from .cache_state import CacheState
from .defaults import DEFAULT_BUDGET, DEFAULT_SINKS, DEFAULT_WINDOW  # noqa: F401 (read from here too)
from .dense_storage import DenseStorage
from .distributed import UNSHARDED, Shard
from .eviction import CacheEviction
from .pins import Pins
from .policies import Policy, make_policy
from .quantized_storage import QuantizedStorage
from .queries import PENDING_LIMIT, QueryLog
from .room import check_budget, check_room, default_slack, default_window

PROMPT_MODES = ("evict", "compress")


NOT_PATCHED = (
    "this cache is driven by a model that mlxevict has not patched: its attention would not feed the "
    "policy (or read quantized storage), and the output would silently differ; call mlxevict.patch(model) "
    "first, or load a saved cache with mlxevict.load_cache(path, model)"
)


class EvictingKVCache(CacheSlots, CacheEviction, CacheState, _BaseCache):
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
        self.storage = DenseStorage() if storage is None else storage
        check_room(budget, sinks, window, slack, self.pinned_tokens, self.storage.protected)
        self.budget, self.sinks, self.window, self.slack = budget, sinks, window, slack
        self.prompt_mode = prompt_mode
        self.step = GROW_STEP
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

    # The constructor that loading a saved state rebuilds with (CacheState._restore), whichever subclass loads it.
    _build = __init__

    # ---- mlx-lm protocol -------------------------------------------------
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
        if self.storage.demotes:
            self._demote(self.storage.to_demote(self._size))  # the bytes back within the budget's
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
        if self.queries.add(queries, self.offset, self.first_query_read):
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
