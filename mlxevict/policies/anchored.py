"""The default: keep the prompt whole, score the reasoning with SnapKV's observation window.

A reasoning model's chain of thought serves the question, but a long stretch of
thinking rarely attends back to it, so attention-based scores (and the recent
window) let the facts of the prompt decay. This policy pins the prompt (when it
fits in 3/4 of the room the budget leaves) and ranks everything else as
:class:`SnapKVPolicy` does, the best fidelity among the single signals measured
in ``docs/results``. See docs/results/history.md, "Choosing the default".
"""

from .snapkv import DEFAULT_KERNEL, SnapKVPolicy

OBSERVATION_WINDOW = 32  # SnapKV's 64 is for compressing a prompt once; decode scores every few steps


class AnchoredPolicy(SnapKVPolicy):
    name = "anchored"
    source = "mlxevict evaluation (docs/results): prompt pinning + https://arxiv.org/abs/2404.14469"
    pins_prompt = True
    # A quarter of the budget (at most 64) for the newest tokens, not the cache's eighth:
    # it beat `window` on fidelity at 25% on both task seeds measured, the eighth on one
    # (docs/results/prompt_anchors.md).
    recent_window = (64, 4)

    def __init__(self, observation_window: int = OBSERVATION_WINDOW, kernel: int = DEFAULT_KERNEL):
        # 32 queries, not 64: the same fidelity on both task seeds at 25% and 50% (within
        # +-0.01 top-1) for a third less scoring work per eviction (docs/results/README.md).
        super().__init__(observation_window, kernel)
