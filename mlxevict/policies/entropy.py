"""Attention-weight entropy (founding idea 1): unfocused tokens are glue, evict them first.

A token's score is the Shannon entropy of its own attention row, computed once
when the token is processed (per head, averaged over each kv-head's query group).
High entropy = the token looked everywhere = "glue"; low entropy = a logical anchor.
Founding write-up (the project brief; results in docs/results/long/README.md). Note the nearest published use of
attention entropy (e.g. CAKE, https://arxiv.org/abs/2503.12491) runs the other way:
it gives *more* budget to high-entropy layers.
"""

import mlx.core as mx

from ..kernels import attention_probs_compiled, query_pieces, row_entropy_compiled
from .base import Policy


class EntropyPolicy(Policy):
    name = "entropy"
    source = "founding write-up (idea 1)"
    observes = True

    def observe(self, cache, queries, query_pos) -> None:
        S = queries.shape[2]
        keys, positions = cache.dense_keys, cache.positions
        entropy = mx.concatenate(  # B, H, S; each row on its own, so pieces give the same rows
            [
                row_entropy_compiled(attention_probs_compiled(q, keys, positions, pos, cache.scale))
                for q, pos in query_pieces(queries, query_pos)
            ],
            axis=-1,
        )
        # New tokens sit in the last S filled slots; low entropy scores high.
        end = cache.size()
        cache.stats[..., end - S : end] = -entropy

    def score(self, cache) -> mx.array:
        return cache.stats
