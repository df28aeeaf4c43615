"""The policy registry: names (``--policy NAME``) to policy classes."""

from __future__ import annotations

from typing import Any

from .anchored import AnchoredPolicy
from .base import Policy
from .entropy import EntropyPolicy
from .full import FullPolicy
from .h2o import H2OPolicy
from .knorm import KnormPolicy
from .random import RandomPolicy
from .rkv import RKVPolicy
from .snapkv import SnapKVPolicy
from .tova import TOVAPolicy
from .uncertainty import UncertaintyPolicy
from .window import WindowPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        AnchoredPolicy,
        EntropyPolicy,
        UncertaintyPolicy,
        WindowPolicy,
        H2OPolicy,
        TOVAPolicy,
        SnapKVPolicy,
        RKVPolicy,
        KnormPolicy,
        RandomPolicy,
        FullPolicy,
    )
}

# Which policy "default" means, and why: docs/results/history.md, "Choosing the default".
DEFAULT_POLICY = "anchored"


def policy_names() -> list[str]:
    """Every name ``make_policy`` accepts, ``default`` first."""
    return ["default", *POLICIES]


def make_policy(name: str, **kwargs: Any) -> Policy:
    """Build a policy by registry name.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    resolved = DEFAULT_POLICY if name == "default" else name
    if resolved not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(policy_names())}")
    return POLICIES[resolved](**kwargs)


__all__ = ["Policy", "POLICIES", "DEFAULT_POLICY", "make_policy", "policy_names"]
