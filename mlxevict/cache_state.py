"""The evicting cache's saved state: what mlx-lm's ``save_prompt_cache`` writes and ``load_prompt_cache`` reads.

mlx-lm saves a cache's ``state`` (arrays) and rebuilds it by class name with
``from_state`` (:mod:`mlxevict.register` makes the names findable). The settings
and host-side counters ride along as JSON, last in ``state``: the layout of 0.1,
so caches saved then still load. Loading rebuilds the storage the metadata names
(dense, or quantized with its bits), whichever class loads it.
"""

from __future__ import annotations

import json
from typing import Any

from .channel_storage import ChannelStorage
from .dense_storage import DenseStorage
from .paged_storage import PagedStorage
from .quantized_storage import QuantizedStorage
from .tiered_storage import TieredStorage


def storage_from_meta(meta: dict[str, Any]) -> Any:
    """The storage component a saved cache's metadata describes (quantized ones save ``kv_bits``)."""
    if "paged" in meta:
        return PagedStorage.from_meta(meta)
    if meta.get("low_bits"):
        return TieredStorage.from_meta(meta)
    if meta.get("key_group"):
        return ChannelStorage.from_meta(meta)
    return DenseStorage() if meta.get("kv_bits") is None else QuantizedStorage.from_meta(meta)


class CacheState:
    """Save and load of :class:`~mlxevict.cache.EvictingKVCache` (a part of the cache, not a cache of its own).

    Loading calls the cache's ``_build``: the evicting cache's own constructor, whichever
    subclass (``QuantizedEvictingKVCache``) loads the state.
    """

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
        self._build(
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
