"""StreamingLLM: attention sinks plus the most recent tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", 2023
(https://arxiv.org/abs/2309.17453). Equal to mlx-lm's ``RotatingKVCache(max_size, keep)``.
"""

import mlx.core as mx

from .base import Policy


class WindowPolicy(Policy):
    name = "window"
    source = "https://arxiv.org/abs/2309.17453"

    def score(self, cache) -> mx.array:
        return cache.positions.astype(mx.float32)  # newest wins; sinks are protected
