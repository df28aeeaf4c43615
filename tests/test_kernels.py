"""Each compiled kernel against its plain-ops reference, on this machine's backend."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxevict import kernels

B, H, G, S, C, D = 1, 2, 3, 4, 24, 16


@pytest.fixture
def inputs():
    k = mx.random.key(0)
    k1, k2, k3 = mx.random.split(k, 3)
    queries = mx.random.normal((B, H * G, S, D), key=k1)
    keys = mx.random.normal((B, H, C, D), key=k2)
    positions = mx.broadcast_to(mx.where(mx.arange(C) < 20, mx.arange(C) * 2, -1), (B, H, C)).astype(mx.int32)
    query_pos = mx.array([36, 37, 38, -1], dtype=mx.int32)  # the last is a padding query
    scores = mx.random.uniform(shape=(B, H, C), key=k3)
    return queries, keys, positions, query_pos, scores


def test_attention_probs(inputs):
    q, k, pos, qpos, _ = inputs
    ref = kernels.attention_probs(q, k, pos, qpos, 0.25)
    assert mx.allclose(kernels.attention_probs_compiled(q, k, pos, qpos, 0.25), ref, atol=1e-6).item()
    rows = ref.sum(axis=-1)  # B, H, G, S
    assert mx.allclose(rows[..., :3], mx.ones_like(rows[..., :3]), atol=1e-5).item()
    assert (rows[..., 3] == 0).all().item()  # padding query has no attention
    assert (ref[..., 20:] == 0).all().item()  # empty slots get none
    assert (ref[:, :, :, 0, 19] == 0).all().item()  # position 38 is in the future of query 36


def test_exp_poly_matches_exp_to_float_precision():
    x = mx.concatenate([mx.linspace(-87.0, 0.0, 20001), mx.array([-0.0, -1e-8, -0.5, -1.0])])
    fast, ref = mx.compile(kernels.exp_poly)(x), mx.exp(x)
    assert (mx.abs(fast - ref) <= 2e-6 * ref).all().item()
    assert kernels.exp_poly(mx.array([0.0])).item() == 1.0
    # Far below (masked logits): 2^-126, a probability of 0 after any softmax over a real entry.
    tiny = kernels.exp_poly(mx.array([-1e30, -200.0]))
    assert (tiny > 0).all().item() and (tiny < 1.2e-38).all().item()
    rows = mx.random.normal((5, 300), key=mx.random.key(2)) * 10
    assert mx.allclose(kernels.softmax_poly(rows), mx.softmax(rows, axis=-1, precise=True), rtol=2e-6, atol=1e-9).item()


def test_attention_logits(inputs):
    q, k, pos, qpos, _ = inputs
    ref = kernels.attention_logits(q, k, pos, qpos, 0.25)
    assert mx.allclose(kernels.attention_logits_compiled(q, k, pos, qpos, 0.25), ref, atol=1e-5).item()


def test_row_entropy_bounds(inputs):
    q, k, pos, qpos, _ = inputs
    probs = kernels.attention_probs(q, k, pos, qpos, 0.25)
    ref = kernels.row_entropy(probs)
    assert mx.allclose(kernels.row_entropy_compiled(probs), ref, atol=1e-5).item()
    uniform = mx.full((1, 1, 1, 1, 8), 1 / 8)
    assert abs(kernels.row_entropy(uniform).item() - mx.log(mx.array(8.0)).item()) < 1e-5
    one_hot = mx.array([[[[[1.0, 0, 0, 0]]]]])
    assert kernels.row_entropy(one_hot).item() == pytest.approx(0.0, abs=1e-6)


def test_prediction_entropy():
    logits = mx.random.normal((2, 3, 50), key=mx.random.key(4))
    ref = kernels.prediction_entropy(logits)
    assert mx.allclose(kernels.prediction_entropy_compiled(logits), ref, atol=1e-5).item()
    assert kernels.prediction_entropy(mx.zeros((1, 50))).item() == pytest.approx(mx.log(mx.array(50.0)).item())


def test_key_redundancy(inputs):
    _, k, pos, _, _ = inputs
    ref = kernels.key_redundancy(k, pos)
    assert mx.allclose(kernels.key_redundancy_compiled(k, pos), ref, atol=1e-6).item()
    assert mx.allclose(ref.sum(axis=-1), mx.ones((B, H)), atol=1e-5).item()
    duplicated = mx.concatenate([k[:, :, :1]] * 3 + [k[:, :, 3:]], axis=2)  # slots 0-2 equal
    red = kernels.key_redundancy(duplicated, pos)
    assert (red[..., 0] > red[..., 5]).all().item()


def test_priority_and_compact(inputs):
    _, k, pos, _, scores = inputs
    pinned = mx.array([[10, 12]], dtype=mx.int32)
    offset = mx.array(40)
    ref = kernels.priority(scores, pos, offset, 2, 4, pinned)
    assert mx.allclose(kernels.priority_compiled(scores, pos, offset, 2, 4, pinned), ref).item()
    slots = [pos, k, k[..., :3], scores]
    out_ref = kernels.compact(ref, mx.array(9), slots)
    out = kernels.compact_compiled(ref, mx.array(9), slots)
    assert all(mx.array_equal(a, b).item() for a, b in zip(out, out_ref))
    new_pos = out_ref[0][0, 0].tolist()
    kept_pos = new_pos[:9]
    # sinks 0, 2; pinned 10; recent window (>= 36): 36, 38; then the 4 best scored
    assert {0, 2, 10, 36, 38} <= set(kept_pos) and kept_pos == sorted(kept_pos)
    assert new_pos[9:] == [-1] * (C - 9)
    scored = [p for p in kept_pos if p not in (0, 2, 10, 36, 38)]
    by_score = sorted(range(20), key=lambda i: -scores[0, 0, i].item())
    candidates = [2 * i for i in by_score if 2 * i not in (0, 2, 10, 36, 38)]
    assert sorted(scored) == sorted(candidates[:4])


def test_compact_of_an_array_without_the_newest_slots(inputs):
    """Quantized storage leaves its newest (always kept) slots to a full-precision buffer."""
    _, k, pos, _, scores = inputs
    ref = kernels.priority(scores, pos, mx.array(40), 2, 4, mx.array([[0, 0]], dtype=mx.int32))
    short = k[:, :, :18]  # slots 18, 19 (positions 36, 38) live elsewhere; 20+ are empty
    out_ref = kernels.compact(ref, mx.array(9), [pos, k, short])
    out = kernels.compact_compiled(ref, mx.array(9), [pos, k, short])
    assert all(mx.array_equal(a, b).item() for a, b in zip(out, out_ref))
    assert out_ref[2].shape == short.shape
    assert mx.array_equal(out_ref[2][:, :, :7], out_ref[1][:, :, :7]).item()  # the 9 kept minus the 2 newest


def test_pool_keys_preserves_mass():
    x = mx.random.uniform(shape=(1, 2, 30), key=mx.random.key(7))
    pooled = kernels.pool_keys(x, 5)
    assert pooled.shape == x.shape
    assert mx.allclose(pooled[..., 10], x[..., 8:13].mean(axis=-1)).item()
