"""Scoring and compaction kernels: a plain-ops reference and a compiled twin of each.

Every function works on the cache's full, fixed-capacity buffers (``C`` slots)
with a validity mask derived from ``positions`` (-1 marks an empty slot), so
shapes never change during generation and ``mx.compile`` traces each kernel once
per cache shape. Shapes: ``B`` batch, ``H`` kv-heads, ``G`` query heads per
kv-head (GQA), ``S`` new queries, ``C`` cache slots, ``D`` head dim.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

NEG_INF = -1e30  # finite, so 0 * NEG_INF stays finite inside entropies
PROTECTED = 1e30
# Queries whose attention rows an observing policy computes at once: a whole prompt chunk's would hold
# (S, C) float32 per query head beside the model's own attention (at 230 tokens on the demo model, 1 MiB
# of peak above mlx-lm's KVCache; in pieces, below it).
QUERY_PIECE = 64


def query_pieces(queries: mx.array, query_pos: mx.array) -> list[tuple[mx.array, mx.array]]:
    """``(B, H*G, S, D)`` queries and their ``(S,)`` positions in pieces of at most :data:`QUERY_PIECE`."""
    S = queries.shape[2]
    return [(queries[:, :, a : a + QUERY_PIECE], query_pos[a : a + QUERY_PIECE]) for a in range(0, S, QUERY_PIECE)]


LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
ROUNDER = 1.5 * 2**23  # y + ROUNDER rounds y to an integer in float32, by addition alone


def exp_poly(x: mx.array) -> mx.array:
    """``exp(x)`` for float32 ``x ≤ 0`` by additions, multiplications and bit moves only, which
    ``mx.compile`` fuses into one vectorized kernel.

    ``exp(x) = 2^n · e^t`` with ``n = round(x·log2 e)`` and ``|t| ≤ ln2 / 2``: ``n`` is rounded by adding
    :data:`ROUNDER` (whose float then holds ``n + 127`` in its low mantissa bits, moved to the exponent
    field for ``2^n``), ``e^t`` by its Taylor series to the 7th power (relative error under 1e-6). ``x``
    below ``-87`` gives ``2^-126``, not 0. MLX's CPU ``exp`` and ``floor`` are not vectorized
    here: ``python -m mlxevict.benchmarks.scoring`` times the difference.
    """
    y = mx.maximum(x * LOG2E, -126.0)
    z = y + (ROUNDER + 127.0)
    t = (y - (z - (ROUNDER + 127.0))) * LN2
    p = 1.0 + t * (1.0 + t * (1 / 2 + t * (1 / 6 + t * (1 / 24 + t * (1 / 120 + t * (1 / 720 + t / 5040))))))
    return p * mx.view(mx.view(z, mx.int32) << 23, mx.float32)


def softmax_poly(x: mx.array) -> mx.array:
    """Softmax over the last axis with :func:`exp_poly` (float32), for the compiled kernels."""
    e = exp_poly(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _softmax(x: mx.array) -> mx.array:
    return mx.softmax(x, axis=-1, precise=True)


def attention_probs(
    queries: mx.array,
    keys: mx.array,
    positions: mx.array,
    query_pos: mx.array,
    scale: float,
    softmax=_softmax,
) -> mx.array:
    """Causal attention probabilities of ``queries`` over the cached ``keys``.

    Args:
        queries: ``(B, H*G, S, D)`` after RoPE, as the model's attention sees them.
        keys: ``(B, H, C, D)`` the cache buffer.
        positions: ``(B, H, C)`` absolute position of each slot, -1 if empty.
        query_pos: ``(S,)`` absolute positions of the queries (-1: padding query).
        scale: the attention scale (``1/sqrt(D)`` for these models).
        softmax: ``mx.softmax`` (this reference) or :func:`softmax_poly` (the compiled twin).

    Returns:
        ``(B, H, G, S, C)`` float32 probabilities; rows of padding queries are 0.
    """
    B, HG, S, D = queries.shape
    H = keys.shape[1]
    q = queries.reshape(B, H, HG // H, S, D).astype(mx.float32)  # B, H, G, S, D
    k = keys.astype(mx.float32)[:, :, None]  # B, H, 1, C, D
    logits = (q * scale) @ k.swapaxes(-1, -2)  # B, H, G, S, C
    visible = (positions[:, :, None, None, :] >= 0) & (
        positions[:, :, None, None, :] <= query_pos[:, None]
    )  # B, H, 1, S, C
    probs = softmax(mx.where(visible, logits, NEG_INF))
    return mx.where(visible, probs, 0.0) * (query_pos[:, None] >= 0)


def attention_logits(
    queries: mx.array, keys: mx.array, positions: mx.array, query_pos: mx.array, scale: float
) -> mx.array:
    """Scaled logits ``q·k/sqrt(d)`` averaged over each kv-head's query group.

    Returns:
        ``(B, H, S, C)`` float32, 0 where a key is not visible to the query.
    """
    B, HG, S, D = queries.shape
    H = keys.shape[1]
    q = queries.reshape(B, H, HG // H, S, D).astype(mx.float32)
    logits = (q * scale) @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)
    visible = (positions[:, :, None, :] >= 0) & (positions[:, :, None, :] <= query_pos[:, None])
    return mx.where(visible, logits.mean(axis=2), 0.0)  # B, H, S, C


def row_entropy(probs: mx.array) -> mx.array:
    """Shannon entropy (nats) of each attention row, averaged over the query group.

    Args:
        probs: ``(B, H, G, S, C)`` from :func:`attention_probs`.

    Returns:
        ``(B, H, S)``.
    """
    plogp = probs * mx.log(mx.maximum(probs, 1e-30))
    return -plogp.sum(axis=-1).mean(axis=2)


def prediction_entropy(logits: mx.array) -> mx.array:
    """Entropy (nats) of the next-token distribution ``softmax(logits)`` over the last axis."""
    logits = logits.astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -(mx.exp(logp) * logp).sum(axis=-1)


def pool_keys(scores: mx.array, kernel: int) -> mx.array:
    """Average-pool scores along the slot axis (SnapKV's clustering of neighbours).

    Slots are kept in time order, so neighbouring slots are neighbouring tokens.
    """
    if kernel <= 1:
        return scores
    pad = kernel // 2
    C = scores.shape[-1]
    padded = mx.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(pad, pad)])
    return sum(padded[..., i : i + C] for i in range(kernel)) / kernel


def key_redundancy(keys: mx.array, positions: mx.array) -> mx.array:
    """R-KV's redundancy: mean cosine similarity of each key to the other valid keys.

    Returns:
        ``(B, H, C)``, softmax-normalised over the valid slots (higher = more redundant).
    """
    k = keys.astype(mx.float32)
    k = k / mx.maximum(mx.linalg.norm(k, axis=-1, keepdims=True), 1e-6)  # B, H, C, D
    sim = k @ k.swapaxes(-1, -2)  # B, H, C, C
    valid = positions >= 0  # B, H, C
    C = keys.shape[2]
    pair = valid[..., :, None] & valid[..., None, :] & ~mx.eye(C, dtype=mx.bool_)
    n = mx.maximum(pair.sum(axis=-1), 1)
    mean_sim = mx.where(pair, sim, 0.0).sum(axis=-1) / n  # B, H, C
    return mx.softmax(mx.where(valid, mean_sim, NEG_INF), axis=-1)


def priority(
    scores: mx.array,
    positions: mx.array,
    offset: mx.array,
    sinks: int,
    window: int,
    pinned: mx.array,
) -> mx.array:
    """Turn a policy's scores into a keep-priority: protected slots first, empty last.

    Args:
        scores: ``(B, H, C)`` higher = keep.
        positions: ``(B, H, C)`` absolute positions, -1 empty.
        offset: scalar, tokens seen so far (the next position).
        sinks: the first ``sinks`` positions are always kept (attention sinks).
        window: the last ``window`` positions are always kept (recent window).
        pinned: ``(P, 2)`` int32 half-open ``[start, end)`` spans always kept.
    """
    protected = (positions < sinks) | (positions >= offset - window)
    inside = (positions[..., None] >= pinned[:, 0]) & (positions[..., None] < pinned[:, 1])
    protected = protected | inside.any(axis=-1)
    ranked = mx.where(protected, PROTECTED, scores.astype(mx.float32))
    return mx.where(positions >= 0, ranked, -2 * PROTECTED)


def compact(rank_key: mx.array, n_keep: mx.array, slots: list[mx.array]) -> list[mx.array]:
    """Keep the ``n_keep`` highest-priority slots per head, moved to the front in time order.

    Args:
        rank_key: ``(B, H, C)`` priority from :func:`priority`.
        n_keep: scalar int, how many slots each head keeps.
        slots: per-slot arrays shaped ``(B, H, C, ...)``; the first is ``positions``.
            An array with fewer slots (``C' < C``) holds only the oldest ``C'``;
            the newest slots live elsewhere and must be kept (quantized storage
            leaves them to a full-precision buffer), so its kept slots all come
            first in the new order and its tail is left unspecified.

    Returns:
        Each array of ``slots`` gathered into the new order; positions of the
        dropped tail are set to -1.
    """
    C = rank_key.shape[-1]
    order = mx.argsort(-rank_key, axis=-1)  # B, H, C: best first
    rank = mx.argsort(order, axis=-1)  # B, H, C: rank of each slot
    slot = mx.arange(C)
    keep = rank < n_keep
    new_order = mx.argsort(mx.where(keep, slot, slot + C), axis=-1)  # kept first, in time order
    gathered = []
    for x in slots:
        idx = new_order
        if x.shape[2] < C:
            idx = mx.minimum(new_order[..., : x.shape[2]], x.shape[2] - 1)
        idx = idx.reshape(idx.shape + (1,) * (x.ndim - 3))
        gathered.append(mx.take_along_axis(x, idx, axis=2))
    gathered[0] = mx.where(slot < n_keep, gathered[0], -1)
    return gathered


def gqa_mean(x: mx.array) -> mx.array:
    """``(B, H, G, S, C)`` → ``(B, H, C)``: sum over queries, mean over the group."""
    return x.sum(axis=3).mean(axis=2)


attention_probs_compiled = mx.compile(partial(attention_probs, softmax=softmax_poly))
attention_logits_compiled = mx.compile(attention_logits)
row_entropy_compiled = mx.compile(row_entropy)
prediction_entropy_compiled = mx.compile(prediction_entropy)
key_redundancy_compiled = mx.compile(key_redundancy)
priority_compiled = mx.compile(priority)
compact_compiled = mx.compile(compact)
