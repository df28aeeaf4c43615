"""The default: keep the prompt whole, score the reasoning with SnapKV's observation window.

A reasoning model's chain of thought serves the question, but a long stretch of
thinking rarely attends back to it, so attention-based scores (and the recent
window) let the facts of the prompt decay. This policy pins the prompt (when it
fits in 3/4 of the room the budget leaves) and ranks everything else as
:class:`SnapKVPolicy` does, the best fidelity among the single signals measured
in ``docs/results``. See README, "Choosing the default".
"""

from .snapkv import SnapKVPolicy


class AnchoredPolicy(SnapKVPolicy):
    name = "anchored"
    source = "mlxevict evaluation (docs/results): prompt pinning + https://arxiv.org/abs/2404.14469"
    pins_prompt = True
    # A quarter of the budget (at most 64) for the newest tokens, not the cache's eighth:
    # it beat `window` on fidelity at 25% on both task seeds measured, the eighth on one
    # (branch experiment/prompt-anchors, docs/experiments/prompt_anchors.md).
    recent_window = (64, 4)
