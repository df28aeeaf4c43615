"""Storage variants measured before they are built: simulated (fake-quantized) KV storage.

Each variant keeps a dense cache and replaces every entry by its quantized-then-
dequantized value (``mx.quantize`` / ``mx.dequantize``) at the moment the real storage
would quantize it, so attention sees exactly the values the storage would return; the
bytes are those the storage would hold as a 16-bit model (packed bits plus a 16-bit
scale and bias per group). Variants (the evidence: ``docs/results/long/README.md``):

- ``sim-k5v3w8``: the product's layout (keys 5 bits, values 3, per token in groups of
  64 channels, rotated; the newest 32 tokens in 8 bits), to check the simulation;
- ``kivi-*``: keys quantized per channel over groups of G tokens (KIVI, Liu et al. 2024,
  https://arxiv.org/abs/2402.02750), unrotated; values per token, rotated; the
  newest 32 tokens and an unfinished key group stay in 8 bits;
- ``tiers-*``: precision tiers chosen by the policy's score (MiKV, "No Token Left
  Behind", Yang et al. 2024, https://arxiv.org/abs/2402.18096): entries leave the
  window in 8 bits; when the bytes run out, the lowest-scored 8-bit entries are
  demoted to the low tier; the policy evicts only when every entry in the low tier
  still would not fit;
- ``kivi-tiers``: the tiers over keys per channel: entries leave the window in KIVI 5/3 (the high
  tier), and the lowest-scored are demoted to KIVI 3/2 (keys re-quantized per channel over the
  same group of tokens, values to 2 bits) before any is evicted;
- ``sim-k3v2w8``: the low tier alone (what the tiers add to); ``kivi-k3v2``: the same with keys per channel;
- ``*-pre`` (``kivi-k3v2-pre``, ``kivi-tiers-pre``): keys per channel quantized before RoPE (KVQuant,
  https://arxiv.org/abs/2401.18079), for models with a plain ``nn.RoPE`` (docs/tiers.md: no gain measured).

The policy is mlxevict's default for every variant. The entries and their tier mask are
a storage component (:class:`SimulatedStorage`, a ``DenseStorage`` with a ``low`` slot
array); :class:`SimulatedStorageCache` adds the window's settling and the demotion after
each step: an experiment, not the product's storage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

import mlxevict
from mlxevict.cache import EvictingKVCache
from mlxevict.dense_storage import DenseStorage, fit_slots

WINDOW = 32  # newest tokens in 8 bits, as the product's 5/3 storage
TOKEN_GROUP = 64  # channels per scale for per-token quantization
DEMOTE_MARGIN = 16  # demote this many extra entries at once, so demotion runs once per ~16 tokens


@dataclass(frozen=True)
class StorageSpec:
    """How a simulated storage holds keys and values.

    ``key_group``: tokens per scale for per-channel keys (KIVI), ``None`` for per-token keys.
    ``tiers``: keep entries in the high tier while the bytes allow, demoting by score (MiKV).
    ``high``: the high tier's ``(key bits, value bits)``, laid out as the low tier; ``None``: 8 bits per token.
    ``pre_rope``: keys per channel are quantized before RoPE (KVQuant, Hooper et al. 2024,
    https://arxiv.org/abs/2401.18079): RoPE's position is taken out, the group quantized, and put back.
    """

    key_bits: int
    value_bits: int
    key_group: int | None = None
    tiers: bool = False
    high: tuple[int, int] | None = None
    pre_rope: bool = False

    def _entry_bytes(self, key_bits: int, value_bits: int, head_dim: int) -> float:
        keys = token_bytes(key_bits, head_dim)
        if self.key_group:
            keys = head_dim * key_bits / 8 + head_dim * 4 / self.key_group
        return keys + token_bytes(value_bits, head_dim)

    def bytes_per_token(self, head_dim: int) -> dict[str, float]:
        """Bytes per token and kv-head (16-bit model): the low tier, the high tier, 8 bits, and 16 bits."""
        eight = 2 * token_bytes(8, head_dim)
        high = self._entry_bytes(*self.high, head_dim) if self.high else eight
        return {"low": self._entry_bytes(self.key_bits, self.value_bits, head_dim), "high": high, "8bit": eight, "16bit": 4 * head_dim}

    @property
    def held_back(self) -> int:
        """Newest tokens never quantized below 8 bits: the window, plus an unfinished key group."""
        return WINDOW + (self.key_group or 0)


VARIANTS = {
    "tiers-k3v2": StorageSpec(3, 2, tiers=True),
    "kivi-k5v3": StorageSpec(5, 3, key_group=64),
    "sim-k5v3w8": StorageSpec(5, 3),
    "kivi-k2v2": StorageSpec(2, 2, key_group=32),
    "kivi-tiers": StorageSpec(3, 2, key_group=64, tiers=True, high=(5, 3)),
    "sim-k3v2w8": StorageSpec(3, 2),
    "kivi-k3v2": StorageSpec(3, 2, key_group=64),
    "kivi-k3v2-pre": StorageSpec(3, 2, key_group=64, pre_rope=True),
    "kivi-tiers-pre": StorageSpec(3, 2, key_group=64, tiers=True, high=(5, 3), pre_rope=True),
}


def token_bytes(bits: int, head_dim: int) -> float:
    """One token's vector of ``head_dim`` values at ``bits``, per-token groups of 64, 16-bit scale and bias."""
    return head_dim * bits / 8 + math.ceil(head_dim / TOKEN_GROUP) * 4


def hadamard(n: int) -> mx.array:
    """The ``n x n`` orthonormal Sylvester–Hadamard matrix (``n`` a power of two)."""
    h = mx.ones((1, 1))
    while h.shape[0] < n:
        h = mx.concatenate([mx.concatenate([h, h], 1), mx.concatenate([h, -h], 1)], 0)
    return h / math.sqrt(n)


def fake_quant(x: mx.array, bits: int, group: int = TOKEN_GROUP, rotation: mx.array | None = None) -> mx.array:
    """``x`` ``(..., D)`` quantized per token in groups of ``group`` channels and dequantized back."""
    if rotation is not None:
        x = x @ rotation
    w, s, b = mx.quantize(x, group_size=group, bits=bits)
    y = mx.dequantize(w, s, b, group_size=group, bits=bits).astype(x.dtype)
    return y @ rotation.T if rotation is not None else y


def fake_quant_channels(x: mx.array, bits: int) -> mx.array:
    """``x`` ``(B, H, G, D)``: each channel quantized over the ``G`` tokens, dequantized back."""
    return fake_quant(x.swapaxes(-1, -2), bits, group=x.shape[-2]).swapaxes(-1, -2)


class SimulatedStorage(DenseStorage):
    """Dense storage whose entries arrive fake-quantized to 8 bits, with a per-slot low-tier mask.

    ``low`` ``(B, H, C)`` is True where an entry is in the low tier; it is one of the
    :meth:`slots`, so it travels with its entry through compaction and growth. With
    ``low_keys``, each slot also holds its key as the low tier would (keys per channel are
    quantized over their group when it settles, so a demotion later needs the group's rounding).
    """

    def __init__(self, head_dim: int, low_keys: bool = False) -> None:
        super().__init__()
        self.rotation = hadamard(head_dim)
        self.low: mx.array | None = None
        self.with_low_keys = low_keys
        self.low_keys: mx.array | None = None

    def allocate(self, B: int, H: int, D: int, Dv: int, dtype: mx.Dtype, capacity: int) -> None:
        super().allocate(B, H, D, Dv, dtype, capacity)
        self.low = mx.zeros((B, H, capacity), mx.bool_)
        if self.with_low_keys:
            self.low_keys = mx.zeros((B, H, capacity, D), dtype)

    def write(self, keys: mx.array, values: mx.array, start: int) -> None:
        """New entries arrive in the 8-bit window."""
        super().write(fake_quant(keys, 8), fake_quant(values, 8), start)

    def slots(self) -> list[mx.array]:
        return [*super().slots(), self.low, *([self.low_keys] if self.with_low_keys else [])]

    def set_slots(self, arrays: list[mx.array]) -> None:
        if self.with_low_keys:
            *arrays, self.low_keys = arrays
        super().set_slots(arrays[:-1])
        self.low = arrays[-1]

    def resize(self, capacity: int) -> None:
        super().resize(capacity)
        self.low = fit_slots(self.low, capacity, False)
        if self.with_low_keys:
            self.low_keys = fit_slots(self.low_keys, capacity, 0)


class SimulatedStorageCache(EvictingKVCache):
    """A dense :class:`EvictingKVCache` whose entries carry the quantization error of ``spec``.

    Its storage is a :class:`SimulatedStorage`; after each step it quantizes the entries
    that left the window and, with tiers, demotes by the policy's score.

    Args:
        spec: the storage simulated.
        memory: bytes per kv-head this layer may hold (16-bit model); sets the budget in
            entries and, with tiers, how many entries stay in the high tier.
        head_dim: the model's head dimension.
        policy, kwargs: as :class:`EvictingKVCache` (``budget``, ``window`` and ``storage`` are set here).
    """

    def __init__(self, spec: StorageSpec, memory: float, head_dim: int, policy: str = "default",
                 rope: nn.Module | None = None, **kwargs: Any):  # fmt: skip
        if spec.pre_rope and not all(hasattr(rope, a) for a in ("dims", "traditional", "base", "scale")):
            raise ValueError("a pre-RoPE storage variant needs the model's RoPE (a plain mlx.nn.RoPE)")
        self.spec, self.memory, self.rope = spec, memory, rope
        self.cost = spec.bytes_per_token(head_dim)
        budget = entries_for(spec, memory, head_dim)
        storage = SimulatedStorage(head_dim, low_keys=bool(spec.tiers and spec.key_group))
        super().__init__(policy, budget, window=spec.held_back, storage=storage, **kwargs)
        self.done = 0  # positions below this have left the window and hold their stored precision

    low = property(lambda self: self.storage.low, doc="``(B, H, C)`` True where an entry is in the low tier.")
    # Demotion scores entries long before any eviction, so every query is kept for the policy.
    first_query_read = -1

    # ---- the step ----------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        super().update_and_fetch(keys, values)  # the storage writes new entries in 8 bits
        self._settle()
        if self.spec.tiers:
            self._demote()
        if self.storage.with_low_keys:  # read only when demoting: unevaluated, its updates would pile up
            mx.async_eval(self.storage.low_keys)
        return self.storage.fetch(self._size)

    def _slot(self, position: int) -> int:
        """The slot of ``position``: every position since ``done`` is held, in order, at the end."""
        return self._size - (self.offset - position)

    def _settle(self) -> None:
        """Quantize the entries that left the window (keys per channel: whole groups only)."""
        spec, limit, st = self.spec, self.offset - WINDOW, self.storage
        group = spec.key_group or max(limit - self.done, 0)
        while group and self.done + group <= limit:
            a, b = self._slot(self.done), self._slot(self.done + group)
            if spec.tiers:
                key_bits, value_bits = spec.high or (8, 8)
            else:
                key_bits, value_bits = spec.key_bits, spec.value_bits
            keys = st.keys[..., a:b, :]
            if spec.tiers and not spec.high:  # the high tier: 8 bits per token until demoted
                st.keys[..., a:b, :] = fake_quant(keys, 8)
            elif spec.key_group:
                st.keys[..., a:b, :] = self._channels(keys, key_bits)
                if spec.tiers:  # the low tier's key, rounded over the same group
                    st.low_keys[..., a:b, :] = self._channels(keys, spec.key_bits)
            else:
                st.keys[..., a:b, :] = fake_quant(keys, key_bits, rotation=self.rotation)
            st.values[..., a:b, :] = fake_quant(st.values[..., a:b, :], value_bits, rotation=self.rotation)
            if not spec.tiers:
                st.low[..., a:b] = True
            self.done += group

    def _channels(self, keys: mx.array, bits: int) -> mx.array:
        """The group of keys from position ``done`` quantized per channel (before RoPE with ``pre_rope``)."""
        if not self.spec.pre_rope:
            return fake_quant_channels(keys, bits)
        r = self.rope
        turn = lambda x, sign: mx.fast.rope(  # noqa: E731
            x, r.dims, traditional=r.traditional, base=r.base, scale=sign * r.scale, offset=self.done
        )
        return turn(fake_quant_channels(turn(keys, -1.0), bits), 1.0)

    def high_allowed(self) -> int:
        """Entries outside the window that may stay in the high tier within ``memory``."""
        held = self.offset - self.done
        outside = self._size - held
        room = self.memory - held * self.cost["8bit"] - outside * self.cost["low"]
        return max(0, min(outside, int(room // (self.cost["high"] - self.cost["low"]))))

    def _demote(self) -> None:
        """Move the lowest-scored high-tier entries to the low tier until the bytes fit."""
        outside = self._size - (self.offset - self.done)
        allowed = self.high_allowed()
        C = self.low.shape[-1]
        candidate = (mx.arange(C) < outside) & ~self.low  # B, H, C
        count = candidate.sum(axis=-1, keepdims=True)  # B, H, 1
        if count.max().item() <= allowed:
            return
        self.flush()
        score = mx.where(candidate, self.policy.score(self), mx.inf)  # B, H, C
        rank = mx.argsort(mx.argsort(score, axis=-1), axis=-1)
        demote = candidate & (rank < count - max(allowed - DEMOTE_MARGIN, 0))
        spec, rot = self.spec, self.rotation
        st = self.storage
        low_keys = st.low_keys if spec.key_group else fake_quant(st.keys, spec.key_bits, rotation=rot)
        st.keys = mx.where(demote[..., None], low_keys, st.keys)
        st.values = mx.where(demote[..., None], fake_quant(st.values, spec.value_bits, rotation=rot), st.values)
        st.low = st.low | demote

    def stored_bytes(self) -> float:
        """Bytes per kv-head this layer's storage would hold now (16-bit model)."""
        held = self.offset - self.done
        low = int(self.low[..., : self._size].sum(axis=-1).max().item())
        high = self._size - held - low
        return held * self.cost["8bit"] + high * self.cost["high"] + low * self.cost["low"]


def entries_for(spec: StorageSpec, memory: float, head_dim: int) -> int:
    """Most entries per kv-head ``memory`` bytes hold with ``spec`` (the window in 8 bits, the rest low)."""
    cost = spec.bytes_per_token(head_dim)
    return spec.held_back + int((memory - spec.held_back * cost["8bit"]) // cost["low"])


def head_dim_of(model: nn.Module) -> int:
    args = model.args
    return getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads


def make_simulated(model: nn.Module, name: str, fraction: float, context: int, **kwargs: Any) -> list[SimulatedStorageCache]:
    """One simulated cache per layer holding ``fraction`` of a 16-bit full cache's bytes at ``context``.

    Raises:
        ValueError: an unknown variant name, or a budget below the window.
    """
    if name not in VARIANTS:
        raise ValueError(f"unknown storage variant {name!r}; choose from {', '.join(VARIANTS)}")
    D = head_dim_of(model)
    spec = VARIANTS[name]
    memory = fraction * context * spec.bytes_per_token(D)["16bit"]
    rope = getattr(model.layers[0].self_attn, "rope", None) if spec.pre_rope else None
    caches = [SimulatedStorageCache(spec, memory, D, rope=rope, **kwargs) for _ in model.layers]
    mlxevict.patch(model)
    return caches


def simulated_fraction(caches: list[SimulatedStorageCache], context: int, head_dim: int) -> float:
    """Bytes the simulated storage holds now, as a share of a 16-bit full cache of ``context`` tokens."""
    per_head = max(c.stored_bytes() for c in caches)
    return per_head / (context * 4 * head_dim)
