"""How a cache looks in every plot: one colour and marker per policy, a line style per storage, and the
groups that keep a panel to at most :data:`MAX_SERIES` lines.

A name is ``POLICY`` or ``POLICY:STORAGE`` (``anchored:k5v3w8``) or one of mlx-lm's caches;
``default`` is drawn as the policy it stands for. mlx-lm's caches are dashed, in greys and black.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

MAX_SERIES = 8
DEFAULT_POLICY = "anchored"  # what "default" means in results written before the name moved (see results' JSON)

# policy -> (colour, marker). Colours from matplotlib's tab10, fixed so a policy never changes colour.
POLICY_STYLES = {
    "anchored": ("#d62728", "o"),  # the default: red, drawn on top
    "entropy": ("#1f77b4", "^"),
    "uncertainty": ("#9467bd", "v"),
    "window": ("#2ca02c", "s"),
    "h2o": ("#ff7f0e", "D"),
    "tova": ("#8c564b", "P"),
    "snapkv": ("#e377c2", "X"),
    "rkv": ("#17becf", "<"),
    "knorm": ("#bcbd22", ">"),
    "random": ("#7f7f7f", "h"),
    "full": ("#000000", "p"),
}
MLX_LM_STYLES = {
    "kvcache": ("#000000", "*"),  # the full cache: the reference
    "rotating": ("#444444", "s"),
    "quantized8": ("#666666", "o"),
    "quantized4": ("#888888", "^"),
    "quantized3": ("#aaaaaa", "v"),
}
STORAGE_LINES = {
    "": "-", "q8": (0, (5, 2)), "q4": (0, (1, 1.5)), "q4w8": (0, (4, 1.5, 1, 1.5)), "k5v3w8": (0, (8, 2)),
    "k5v3w8c64": (0, (3, 1, 1, 1, 1, 1)), "k5v3w8c64l32": (0, (10, 1.5, 2, 1.5)),  # keys per channel; + tiers
}  # fmt: skip
# storage -> shade of the policy's colour: > 0 towards white, < 0 towards black
STORAGE_SHADES = {"": 0.0, "q8": 0.35, "q4": 0.6, "q4w8": -0.35, "k5v3w8": -0.6, "k5v3w8c64": 0.45, "k5v3w8c64l32": -0.8}
OTHER_STYLE = ("#9edae5", ".")
# storage variants of the default policy (``benchmarks.storage_variants``): its colour, their own marker
VARIANT_STYLES = {
    "kivi-k5v3": (-0.35, "*"), "kivi-k2v2": (0.4, "*"), "tiers-k3v2": (0.45, "d"), "kivi-tiers": (-0.2, "d"),
    "sim-k5v3w8": (-0.5, "x"), "sim-k3v2w8": (0.3, "x"), "kivi-k3v2": (0.2, "*"), "kivi-k3v2-pre": (0.2, "P"),
    "kivi-tiers-pre": (-0.2, "P"),
}  # fmt: skip
COMPRESS = " [compress]"  # a cache compressed once after prefill: its policy's look, dotted and lighter

# (title, names): the panels' groups, each also drawn with the default policy as a reference.
GROUPS = (
    ("mlxevict's policies", ("anchored", "entropy", "uncertainty", "window", "full")),
    ("published policies", ("h2o", "tova", "snapkv", "rkv", "knorm", "random")),
    ("the default policy in fewer bits",
     ("anchored:q8", "anchored:q4", "anchored:q4w8", "anchored:k5v3w8", "anchored:k5v3w8c64", "anchored:k5v3w8c64l32")),
    ("storage variants of the default policy", tuple(VARIANT_STYLES)),
    ("compressed once after prefill", tuple(f"{p}{COMPRESS}" for p in POLICY_STYLES)),
    ("mlx-lm's caches", tuple(MLX_LM_STYLES)),
)


@dataclass(frozen=True)
class Style:
    """matplotlib's ``color``, ``marker`` and ``linestyle`` for one cache."""

    color: str
    marker: str
    linestyle: object

    def kwargs(self) -> dict:
        return {"color": self.color, "marker": self.marker, "linestyle": self.linestyle}


def canonical(name: str, default_policy: str = DEFAULT_POLICY) -> str:
    """``default``, ``default:q8`` and ``default [compress]`` as the policy they stand for."""
    if name.endswith(COMPRESS):
        return canonical(name[: -len(COMPRESS)], default_policy) + COMPRESS
    base, sep, storage = name.partition(":")
    return f"{default_policy if base == 'default' else base}{sep}{storage}"


def style(name: str, default_policy: str = DEFAULT_POLICY) -> Style:
    """The fixed look of ``name``: colour and marker from its policy, line style from its storage."""
    name = canonical(name, default_policy)
    if name.endswith(COMPRESS):
        look = style(name[: -len(COMPRESS)], default_policy)
        return Style(shade(look.color, 0.3), look.marker, ":")
    if name in VARIANT_STYLES:
        amount, marker = VARIANT_STYLES[name]
        return Style(shade(POLICY_STYLES[default_policy][0], amount), marker, (0, (6, 1, 1, 1)))
    if name in MLX_LM_STYLES:
        color, marker = MLX_LM_STYLES[name]
        return Style(color, marker, "--")
    base, _, storage = name.partition(":")
    color, marker = POLICY_STYLES.get(base, OTHER_STYLE)
    return Style(shade(color, STORAGE_SHADES.get(storage, 0.2)), marker, STORAGE_LINES.get(storage, (0, (2, 1))))


def shade(color: str, amount: float) -> str:
    """``color`` (``#rrggbb``) mixed with white (``amount`` > 0) or black (< 0) by ``|amount|``."""
    rgb = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    target = 255 if amount > 0 else 0
    mixed = [round(c + (target - c) * abs(amount)) for c in rgb]
    return "#" + "".join(f"{c:02x}" for c in mixed)


def groups(names: Iterable[str], default_policy: str = DEFAULT_POLICY) -> list[tuple[str, list[str]]]:
    """The names split into :data:`GROUPS` (unknown ones last), at most :data:`MAX_SERIES` per group.

    Each group starts with the default policy in the model's dtype and the full cache (``kvcache``)
    as references when they are among ``names``; empty groups are left out.
    """
    names = list(dict.fromkeys(names))
    by_canonical = {canonical(n, default_policy): n for n in names}
    references = [by_canonical[r] for r in (default_policy, "kvcache") if r in by_canonical]
    out, placed = [], set(references)
    for title, members in GROUPS:
        chosen = [by_canonical[m] for m in members if m in by_canonical and by_canonical[m] not in placed]
        placed.update(chosen)
        out += _chunks(title, chosen)
    out += _chunks("other caches", [n for n in names if n not in placed])
    if not out and references:
        return [("caches", references)]
    return [(title, _with(references, chosen)) for title, chosen in out]


def _chunks(title: str, names: list[str]) -> list[tuple[str, list[str]]]:
    """``names`` in panels of ``MAX_SERIES - 2`` (room for the two references)."""
    return [(title, names[i : i + MAX_SERIES - 2]) for i in range(0, len(names), MAX_SERIES - 2)]


def _with(references: Sequence[str], chosen: Sequence[str]) -> list[str]:
    return [*[r for r in references if r not in chosen], *chosen]


def percent(fraction: float) -> str:
    """``0.125`` -> ``"12.5%"``."""
    return f"{fraction * 100:.3g}%"
