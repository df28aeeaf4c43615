"""How a cache stores its KV entries: one frozen value, validated once, in every spelling people use.

:class:`KVStorage` is the storage of a cache: key and value bits (``None``: the
model's dtype), the quantization group size, the recent window's bits and length,
and the rotation. It is checked where it is made, and it spells itself as a label
(``"5/3-bit"``), as command-line flags (``--kv-bits 5,3 --window-bits 8``) and as a
benchmark suffix (``:k5v3w8``); :meth:`KVStorage.parse` and
:meth:`KVStorage.from_suffix` read the last two back. Each rule has one message,
rendered with the API's argument names (``window_bits=8``) or the CLI's flags
(``--window-bits 8``), so the two never drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Union

from .defaults import DEFAULT_GROUP_SIZE

KV_BITS = (8, 4)  # one number for keys and values
PAIR_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize supports, for a (key bits, value bits) pair
KVBits = Union[int, tuple[int, int]]
SPLIT_BITS = (5, 3)  # keys finer than values, at the bytes of 4 bits: the keys carry the error
GROUP_SIZES = (32, 64, 128)  # what mx.quantize supports
WINDOW_BITS = (8,)
KEY_GROUPS = (32, 64, 128)  # tokens per key scale for keys quantized per channel (KIVI); mx.quantize's group sizes
ROW_ID_BYTES = 2  # a per-channel key's uint16 row in its storage's scale table
ROW_RESERVE = 2  # scale-table rows beyond one per key group of slots (the sinks' group, groups cut by eviction)
NONE = "none"  # --kv-bits none: the model's dtype

# The two spellings of the storage's parameters: make_cache's arguments and the CLI's flags.
API = {
    "kv_bits": "kv_bits={!r}", "group": "kv_group_size={!r}", "fp": "full_precision_window={!r}",
    "window_bits": "window_bits={!r}", "bits_flag": "kv_bits", "pair": "(5, 3)", "none": "None",
    "group_fix": "kv_group_size={}", "key_group": "key_group={!r}", "low_bits": "low_bits={!r}",
    "eight": "eight_bit_layers={!r}",
}  # fmt: skip
FLAGS = {
    "kv_bits": "--kv-bits {}", "group": "--kv-group-size {}", "fp": "--fp-window {}",
    "window_bits": "--window-bits {}", "bits_flag": "--kv-bits", "pair": "5,3", "none": "none",
    "group_fix": "--kv-group-size {}", "key_group": "--key-group {}", "low_bits": "--low-bits {}",
    "eight": "--eight-bit-layers {}",
}  # fmt: skip


def key_value_bits(kv_bits: KVBits) -> tuple[int, int]:
    """``(key bits, value bits)`` of ``kv_bits`` (one number means both)."""
    return (kv_bits, kv_bits) if isinstance(kv_bits, int) else (int(kv_bits[0]), int(kv_bits[1]))


def bits_label(kv_bits: KVBits) -> str:
    """``"4-bit"``, or ``"5/3-bit"`` for keys in 5 and values in 3."""
    key_bits, value_bits = key_value_bits(kv_bits)
    return f"{key_bits}-bit" if key_bits == value_bits else f"{key_bits}/{value_bits}-bit"


def storage_bytes(dim: int, dtype_size: int, bits: Optional[int] = None, group_size: int = DEFAULT_GROUP_SIZE) -> int:
    """Bytes one stored key (or value) vector of ``dim`` elements takes.

    Model dtype: ``dim × dtype_size``; quantized: ``dim × bits / 8`` plus a scale
    and a bias (model dtype) per group.
    """
    if bits is None:
        return dim * dtype_size
    return dim * bits // 8 + 2 * (dim // group_size) * dtype_size


def _spell(names: Mapping[str, str], key: str, value: Any) -> str:
    if key in ("kv_bits", "low_bits", "eight") and names is FLAGS and isinstance(value, (tuple, list)):
        value = ",".join(map(str, value))
    return names[key].format(value)


def _bits_ok(kv_bits: Any) -> bool:
    if isinstance(kv_bits, (tuple, list)):
        return len(kv_bits) == 2 and all(b in PAIR_BITS and not isinstance(b, bool) for b in kv_bits)
    return kv_bits in KV_BITS and not isinstance(kv_bits, bool)


def check(
    kv_bits: Any = None,
    group_size: Any = None,
    full_precision_window: Any = None,
    window_bits: Any = None,
    *,
    key_group: Any = None,
    low_bits: Any = None,
    eight_bit_layers: Any = (),
    head_dims: tuple[int, ...] = (),
    names: Mapping[str, str] = API,
) -> None:
    """Every storage rule, once: raise a ``ValueError`` naming the bad value and the fix.

    ``None`` for ``group_size``/``full_precision_window``/``window_bits`` means not given.

    Args:
        kv_bits: ``None`` (the model's dtype), 8 or 4, or a ``(key bits, value bits)`` pair of
            2, 3, 4, 5, 6 or 8.
        group_size: 32, 64 or 128, dividing every head dim.
        full_precision_window: tokens >= 0.
        window_bits: 8, when keys and values both take fewer bits.
        key_group: tokens per key scale (keys per channel, :mod:`mlxevict.channel_storage`): 32, 64 or 128,
            with key bits under 8 and ``window_bits`` 8.
        low_bits: the low precision tier's ``(key bits, value bits)`` (:mod:`mlxevict.tiered_storage`):
            with ``key_group``, each at most ``kv_bits``'s and one of them fewer.
        eight_bit_layers: layer indices stored in 8 bits (the rest in ``kv_bits``, under 8).
        head_dims: the key and value head dims, when known.
        names: :data:`API` (``make_cache``'s argument names) or :data:`FLAGS` (the CLI's).
    """
    if kv_bits is not None and not _bits_ok(kv_bits):
        pairs = f"{', '.join(map(str, PAIR_BITS[:-1]))} or {PAIR_BITS[-1]}"
        raise ValueError(
            f"{_spell(names, 'kv_bits', kv_bits)} is not supported; use 8 or 4, key and value bits of {pairs} "
            f"such as {names['pair']}, or {names['none']} for the model's dtype"
        )
    if window_bits is not None and (window_bits not in WINDOW_BITS or isinstance(window_bits, bool)):
        raise ValueError(
            f"{_spell(names, 'window_bits', window_bits)} is not supported; use 8 (or {names['none']} to keep the "
            "recent window in the model's dtype)"
        )
    if window_bits is not None and (kv_bits is None or window_bits <= max(key_value_bits(kv_bits))):
        given = "" if kv_bits is None else f" (not {_spell(names, 'kv_bits', kv_bits)})"
        raise ValueError(
            f"{_spell(names, 'window_bits', window_bits)} needs {names['bits_flag']} under 8{given}, such as 4 or "
            f"{names['pair']}: the recent window is stored in 8 bits when the rest takes fewer, else in the "
            "model's dtype"
        )
    for key, value in (("group", group_size), ("fp", full_precision_window)):
        if kv_bits is None and value is not None:
            raise ValueError(
                f"{_spell(names, key, value)} needs {names['bits_flag']} 8, 4 or {names['pair']} "
                "(without it nothing is quantized)"
            )
    if key_group is not None:
        if key_group not in KEY_GROUPS or isinstance(key_group, bool):
            raise ValueError(f"{_spell(names, 'key_group', key_group)} is not supported; use 32, 64 or 128 tokens")
        needs = []
        if kv_bits is None or key_value_bits(kv_bits)[0] >= 8:
            given = "" if kv_bits is None else f" (not {_spell(names, 'kv_bits', kv_bits)})"
            needs.append(f"key bits under 8{given}")
        if window_bits is None:
            needs.append(_spell(names, "window_bits", 8))
        if needs:
            raise ValueError(
                f"{_spell(names, 'key_group', key_group)} needs {' and '.join(needs)}, such as "
                f"{_spell(names, 'kv_bits', (5, 3))} {_spell(names, 'window_bits', 8)}: keys are quantized per "
                "channel once their group leaves the 8-bit window"
            )
    if low_bits is not None:
        _check_low(kv_bits, low_bits, key_group, names)
    if eight_bit_layers:
        _check_eight(kv_bits, eight_bit_layers, names)
    if full_precision_window is not None and (
        not isinstance(full_precision_window, int) or full_precision_window < 0
    ):
        raise ValueError(f"{_spell(names, 'fp', full_precision_window)} must be a number of tokens >= 0")
    if group_size is not None and (group_size not in GROUP_SIZES or isinstance(group_size, bool)):
        raise ValueError(
            f"{_spell(names, 'group', group_size)} is not supported by mx.quantize; use 32, 64 or 128"
        )
    for dim in head_dims if kv_bits is not None else ():
        group = group_size or DEFAULT_GROUP_SIZE
        if dim % group:
            fits = [str(g) for g in GROUP_SIZES if dim % g == 0]
            fix = f"use {FLAGS['group_fix'].format(' or '.join(fits))}" if fits else "store this model's KV unquantized"
            raise ValueError(f"{_spell(names, 'group', group)} does not divide the head dim {dim}; {fix}")


def _check_low(kv_bits: Any, low_bits: Any, key_group: Any, names: Mapping[str, str]) -> None:
    """The low tier's rule (:func:`check`): a pair of supported bits, under ``kv_bits``, keys per channel."""
    low = _spell(names, "low_bits", low_bits)
    if not isinstance(low_bits, (tuple, list)) or not _bits_ok(low_bits):
        raise ValueError(f"{low} is not supported; use key and value bits such as {_spell(names, 'low_bits', (3, 2))}")
    if key_group is None or kv_bits is None:
        raise ValueError(f"{low} needs keys per channel, such as {_spell(names, 'kv_bits', (5, 3))} "
                         f"{_spell(names, 'window_bits', 8)} {_spell(names, 'key_group', 64)}")
    high = key_value_bits(kv_bits)
    if any(lo > hi for lo, hi in zip(low_bits, high)) or tuple(low_bits) == high:
        raise ValueError(f"{low} must take fewer bits than {_spell(names, 'kv_bits', kv_bits)} (the high tier)")


def _check_eight(kv_bits: Any, layers: Any, names: Mapping[str, str]) -> None:
    """Layers in 8 bits (:func:`check`): distinct indices >= 0, the other layers under 8 bits."""
    eight = _spell(names, "eight", layers)
    if not isinstance(layers, (tuple, list)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                        for i in layers) or len(set(layers)) != len(layers):  # fmt: skip
        raise ValueError(f"{eight} must be distinct layer indices >= 0, such as {_spell(names, 'eight', (18,))}")
    if kv_bits is None or max(key_value_bits(kv_bits)) >= 8:
        raise ValueError(f"{eight} needs the other layers under 8 bits, such as {_spell(names, 'kv_bits', (5, 3))}")


@dataclass(frozen=True)
class KVStorage:
    """The storage of an evicting cache (frozen; validated when made).

    Attributes:
        key_bits, value_bits: bits per stored key and value element; ``None``: the model's dtype.
        group_size: values per quantization scale and bias (32, 64 or 128). Default 64.
        window_bits: ``None`` keeps the recent window in the model's dtype; 8 stores it in
            8 bits (only when keys and values take fewer).
        full_precision_window: the newest tokens kept unquantized (or in ``window_bits``);
            ``None``: ``min(32, budget // 8)``.
        rotate: rotate keys and values before quantizing; ``None``: when under 8 bits.
        key_group: ``None`` quantizes keys per token; 32, 64 or 128 quantizes them per channel over
            that many tokens (KIVI, :class:`~mlxevict.channel_storage.ChannelStorage`; values stay
            per token, rotated; needs ``window_bits=8``).
        low_bits: with ``key_group``, precision tiers (:class:`~mlxevict.tiered_storage.TieredStorage`):
            entries leave the window in ``kv_bits``, and the policy's lowest-scored are demoted to these
            ``(key bits, value bits)`` before any is evicted; ``None``: one tier.
        eight_bit_layers: layers stored in 8 bits instead (:attr:`eight_bit`, the same budget in tokens):
            the layers a model's low-bit storage hurts most (:mod:`mlxevict.calibrate`). Default none.

    Raises:
        ValueError: a combination that cannot work (see :func:`check`).
    """

    key_bits: Optional[int] = None
    value_bits: Optional[int] = None
    group_size: int = DEFAULT_GROUP_SIZE
    window_bits: Optional[int] = None
    full_precision_window: Optional[int] = None
    rotate: Optional[bool] = None
    key_group: Optional[int] = None
    low_bits: Optional[tuple[int, int]] = None
    eight_bit_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if (self.key_bits is None) != (self.value_bits is None):
            raise ValueError(f"key_bits={self.key_bits} and value_bits={self.value_bits}: give both, or neither")
        bits = self.kv_bits
        group = self.group_size if bits else None
        check(bits, group, self.full_precision_window, self.window_bits, key_group=self.key_group,
              low_bits=self.low_bits, eight_bit_layers=self.eight_bit_layers)
        if bits is None:
            object.__setattr__(self, "group_size", DEFAULT_GROUP_SIZE)  # unused: one value for "the dtype"

    # ---- making one --------------------------------------------------------------------------------
    @classmethod
    def of(
        cls,
        kv_bits: Optional[KVBits] = None,
        group_size: Optional[int] = None,
        full_precision_window: Optional[int] = None,
        window_bits: Optional[int] = None,
        rotate: Optional[bool] = None,
        *,
        key_group: Optional[int] = None,
        low_bits: Optional[KVBits] = None,
        eight_bit_layers: Any = (),
        names: Mapping[str, str] = API,
    ) -> "KVStorage":
        """From ``make_cache``'s storage arguments (``names=FLAGS``: the CLI's values, errors name flags)."""
        eight_bit_layers = tuple(eight_bit_layers or ())
        check(kv_bits, group_size, full_precision_window, window_bits, key_group=key_group, low_bits=low_bits,
              eight_bit_layers=eight_bit_layers, names=names)
        key_bits, value_bits = (None, None) if kv_bits is None else key_value_bits(kv_bits)
        group = group_size or DEFAULT_GROUP_SIZE
        low = None if low_bits is None else key_value_bits(low_bits)
        return cls(key_bits, value_bits, group, window_bits, full_precision_window, rotate, key_group, low,
                   tuple(sorted(eight_bit_layers)))

    @classmethod
    def from_options(cls, **options: Any) -> "KVStorage":
        """From ``make_cache``'s storage keywords: ``kv_bits``, ``kv_group_size``, ``full_precision_window``,
        ``window_bits``, ``kv_rotate``, ``key_group`` (a group size without ``kv_bits`` is ignored, as
        ``make_cache`` does)."""
        bits = options.get("kv_bits")
        return cls.of(
            bits,
            options.get("kv_group_size") if bits is not None else None,
            options.get("full_precision_window"),
            options.get("window_bits"),
            options.get("kv_rotate"),
            key_group=options.get("key_group"),
            low_bits=options.get("low_bits"),
            eight_bit_layers=options.get("eight_bit_layers") or (),
        )

    @classmethod
    def parse(
        cls,
        text: str,
        group_size: Optional[int] = None,
        full_precision_window: Optional[int] = None,
        window_bits: Optional[int] = None,
        key_group: Optional[int] = None,
        low_bits: Optional[str] = None,
        eight_bit_layers: Optional[str] = None,
    ) -> "KVStorage":
        """From the flags: ``--kv-bits`` text (``8``, ``4``, ``5,3`` or ``none``) and the others' values
        (``--low-bits`` text such as ``3,2``, ``--eight-bit-layers`` text such as ``18,20``)."""
        bits = parse_bits(text)
        low = None if low_bits is None else parse_bits(low_bits)
        eight = parse_layers(eight_bit_layers) if eight_bit_layers else ()
        return cls.of(bits, group_size, full_precision_window, window_bits, key_group=key_group, low_bits=low,
                      eight_bit_layers=eight, names=FLAGS)

    @classmethod
    def from_suffix(cls, suffix: str) -> "KVStorage":
        """From a benchmark suffix: ``""``, ``":q8"``, ``":q4w8"``, ``":k5v3w8"``, ``":k5v3w8c64"`` (keys per
        channel over 64 tokens), ``":k5v3w8c64l32"`` (and a low tier: keys in 3 bits, values in 2); group
        size 64; ``e18.20`` at the end stores layers 18 and 20 in 8 bits."""
        text = suffix.removeprefix(":")
        text, _, eight = text.partition("e")
        text, _, channel = text.partition("c")
        channel, _, low = channel.partition("l")
        window = 8 if text.endswith("w8") else None
        text = text.removesuffix("w8") if window else text
        try:
            if not text:
                bits: Optional[KVBits] = None
            elif text.startswith("q"):
                bits = int(text[1:])
            else:
                key, value = text.removeprefix("k").split("v")
                bits = (int(key), int(value))
            low_bits = (int(low[0]), int(low[1:])) if low else None
            layers = tuple(int(i) for i in eight.split(".")) if eight else ()
            key_group = int(channel) if channel else None
        except (ValueError, IndexError):
            known = ":q8, :q4, :q4w8, :k5v3w8, :k5v3w8c64 or :k5v3w8c64l32"
            raise ValueError(f"{suffix!r} is not a storage suffix; use {known}") from None
        try:  # read, but not a storage: say why (the check's own message)
            return cls.of(bits, window_bits=window, key_group=key_group, low_bits=low_bits, eight_bit_layers=layers)
        except ValueError as e:
            raise ValueError(f"{suffix!r}: {e}") from None

    # ---- reading it --------------------------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        return self.key_bits is not None

    @property
    def kv_bits(self) -> Optional[KVBits]:
        """``make_cache``'s ``kv_bits``: ``None``, one number, or a ``(key, value)`` pair."""
        if self.key_bits is None:
            return None
        return self.key_bits if self.key_bits == self.value_bits else (self.key_bits, self.value_bits)

    @property
    def label(self) -> str:
        """``"5/3-bit"``, ``"8-bit"``, ``"5/3-bit KIVI-64"`` (keys per channel), or ``"model dtype"``."""
        if not self.quantized:
            return "model dtype"
        low = f", {bits_label(self.low_bits)} below" if self.low_bits else ""
        eight = self.eight_bit_layers
        eight_text = f", layer{'s' if len(eight) > 1 else ''} {', '.join(map(str, eight))} in 8 bits" if eight else ""
        return bits_label(self.kv_bits) + (f" KIVI-{self.key_group}" if self.key_group else "") + low + eight_text

    @property
    def bits_text(self) -> str:
        """``--kv-bits``'s value: ``"5,3"``, ``"8"``, or ``"none"`` for the dtype."""
        return _spell(FLAGS, "kv_bits", self.kv_bits).removeprefix("--kv-bits ") if self.quantized else NONE

    @property
    def flags(self) -> str:
        """The command-line form: ``--kv-bits 5,3 --window-bits 8`` (``--kv-bits none`` for the dtype)."""
        if not self.quantized:
            return f"--kv-bits {NONE}"
        parts = [f"--kv-bits {self.bits_text}"]
        if self.group_size != DEFAULT_GROUP_SIZE:
            parts.append(_spell(FLAGS, "group", self.group_size))
        if self.full_precision_window is not None:
            parts.append(_spell(FLAGS, "fp", self.full_precision_window))
        if self.window_bits is not None:
            parts.append(_spell(FLAGS, "window_bits", self.window_bits))
        if self.key_group is not None:
            parts.append(_spell(FLAGS, "key_group", self.key_group))
        if self.low_bits is not None:
            parts.append(_spell(FLAGS, "low_bits", self.low_bits))
        if self.eight_bit_layers:
            parts.append(_spell(FLAGS, "eight", self.eight_bit_layers))
        return " ".join(parts)

    @property
    def suffix(self) -> str:
        """The benchmark-name form: ``":k5v3w8"``, ``":q4"``, ``":k5v3w8c64"`` (``""`` for the dtype)."""
        if not self.quantized:
            return ""
        bits = f"q{self.key_bits}" if self.key_bits == self.value_bits else f"k{self.key_bits}v{self.value_bits}"
        low = f"l{self.low_bits[0]}{self.low_bits[1]}" if self.low_bits else ""
        eight = f"e{'.'.join(map(str, self.eight_bit_layers))}" if self.eight_bit_layers else ""
        return f":{bits}{'w8' if self.window_bits else ''}{f'c{self.key_group}' if self.key_group else ''}{low}{eight}"

    def options(self) -> dict[str, Any]:
        """``make_cache``'s (and ``QuantizedEvictingKVCache``'s) storage arguments; ``{}`` for the dtype."""
        if not self.quantized:
            return {}
        options = dict(
            kv_bits=self.kv_bits,
            kv_group_size=self.group_size,
            full_precision_window=self.full_precision_window,
            kv_rotate=self.rotate,
            window_bits=self.window_bits,
        )
        if self.low_bits:
            options["low_bits"] = self.low_bits
        if self.eight_bit_layers:
            options["eight_bit_layers"] = self.eight_bit_layers
        return {**options, "key_group": self.key_group} if self.key_group else options

    @property
    def eight_bit(self) -> "KVStorage":
        """The storage of :attr:`eight_bit_layers`: 8 bits per token, no window apart (mlx-lm's 8-bit cache)."""
        return KVStorage.of(8, self.group_size, full_precision_window=0)

    @property
    def uniform(self) -> "KVStorage":
        """The other layers' storage: this one without :attr:`eight_bit_layers`."""
        return replace(self, eight_bit_layers=())

    def layer_groups(self, layers: int) -> list[tuple[int, "KVStorage"]]:
        """``[(layer count, storage)]`` over a model's ``layers``: the uniform layers, then the 8-bit ones."""
        eight = sum(1 for i in self.eight_bit_layers if i < layers)
        return [(n, s) for n, s in ((layers - eight, self.uniform), (eight, self.eight_bit)) if n]

    def with_window(self, full_precision_window: Optional[int]) -> "KVStorage":
        return replace(self, full_precision_window=full_precision_window)

    def check_head_dim(self, head_dim: int, names: Mapping[str, str] = API) -> None:
        """Raise when the group size does not divide ``head_dim`` (quantized storage only)."""
        check(self.kv_bits, self.group_size if self.quantized else None, head_dims=(head_dim,), names=names)

    # ---- bytes -------------------------------------------------------------------------------------
    def bytes_per_token(self, head_dim: int, dtype_size: int) -> int:
        """Bytes of one token's key and value vectors for one kv-head of one layer.

        Keys per channel (``key_group``): the packed codes, the row id, and the scale table counted
        per token as if every group kept its ``key_group`` tokens (a scale and a bias per channel).
        Precision tiers (``low_bits``): the low tier's, the bytes a budget's every entry may take.
        """
        key_bits, value_bits = self.low_bits or (self.key_bits, self.value_bits)
        values = storage_bytes(head_dim, dtype_size, value_bits, self.group_size)
        if self.key_group:
            table = -(-2 * head_dim * dtype_size // self.key_group)
            return head_dim * key_bits // 8 + ROW_ID_BYTES + table + values
        return storage_bytes(head_dim, dtype_size, self.key_bits, self.group_size) + values

    def window_bytes_per_token(self, head_dim: int, dtype_size: int) -> Optional[int]:
        """Bytes of a recent-window token (per layer and kv-head); ``None`` unquantized (no window apart)."""
        if not self.quantized:
            return None
        return 2 * storage_bytes(head_dim, dtype_size, self.window_bits, self.group_size)

    def fixed_bytes(self, head_dim: int, dtype_size: int) -> int:
        """Bytes per layer and kv-head whatever the tokens: keys per channel reserve ``ROW_RESERVE`` table rows."""
        return ROW_RESERVE * 2 * head_dim * dtype_size if self.key_group else 0

    @property
    def held_extra(self) -> int:
        """Tokens held at the window's size beyond the window: an unfinished key group (keys per channel)."""
        return self.key_group or 0


def parse_layers(text: str) -> tuple[int, ...]:
    """``--eight-bit-layers`` text: ``"18,20"`` → ``(18, 20)``; ``"none"`` or ``""`` → ``()``.

    Raises:
        ValueError: not layer numbers.
    """
    if text.strip().lower() in (NONE, ""):
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--eight-bit-layers {text} is not layer numbers; write them like 18,20") from None


def parse_bits(text: str) -> Optional[KVBits]:
    """``--kv-bits`` text: ``"8"`` → 8, ``"5,3"`` → ``(5, 3)``, ``"none"`` → ``None``.

    Raises:
        ValueError: not numbers (the message names ``--kv-bits``); unsupported bits fail in :func:`check`.
    """
    if text.strip().lower() == NONE:
        return None
    try:
        parts = [int(part) for part in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2):
        check(text, names=FLAGS)  # raises: not bits
    return parts[0] if len(parts) == 1 else (parts[0], parts[1])


DTYPE = KVStorage()  # the model's dtype, as mlx-lm's KVCache stores it
