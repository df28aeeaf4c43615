"""The long suite's plan: which caches run under which budgets and protocols (:mod:`.long_eval` runs it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .caches import REFERENCE, CacheSettings
from .long_tasks import KINDS

PROTOCOLS = ("stream", "compress")
CHUNK = 64
MEMORY_FRACTIONS = (0.25, 0.125)
SEEDS = {"tuning": 0, "test": 1}
SPLITS = tuple(SEEDS)  # in the order they run
CHOSEN = "chosen"  # the test half's name for the storage the tuning half picked
# The product's row: the memory rule's storage at each share (long_eval.product_storage), resolved per run, so a
# variant spelled like one of the rule's storages stays the storage it names.
PRODUCT = "product"
ONE_TIER = "default:k5v3w8c64"  # the rule before the tiers: one 5/3 tier, keys per channel, then eviction
PARTS = ("baselines", "policies", "compress", "memory", "chosen")  # "variants": also every simulated storage
# The default run: what the targets compare at 25% and 12.5% of the bytes, sized to the ~30 min asked on an idle
# 2-core CPU with SmolLM2-135M (30 min 8 s at c61d334; 32.5 min while the tuning half also ran the one-tier
# rule, now in --long; docs/results/long/README.md). `--long` (LONG): the whole matrix, 1k-8k tokens.
TOKEN_FRACTIONS = (0.25, 0.125)
TUNING_LENGTHS = (1024,)  # shorter than the test half's contexts: the settings are tested past what they were tuned on
TEST_POLICIES = ("default", "snapkv")
COMPRESS_POLICIES = ("snapkv",)
COMPRESS_FRACTIONS = (0.25,)
TUNING_VARIANTS: tuple[str, ...] = ()  # the tuning half's candidates beside the product and the 16-bit default
BASELINES = ("quantized4",)
LONG = dict(
    lengths=(1024, 2048, 4096, 8192), tuning_lengths=(1024, 2048), token_fractions=(0.5, 0.25, 0.125), compress_fractions=(0.5, 0.25, 0.125),
    policies=("default", "window", "snapkv", "entropy", "uncertainty", "tova", "h2o"), compress_policies=("default", "snapkv"),
    baselines=("quantized8", "quantized4", "quantized3"), variants=(ONE_TIER, "kivi-k5v3", "tiers-k3v2"),
)


@dataclass(frozen=True)
class Run:
    """One cache under one budget and protocol. ``budget_of``: ``"tokens"``, ``"memory"`` or ``None``."""

    cache: str
    budget_of: str | None = None
    fraction: float | None = None
    protocol: str = "stream"

    @property
    def label(self) -> str:
        budget = "" if self.fraction is None else f" @ {self.fraction:g} {self.budget_of}"
        return f"{self.cache} [{self.protocol}]{budget}"


@dataclass(frozen=True)
class LongConfig:
    """What the long suite runs; the defaults are the default run (see ``LONG`` for ``--long``)."""

    lengths: tuple[int, ...] = (1024, 2048)
    tuning_lengths: tuple[int, ...] | None = TUNING_LENGTHS  # the tuning half's contexts; None: ``lengths``
    kinds: tuple[str, ...] = KINDS
    instances: int = 1
    fidelity_texts: int = 2
    fidelity_length: int = 2048
    fidelity_scored: int = 256
    recall_texts: int = 1  # texts of fidelity_length whose scored tail restates a passage 1-2k tokens back
    policies: tuple[str, ...] = TEST_POLICIES
    compress_policies: tuple[str, ...] = COMPRESS_POLICIES
    token_fractions: tuple[float, ...] = TOKEN_FRACTIONS
    compress_fractions: tuple[float, ...] = COMPRESS_FRACTIONS
    memory_fractions: tuple[float, ...] = MEMORY_FRACTIONS
    variants: tuple[str, ...] = TUNING_VARIANTS
    baselines: tuple[str, ...] = BASELINES
    splits: tuple[str, ...] = SPLITS
    parts: tuple[str, ...] = PARTS  # which groups of the test half's runs
    reference_dir: str | None = None  # keep the full cache's outcomes here, for runs split across processes
    chunk: int = CHUNK
    settings: CacheSettings = field(default_factory=CacheSettings)

    def check(self) -> None:
        """One error line for a name the suite does not know, before any model loads (else a run fails later)."""
        from mlxevict.errors import MlxEvictError

        from .caches import UNBUDGETED, check_cache
        from .storage_variants import VARIANTS

        for flag, n, least in (("--fidelity-texts", self.fidelity_texts, 0), ("--recall-texts", self.recall_texts, 0),
                               ("--instances", self.instances, 1)):
            if n < least:
                raise MlxEvictError(f"{flag} {n}: give {least} or more")
        for flag, names, known in (("--kinds", self.kinds, KINDS), ("--splits", self.splits, SPLITS),
                                   ("--parts", self.parts, (*PARTS, "variants")), ("--baselines", self.baselines, UNBUDGETED)):
            for name in names:
                if name not in known:
                    raise MlxEvictError(f"{flag} {name}: choose from {', '.join(known)}")
        for flag, names in (("--policies", self.policies), ("--compress-policies", self.compress_policies),
                            ("--variants", tuple(v for v in self.variants if v not in VARIANTS))):
            for name in names:
                check_cache(name, flag)

    def lengths_of(self, split: str) -> tuple[int, ...]:
        """The retrieval contexts of a half."""
        return self.tuning_lengths if split == "tuning" and self.tuning_lengths is not None else self.lengths

    def runs(self, split: str) -> list[Run]:
        """The tuning half: the default policy and every storage candidate per memory budget.
        The test half: mlx-lm's caches, every policy per token budget and protocol, and the picked storage."""
        mem = [Run(c, "memory", f) for f in self.memory_fractions for c in ("default", PRODUCT)]
        if split == "tuning":
            storages = (*(("default", PRODUCT) if "memory" in self.parts else ()), *self.variants)
            return [Run(REFERENCE), *(Run(c, "memory", f) for f in self.memory_fractions for c in storages)]
        groups = {
            "baselines": [Run(b) for b in self.baselines] + [Run("rotating", "tokens", f) for f in self.token_fractions],
            "policies": [Run(p, "tokens", f) for p in self.policies for f in self.token_fractions],
            "compress": [Run(p, "tokens", f, "compress") for p in self.compress_policies for f in self.compress_fractions],
            "memory": mem,
            "variants": [Run(v, "memory", f) for f in self.memory_fractions for v in self.variants],
            "chosen": [Run(CHOSEN, "memory", f) for f in self.memory_fractions],
        }
        return [Run(REFERENCE), *(r for part in self.parts for r in groups[part])]


def config_json(config: LongConfig) -> dict[str, Any]:
    out = {k: getattr(config, k) for k in LongConfig.__dataclass_fields__ if k != "settings"}
    out["settings"] = vars(config.settings)
    out["seeds"] = SEEDS
    return json.loads(json.dumps(out, default=list))


def total_runs(config: LongConfig) -> int:
    return sum(len(config.runs(s)) for s in config.splits)
