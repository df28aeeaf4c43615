"""Channel storage: keys quantized per channel over groups of tokens (KIVI), values per token.

KIVI (Liu et al. 2024, https://arxiv.org/abs/2402.02750) quantizes keys per
channel: a key channel's outliers are steady over tokens, so a scale per
(channel, ``key_group`` tokens) fits them far better than a scale per token.
Values stay per token (``mx.quantize`` groups of ``kv_group_size`` channels),
rotated by :func:`mlxevict.rotation.rotation_matrix`; keys are not rotated.

Tokens arrive in 8 bits per token (rotated, as the values: ``rotate_held``) and wait there, never evicted: the
newest ``full_precision_window`` tokens and the key group not yet complete. Once
a whole group of ``key_group`` positions (``[g·G, (g+1)·G)``) is older than the
window, it is quantized **once** and never again, whatever is evicted later:

- each slot holds its key's codes packed along the channel axis (``key_bits``
  per channel, ``uint32`` words in bit planes, :func:`mlxevict.channel_codes.pack_planes`) and the row of its group in
  a table of per-(group, channel) scales and biases (model dtype, as
  ``mx.quantize``'s); both move with the slot through compaction;
- the table keeps the rows of live groups only: after a compaction, rows no slot
  uses are dropped (the next write collects them);
- values are ``mx.quantize``'s codes (in bit planes, as the keys'), scales and biases per slot.

So the bytes held are the packed codes, the row ids, the live table, the values
and the 8-bit part; :attr:`ChannelStorage.nbytes` counts exactly those arrays.
A table row costs ``4·D`` bytes (16-bit scales) whether its group keeps 64
entries or one: an eviction that leaves many groups thinly populated costs more
than the budget's estimate (``key_group`` tokens per row), see docs/storage.md.

A prompt chunk's attention dequantizes the keys and values into dense
``(B, H, N, D)`` arrays (transient copies, as the policies' ``dense_keys``) and calls
the model's fused attention; a decode step
(:func:`~mlxevict.channel_attention.channel_decode_attention`) dequantizes the quantized
keys and values in compiled kernels and reads the held 8-bit rows by quantized matmuls,
in the rotated domain where they are stored rotated. This module reproduces
``benchmarks/storage_variants.py``'s simulated ``kivi-k5v3`` (fake quantization
into a dense cache) with real storage, and is tested against it.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx

from .channel_attention import channel_decode_attention_fast, decodes_here
from .channel_codes import (
    WORD,
    channel_dequantize_compiled,
    channel_quantize,
    held_dequantize_compiled,
    planes_of,
    table_index,
    token_dequantize_compiled,
)
from .dense_storage import fit_slots
from .kernels import PROTECTED
from .kvstorage import DEFAULT_GROUP_SIZE, ROW_RESERVE, KVBits, check, key_value_bits
from .quantized_storage import quantized_zeros
from .rotation import rotation_in

HELD_BITS = 8  # the window and the unfinished key group, per token
DEMOTED = -1e30  # keep-priority of a slot whose group is over the table's rows: above empty slots, below all else


class ChannelStorage:
    """Keys per channel over ``key_group`` tokens, values per token, the newest in 8 bits; see the module docstring.

    Args:
        kv_bits: ``(key bits, value bits)`` such as ``(5, 3)`` (or one number), key bits under 8.
        kv_group_size: channels per value scale (and per 8-bit scale): 32, 64 or 128. Default 64.
        full_precision_window: the newest tokens kept in 8 bits. Default 32.
        key_group: tokens per key scale: 32, 64 or 128. Default 64.
        kv_rotate: rotate values before quantizing (keys never). Default ``True``.
        window_bits: must be 8 (the held tokens' bits); ``None`` means 8.
        rotate_held: store the 8-bit rows rotated too (with ``kv_rotate``). Default ``True``; ``False`` holds
            them as ``benchmarks/storage_variants.py``'s ``kivi-k5v3`` does.
    """

    def __init__(
        self,
        kv_bits: KVBits = (5, 3),
        kv_group_size: int = DEFAULT_GROUP_SIZE,
        full_precision_window: int = 32,
        key_group: int = 64,
        kv_rotate: Optional[bool] = None,
        window_bits: Optional[int] = HELD_BITS,
        rotate_held: bool = True,
    ):
        window_bits = HELD_BITS if window_bits is None else window_bits
        check(kv_bits, kv_group_size, full_precision_window, window_bits, key_group=key_group)
        self.kv_bits = kv_bits if isinstance(kv_bits, int) else key_value_bits(kv_bits)
        self.key_bits, self.value_bits = key_value_bits(kv_bits)
        self.kv_group_size, self.full_precision_window, self.key_group = kv_group_size, full_precision_window, key_group
        self.kv_rotate = True if kv_rotate is None else bool(kv_rotate)
        # The 8-bit rows rotated too: a key's outlier channels would make its per-token 8-bit groups coarse
        # (on SmolLM2 an unrotated 8-bit window alone changed a short answer). False: as the simulation.
        self.rotate_held = self.kv_rotate and bool(rotate_held)
        self.window_bits = window_bits
        self.keys: Optional[tuple[mx.array, ...]] = None  # (codes, rows, table scales, table biases)
        self.values: Optional[tuple[mx.array, ...]] = None  # mx.quantize's (packed, scales, biases)
        self.fp_keys: Optional[tuple[mx.array, ...]] = None  # the held tokens, 8 bits per token
        self.fp_values: Optional[tuple[mx.array, ...]] = None
        self.n_full = 0  # held tokens (newest slots): the window and the unfinished key group
        self.compacted = False  # a compaction ran since the table was last collected
        self.mx_quantize_codes = False  # a loaded state's codes are in mx.quantize's layout (see ``state``)

    @property
    def held(self) -> int:
        """Slots of the 8-bit part: the window plus an unfinished key group (at most ``key_group - 1`` more)."""
        return self.full_precision_window + self.key_group

    protected = held  # the held tokens are never evicted (the cache keeps this many newest positions)
    demotes = False  # one tier (TieredStorage demotes)

    def empty(self) -> bool:
        return self.keys is None

    # ---- layout ------------------------------------------------------------
    def _per_token(self, B: int, H: int, C: int, D: int, dtype: mx.Dtype, bits: int) -> tuple[mx.array, ...]:
        return quantized_zeros((B, H, C, D), dtype, bits, self.kv_group_size)

    def _quantized_capacity(self, capacity: int) -> int:
        """Quantized slots: every slot but the window (the unfinished group's rows need them once it is complete)."""
        return max(0, capacity - self.full_precision_window)

    def allocate(self, B: int, H: int, D: int, Dv: int, dtype: mx.Dtype, capacity: int) -> None:
        check(self.kv_bits, self.kv_group_size, head_dims=(D, Dv))
        C = self._quantized_capacity(capacity)
        table = mx.zeros((B, H, 0, D), dtype)
        self.keys = (
            mx.zeros((B, H, C, D * self.key_bits // WORD), mx.uint32),
            mx.zeros((B, H, C), mx.uint16),
            table,
            table,
        )
        self.values = self._per_token(B, H, C, Dv, dtype, self.value_bits)
        self.fp_keys = self._per_token(B, H, self.held, D, dtype, HELD_BITS)
        self.fp_values = self._per_token(B, H, self.held, Dv, dtype, HELD_BITS)

    @property
    def shape(self) -> tuple[int, int, int, int, mx.Dtype]:
        """``(B, H, D, Dv, dtype)`` of the keys and values as the model made them."""
        B, H, _, groups = self.fp_keys[1].shape
        return B, H, groups * self.kv_group_size, self.fp_values[1].shape[3] * self.kv_group_size, self.fp_keys[1].dtype

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.arrays())

    def arrays(self) -> list[mx.array]:
        """Every array the storage holds (none before the first token): what :attr:`nbytes` counts."""
        if self.keys is None:
            return []
        return [x for part in (self.keys, self.values, self.fp_keys, self.fp_values) for x in part]

    @property
    def table_rows(self) -> int:
        """Rows of the key scale table (the most live groups of any head)."""
        return 0 if self.keys is None else self.keys[2].shape[2]

    @property
    def rotation(self) -> Optional[mx.array]:
        """``None``: what :meth:`fetch` returns is not rotated (the values are rotated back when read)."""
        return None

    def _value_rotation(self, dtype: mx.Dtype) -> Optional[mx.array]:
        return rotation_in(self.shape[3], dtype) if self.kv_rotate else None

    def _held_dense(self, held: tuple[mx.array, ...], n: int) -> mx.array:
        if n == 0:  # mx.dequantize cannot take zero rows
            B, H, _, groups = held[1].shape
            return mx.zeros((B, H, 0, groups * self.kv_group_size), held[1].dtype)
        return held_dequantize_compiled(*(x[..., :n, :] for x in held), self.kv_group_size)

    # ---- write and read ------------------------------------------------------
    def write(self, keys: mx.array, values: mx.array, start: int) -> None:
        """Append ``S`` tokens (slots from ``start``) in 8 bits; quantize every key group that left the window."""
        if self.compacted:
            self._collect(start - self.n_full)
        S, n_held, G = keys.shape[2], self.n_full, self.key_group
        if self.rotate_held:
            rotation = self._value_rotation(keys.dtype)
            keys, values = keys @ rotation, values @ rotation
        fresh_k = mx.quantize(keys, group_size=self.kv_group_size, bits=HELD_BITS)
        fresh_v = mx.quantize(values, group_size=self.kv_group_size, bits=HELD_BITS)
        done = max(0, n_held + S - self.full_precision_window) // G * G  # held rows whose group is complete
        if done:
            self._store_groups(fresh_k, fresh_v, n_held, done, start - n_held)
        for held, fresh in ((self.fp_keys, fresh_k), (self.fp_values, fresh_v)):
            for x, f in zip(held, fresh):
                if not done:  # the usual decode step: append
                    x[..., n_held : n_held + S, :] = f
                    continue
                # The 8-bit rows that stay move to the front as they are (never quantized twice).
                rows = mx.concatenate([x[..., :n_held, :], f], axis=2)[..., done:, :]
                x[..., : rows.shape[2], :] = rows
        self.n_full = n_held + S - done

    def _store_groups(self, fresh_k, fresh_v, n_held: int, done: int, slot: int) -> None:
        """Quantize the oldest ``done`` held rows (whole key groups) into the slots from ``slot``."""
        dense_k = self._oldest(self.fp_keys, fresh_k, n_held, done)
        if self.rotate_held:  # keys are quantized per channel unrotated
            dense_k = dense_k @ self._value_rotation(dense_k.dtype).T
        dense_v = self._oldest(self.fp_values, fresh_v, n_held, done)
        codes, scales, biases = channel_quantize(dense_k, self.key_bits, self.key_group)  # B, H, done, ·
        rows_k, table_s, table_b = self.keys[1:]
        first = table_s.shape[2]
        B, H = rows_k.shape[:2]
        rows = (first + mx.arange(done) // self.key_group).astype(mx.uint16)
        self.keys[0][..., slot : slot + done, :] = codes
        rows_k[..., slot : slot + done] = mx.broadcast_to(rows, (B, H, done))
        self.keys = (
            self.keys[0],
            rows_k,
            mx.concatenate([table_s, scales], axis=2),
            mx.concatenate([table_b, biases], axis=2),
        )
        rotation = self._value_rotation(dense_v.dtype)
        if rotation is not None and not self.rotate_held:
            dense_v = dense_v @ rotation
        words, v_scales, v_biases = mx.quantize(dense_v, group_size=self.kv_group_size, bits=self.value_bits)
        words = planes_of(words, self.value_bits)
        for x, p in zip(self.values, (words, v_scales, v_biases)):
            x[..., slot : slot + done, :] = p

    def _oldest(self, held: tuple[mx.array, ...], fresh: list[mx.array], n_held: int, done: int) -> mx.array:
        """The oldest ``done`` of the ``n_held`` held rows followed by the fresh ones, dequantized."""
        fresh_rows = held_dequantize_compiled(*fresh, self.kv_group_size)
        return mx.concatenate([self._held_dense(held, n_held), fresh_rows], axis=2)[..., :done, :]

    def _collect(self, n_quant: int) -> None:
        """Drop the table rows no kept slot uses (after a compaction); renumber the slots' rows."""
        self.compacted = False
        table_s, table_b = self.keys[2:]
        T = table_s.shape[2]
        if T == 0:
            return
        B, H = table_s.shape[:2]
        pools = self._row_pools(n_quant)  # (rows (B, H, C_i), kept slots n_i) of each pool of quantized slots
        kept = [mx.arange(rows.shape[2]) < n for rows, n in pools]
        # Count each head's slots per row (dropped slots count in an extra row T), by one scatter-add.
        idx = mx.concatenate([table_index(mx.where(k, rows.astype(mx.int32), T), T + 1) for (rows, _), k in zip(pools, kept)])
        counts = mx.zeros((B * H * (T + 1),), mx.int32).at[idx].add(1)
        live = counts.reshape(B, H, T + 1)[..., :T] > 0  # B, H, T
        order = mx.argsort(mx.where(live, mx.arange(T), T + mx.arange(T)), axis=-1)  # live rows first, in order
        n_live = int(live.sum(axis=-1).max().item())
        renumber = (mx.cumsum(live.astype(mx.int32), axis=-1) - 1).astype(mx.uint16)  # B, H, T
        order = order[..., :n_live, None]
        new_rows = [
            mx.where(k, mx.take_along_axis(renumber, rows.astype(mx.int32), axis=-1), 0).astype(mx.uint16)
            for (rows, _), k in zip(pools, kept)
        ]
        self._set_rows(new_rows, mx.take_along_axis(table_s, order, axis=2), mx.take_along_axis(table_b, order, axis=2))

    def _row_pools(self, n_quant: int) -> list[tuple[mx.array, int]]:
        """Each pool of quantized slots' table rows and how many of its slots are kept."""
        return [(self.keys[1], n_quant)]

    def _set_rows(self, rows: list[mx.array], table_s: mx.array, table_b: mx.array) -> None:
        self.keys = (self.keys[0], rows[0], table_s, table_b)

    def fetch(self, size: int):
        """What :meth:`attend` reads of the ``size`` kept entries, as stored (slices, nothing computed):
        ``(((codes, rows, table scales, table biases), held keys), (quantized values, held values))``:
        key and value codes in bit planes, the held rows ``mx.quantize``'s 8-bit triples."""
        n_quant, n = size - self.n_full, self.n_full
        codes, rows, table_s, table_b = self.keys
        quantized = (codes[..., :n_quant, :], rows[..., :n_quant], table_s, table_b)
        keys = quantized, tuple(x[..., :n, :] for x in self.fp_keys)
        values = tuple(x[..., :n_quant, :] for x in self.values), tuple(x[..., :n, :] for x in self.fp_values)
        return keys, values

    def _parts(self, keys, values) -> tuple[tuple, tuple, tuple[tuple[int, int], ...]]:
        """The quantized parts of what :meth:`fetch` returned: keys, values, and each part's ``(key, value)`` bits."""
        return (keys[0],), (values[0],), ((self.key_bits, self.value_bits),)

    def _dense_keys(self, keys, values) -> mx.array:
        """The keys :meth:`fetch` returned, dequantized and unrotated: ``(B, H, N + F, D)``."""
        held = keys[1]
        held_k = self._held_dense(held, held[0].shape[2])
        if self.rotate_held:
            held_k = held_k @ self._value_rotation(held_k.dtype).T
        key_parts, _, bits = self._parts(keys, values)
        dense = [channel_dequantize_compiled(*k, b[0]).astype(held_k.dtype) for k, b in zip(key_parts, bits) if k[1].shape[2]]
        return mx.concatenate([*dense, held_k], axis=2)

    def attend(self, queries, keys, values, scale, mask, sinks=None) -> mx.array:
        """Attention over what :meth:`fetch` returned, one softmax: ``(B, H*G, L, Dv)`` (the patched attention
        calls this). One query without a mask: :func:`~mlxevict.channel_attention.channel_decode_attention`
        (the held rows read quantized); else dense entries and the model's fused attention."""
        if sinks is not None:
            raise ValueError("quantized KV storage does not support attention sinks; use kv_bits=None")
        key_parts, value_parts, bits = self._parts(keys, values)
        n_quant, n_held = sum(k[1].shape[2] for k in key_parts), keys[1][0].shape[2]
        rotation = self._value_rotation(queries.dtype)
        if decodes_here(queries, mask, n_quant, n_held):
            return channel_decode_attention_fast(
                queries, (key_parts, keys[1]), (value_parts, values[1]), rotation, scale, self.kv_group_size,
                (bits, HELD_BITS), self.rotate_held,
            )
        # Dense keys and values (the values rotated back) and the model's fused attention.
        held_v = self._held_dense(values[1], n_held)
        group = self.kv_group_size
        parts = [token_dequantize_compiled(*v, b[1], group).astype(held_v.dtype) for v, b in zip(value_parts, bits) if v[0].shape[2]]
        dense = mx.concatenate(parts, axis=2) if parts else held_v[..., :0, :]
        if self.rotate_held:  # both rotated: rotate back once
            dense_v = mx.concatenate([dense, held_v], axis=2) @ rotation.T
        else:
            dense_v = mx.concatenate([dense if rotation is None else dense @ rotation.T, held_v], axis=2)
        return mx.fast.scaled_dot_product_attention(queries, self._dense_keys(keys, values), dense_v, scale=scale, mask=mask)

    def max_rows(self, budget: int) -> int:
        """Table rows a cache of ``budget`` entries may hold: one per ``key_group`` quantized slots, plus
        ``ROW_RESERVE``."""
        return self._quantized_capacity(budget) // self.key_group + ROW_RESERVE

    def limit_groups(self, rank_key: mx.array, n_keep: int, size: int, budget: int) -> tuple[mx.array, int]:
        """Bound the table: keep at most ``max_rows`` key groups (less those that may complete before the next
        eviction), the groups with the best entries; the others' slots go first.

        Without it, an eviction that leaves one entry in each of many groups would keep a table row (``4·D``
        bytes) for each of them, past the budget's bytes. The protected slots' groups always stay.

        Args:
            rank_key: ``(B, H, C)`` the cache's keep-priority (:func:`mlxevict.kernels.priority`).
            n_keep: slots the eviction keeps; size: slots held now; budget: the cache's (its capacity once it
                evicts; a compress-mode prompt is held in more until it is compressed).

        Returns:
            ``rank_key`` with the slots of the groups over the bound at :data:`DEMOTED`, and ``n_keep``, fewer
            when the groups kept hold fewer entries (every head keeps as many as the poorest can).
        """
        T, n_quant = self.table_rows, size - self.n_full
        pending = 1 + max(0, budget - n_keep) // self.key_group  # groups that complete before the next eviction
        allowed = max(1, self.max_rows(budget) - pending)
        if T <= allowed or n_quant <= 0:
            return rank_key, n_keep
        B, H, _ = rank_key.shape
        rows = self._row_pools(n_quant)[0][0][..., :n_quant].astype(mx.int32)  # B, H, n: the slots compaction moves
        values = rank_key[..., :n_quant]
        best = mx.full((B * H * T,), 2 * DEMOTED, mx.float32).at[table_index(rows, T)].maximum(values.reshape(-1)).reshape(B, H, T)
        order = mx.argsort(-best, axis=-1)  # B, H, T: best group first
        top = mx.argsort(order, axis=-1) < allowed  # B, H, T
        kept = mx.take_along_axis(top, rows, axis=-1)  # B, H, n
        kept = kept | (values >= PROTECTED)  # sinks and pins stay, whatever the table costs
        rank_key = mx.concatenate([mx.where(kept, values, DEMOTED), rank_key[..., n_quant:]], axis=-1)
        return rank_key, min(n_keep, int((rank_key > DEMOTED).sum(axis=-1).min().item()))

    def slots(self) -> list[mx.array]:
        """The per-slot arrays of the quantized part (the held tokens live apart and are always kept)."""
        return [self.keys[0], self.keys[1], *self.values]

    def set_slots(self, arrays: list[mx.array]) -> None:
        self.keys = (arrays[0], arrays[1], *self.keys[2:])
        self.values = tuple(arrays[2:5])
        self.compacted = True

    def resize(self, capacity: int) -> None:
        C = self._quantized_capacity(capacity)
        self.keys = (fit_slots(self.keys[0], C, 0), fit_slots(self.keys[1], C, 0), *self.keys[2:])
        self.values = tuple(fit_slots(x, C, 0) for x in self.values)

    def dense_keys(self, size: int, capacity: int) -> mx.array:
        """``(B, H, C, D)`` keys in the model's dtype (a transient copy, for policies; zeros past ``size``)."""
        B, H, D, _, dtype = self.shape
        keys = self._dense_keys(*self.fetch(size))
        return mx.concatenate([keys] + [mx.zeros((B, H, capacity - size, D), keys.dtype)] * (capacity > size), axis=2)

    # ---- save / load ----------------------------------------------------------
    @property
    def state(self) -> tuple[Any, Any]:
        if self.keys is None:
            return None, None
        return (*self.keys, *self.fp_keys), (*self.values, *self.fp_values)

    @state.setter
    def state(self, v: tuple[Any, Any]) -> None:
        if v[0] is None:
            return
        self.keys, self.fp_keys = tuple(v[0][:4]), tuple(v[0][4:])
        self.values, self.fp_values = tuple(v[1][:3]), tuple(v[1][3:])
        if self.mx_quantize_codes:  # saved before the bit planes (mlxevict <= f73bfc2): repack once
            self.keys = (planes_of(self.keys[0], self.key_bits), *self.keys[1:])
            self.values = (planes_of(self.values[0], self.value_bits), *self.values[1:])
            self.mx_quantize_codes = False

    def meta(self) -> dict[str, Any]:
        return {
            "kv_bits": self.kv_bits,
            "kv_group_size": self.kv_group_size,
            "full_precision_window": self.full_precision_window,
            "key_group": self.key_group,
            "n_full": self.n_full,
            "kv_rotate": self.kv_rotate,
            "window_bits": self.window_bits,
            "compacted": self.compacted,
            "rotate_held": self.rotate_held,
            "key_planes": True,
        }

    @staticmethod
    def _settings(meta: dict[str, Any]) -> dict[str, Any]:
        """The constructor's arguments :meth:`meta` saved."""
        keys = ("kv_group_size", "full_precision_window", "key_group", "kv_rotate", "window_bits", "rotate_held")
        bits = meta["kv_bits"] if isinstance(meta["kv_bits"], int) else tuple(meta["kv_bits"])
        return {"kv_bits": bits, **{k: meta[k] for k in keys}}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> ChannelStorage:
        storage = cls(**cls._settings(meta))
        storage.n_full, storage.compacted = meta["n_full"], meta["compacted"]
        storage.mx_quantize_codes = not meta.get("key_planes", False)
        return storage
