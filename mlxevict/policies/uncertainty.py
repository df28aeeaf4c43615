"""Prediction entropy (founding idea 2): evict less while the model is unsure.

Each entry carries an affinity ``Ω_t = σ(Ω_{t-1} + (q_t·k_i/√d)·β·H(p_t))`` where
``H(p_t)`` is the entropy of the next-token distribution at step ``t``; entries
with low affinity go first. The number of entries held, the effective budget,
moves between ``min_budget`` (model sure) and the cache budget (model unsure):
``budget_t = min + (max − min)·(1 − exp(−H̄_t/τ))`` with ``H̄`` an EMA of ``H(p_t)``.
Close relatives: CONF-KV, InfoKV (next-token confidence as an eviction signal).
Positions are applied in order, one Ω step per token, prompt tokens included.
"""

import math

import mlx.core as mx

from ..kernels import attention_logits_compiled
from .base import Policy

DEFAULT_BETA = 1.0
DEFAULT_MIN_FRACTION = 0.5
DEFAULT_TAU = 1.0  # nats
DEFAULT_EMA = 0.9


@mx.compile
def _affinity_step(omega: mx.array, logits: mx.array, entropy: mx.array, beta: float, visible: mx.array):
    """One Ω update: omega/logits/visible ``(B, H, C)``, entropy ``(B,)``."""
    updated = mx.sigmoid(omega + logits * beta * entropy[:, None, None])
    return mx.where(visible, updated, omega)


class UncertaintyPolicy(Policy):
    name = "uncertainty"
    source = "founding write-up (idea 2)"
    uses_prediction_entropy = True

    def __init__(
        self,
        beta: float = DEFAULT_BETA,
        min_fraction: float = DEFAULT_MIN_FRACTION,
        tau: float = DEFAULT_TAU,
        ema: float = DEFAULT_EMA,
    ):
        if not 0 < min_fraction <= 1:
            raise ValueError(f"min_fraction={min_fraction} must be in (0, 1]")
        self.beta, self.min_fraction, self.tau, self.ema = beta, min_fraction, tau, ema
        self._entropy_ema: mx.array | None = None

    def feed_prediction_entropy(self, cache, queries, query_pos, entropy) -> None:
        logits = attention_logits_compiled(queries, cache.dense_keys, cache.positions, query_pos, cache.scale)
        omega = cache.stats  # B, H, C
        for s in range(queries.shape[2]):
            visible = (cache.positions >= 0) & (cache.positions <= query_pos[s])
            omega = _affinity_step(omega, logits[:, :, s], entropy[:, s], self.beta, visible)
            step = entropy[:, s].mean()
            self._entropy_ema = (
                step if self._entropy_ema is None else self.ema * self._entropy_ema + (1 - self.ema) * step
            )
        cache.stats = omega

    def effective_budget(self, budget: int) -> int:
        if self._entropy_ema is None:
            return budget
        unsure = 1.0 - math.exp(-self._entropy_ema.item() / self.tau)  # syncs once per eviction
        low = math.ceil(self.min_fraction * budget)
        return int(round(low + (budget - low) * unsure))

    def score(self, cache) -> mx.array:
        return cache.stats

    def config(self) -> dict:
        return {"beta": self.beta, "min_fraction": self.min_fraction, "tau": self.tau, "ema": self.ema}

    def runtime_state(self) -> dict:
        return {} if self._entropy_ema is None else {"entropy_ema": self._entropy_ema.item()}

    def load_runtime_state(self, state: dict) -> None:
        if "entropy_ema" in state:
            self._entropy_ema = mx.array(state["entropy_ema"])
