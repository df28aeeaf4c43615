"""Precision tiers (``low_bits``): demote by the policy's score before evicting, on random-weight models (fast)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from tiny_models import random_tokens, run_chunks, tiny_model

from mlxevict import make_cache
from mlxevict.channel_codes import token_dequantize, unpack_planes
from mlxevict.kvstorage import FLAGS, KVStorage
from mlxevict.budget import storage_nbytes
from mlxevict.plan import plan_cache
from mlxevict.rotation import rotation_matrix
from mlxevict.stats import cache_stats
from mlxevict.tiered_storage import TieredStorage, _nbytes

D = 64
TIERS = dict(kv_bits=(5, 3), kv_group_size=D, window_bits=8, key_group=64, low_bits=(3, 2))


def model64(**overrides):
    return tiny_model("llama", head_dim=D, hidden_size=128, **overrides)


def tiers_of(caches) -> list[tuple[int, int, int]]:
    """``(low, high, held)`` entries of each layer."""
    return [(c.storage.n_low(c.size()), c.storage.n_high, c.storage.n_full) for c in caches]


def reference_entries(storage: TieredStorage, size: int) -> tuple[mx.array, mx.array]:
    """Keys and values dequantized by hand from what the storage holds, unrotated: ``(B, H, size, D)``."""
    ((low, high), held_k), ((low_v, high_v), held_v) = storage.fetch(size)
    table_s, table_b = high[2], high[3]

    def keys(codes, rows, bits, bucket):  # a low code reads the middle of its bucket of `bucket` high codes
        idx = rows[..., None].astype(mx.int32)
        s, b = mx.take_along_axis(table_s, idx, axis=2), mx.take_along_axis(table_b, idx, axis=2)
        return (unpack_planes(codes, bits).astype(mx.float32) * bucket + (bucket - 1) / 2) * s + b

    R = rotation_matrix(D)
    k = [keys(*low[:2], 3, 4.0), keys(*high[:2], 5, 1.0), mx.dequantize(*held_k, group_size=D, bits=8) @ R.T]
    v = [token_dequantize(*low_v, 2, D) @ R.T, token_dequantize(*high_v, 3, D) @ R.T,
         mx.dequantize(*held_v, group_size=D, bits=8) @ R.T]  # fmt: skip
    return mx.concatenate(k, axis=2), mx.concatenate(v, axis=2)


@pytest.mark.parametrize("mask", [None, "causal", "array"])
def test_attention_equals_attention_over_the_dequantized_tiers(mask):
    """Both tiers and the held rows in one softmax: the decode kernel (no mask) and the prompt path."""
    model = model64(layers=1)
    caches = make_cache(model, "default", 300, **TIERS)
    run_chunks(model, caches, random_tokens(296), [40] * 7 + [1] * 16)
    c, storage = caches[0], caches[0].storage
    low, high, held = tiers_of(caches)[0]
    assert low > 0 and high > 0 and held > 0 and c.evictions == 0
    keys, values = reference_entries(storage, c.size())
    assert mx.allclose(c.dense_keys[..., : c.size(), :], keys, atol=1e-5).item()
    L = 1 if mask is None else 5
    queries = mx.random.normal((1, 4, L, D), key=mx.random.key(7))
    N = keys.shape[2]
    m = mx.arange(N - L, N)[:, None] >= mx.arange(N)[None] if mask == "array" else mask
    got = storage.attend(queries, *storage.fetch(c.size()), D**-0.5, m)
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=D**-0.5, mask=m)
    assert mx.allclose(got, expected, atol=1e-5).item()


def test_nothing_is_evicted_while_the_low_tier_holds_the_budget():
    """Demotion comes first: every token fed is kept, the high tier shrinks to what the bytes allow."""
    model = model64()
    caches = make_cache(model, "default", 700, **TIERS)
    seen = []
    run_chunks(model, caches, random_tokens(660), [60] * 6 + [1] * 300, after=lambda n: seen.append(tiers_of(caches)[0]))
    assert all(c.evictions == 0 and c.size() == 660 for c in caches)
    assert seen[2][0] == 0 and seen[-1][0] > 0  # all high at first, then demoted
    s = caches[0].storage
    high_slot = _nbytes(s.keys[:2] + s.values, 4, per_slot=True) * s.keys[1].shape[1]  # every kv-head
    assert s.nbytes <= s.memory and s.memory - s.nbytes < 64 * high_slot  # no demotion beyond what fits


def test_a_budget_in_memory_past_the_context_is_spent_whole():
    """Not capped at the model's context: the bytes beyond the context's low-tier entries keep entries high."""
    model = model64(max_position_embeddings=1024)
    rule = {**TIERS, "kv_bits": (5, 4)}  # the memory rule's tiers where it evicts little
    storage = KVStorage.of((5, 4), D, window_bits=8, key_group=64, low_bits=(3, 2))
    nbytes = storage_nbytes(model, 1200, storage)  # 1,200 low-tier entries: more than the context
    plan = plan_cache(model, f"{nbytes}B")
    assert plan.storage == storage and plan.tokens == 1200 and plan.notes == ()
    spent, capped = make_cache(model, "default", f"{nbytes}B"), make_cache(model, "default", 1024, **rule)
    for caches in (spent, capped):
        run_chunks(model, caches, random_tokens(1000), [100] * 10)
    assert all(c.evictions == 0 and c.size() == 1000 for c in spent + capped)
    assert cache_stats(capped).nbytes < cache_stats(spent).nbytes <= nbytes
    assert sum(c.storage.n_high for c in capped) < sum(c.storage.n_high for c in spent)


@pytest.mark.parametrize("policy", ["default", "window", "random"])
def test_bytes_never_exceed_the_budget_nor_a_full_cache(policy):
    model = model64()
    plan = plan_cache(model, 200, KVStorage.of((5, 3), D, window_bits=8, key_group=64, low_bits=(3, 2)))
    caches = make_cache(model, policy, plan.tokens, **TIERS)
    tokens = random_tokens(900)
    for i in range(0, 900, 25):
        run_chunks(model, caches, tokens[i : i + 25], [25] if i < 400 else [1] * 25)
        stats, s = cache_stats(caches), caches[0].storage
        parts = (s.keys, s.values, s.fp_keys, s.fp_values, s.low_keys, s.low_values)
        assert s.nbytes == sum(x.nbytes for part in parts for x in part) and s.nbytes <= s.memory
        assert stats.nbytes <= plan.nbytes(model) and stats.nbytes <= stats.full_nbytes
        assert max(c.storage.table_rows for c in caches) <= s.max_rows(plan.tokens)
    assert caches[0].evictions > 0 and s.memory * len(caches) == plan.nbytes(model)


def test_the_lowest_ranked_entries_are_demoted():
    """``window`` ranks by recency: the low tier holds older positions than the high tier (sinks stay high)."""
    model = model64(layers=2)
    caches = make_cache(model, "window", 600, sinks=4, **TIERS)
    run_chunks(model, caches, random_tokens(520), [40] * 13)
    for c in caches:
        low, high, _ = tiers_of([c])[0]
        assert low > 0 and high > 4
        positions = c.positions
        low_pos, high_pos = positions[..., :low], positions[..., low : low + high]
        assert (low_pos >= 4).all().item()
        assert (low_pos.max(axis=-1) < mx.where(high_pos < 4, 10**6, high_pos).min(axis=-1)).all().item()


def test_a_demoted_key_is_its_high_code_without_its_low_bits():
    model = model64(layers=1)
    caches = make_cache(model, "window", 600, **TIERS)
    run_chunks(model, caches, random_tokens(200), [40] * 5)
    s = caches[0].storage
    ((low, high), _), _ = s.fetch(caches[0].size())
    before = caches[0].positions
    codes = unpack_planes(high[0], 5)
    v_codes, v_scales, v_biases = unpack_planes(s.values[0], 3), s.values[1], s.values[2]
    run_chunks(model, caches, random_tokens(360), [40] * 9)  # more groups: the oldest high entries go down
    ((low2, _), _), ((low2_v, _), _) = s.fetch(caches[0].size())
    assert low2[0].shape[2] > low[0].shape[2]
    n_low, positions = low[0].shape[2], caches[0].positions
    # The first demoted slot of each head holds an entry that was in the high tier before.
    for h in range(positions.shape[1]):
        p = positions[0, h, n_low].item()
        was = [i for i in range(before.shape[2]) if before[0, h, i].item() == p][0] - n_low
        assert mx.array_equal(unpack_planes(low2[0][0, h, n_low], 3), codes[0, h, was] >> 2).item()
        # Its value: codes without their low bit, read at the middle of each pair of 3-bit codes.
        assert mx.array_equal(unpack_planes(low2_v[0][0, h, n_low], 2), v_codes[0, h, was] >> 1).item()
        assert mx.allclose(low2_v[1][0, h, n_low], 2 * v_scales[0, h, was]).item()
        assert mx.allclose(low2_v[2][0, h, n_low], v_biases[0, h, was] + v_scales[0, h, was] / 2).item()


def test_save_and_load_continue_identically(tmp_path):
    model = model64()
    caches = make_cache(model, "default", 200, **TIERS)
    tokens = random_tokens(400)
    run_chunks(model, caches, tokens, [40] * 5 + [1] * 150)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert all(type(c.storage) is TieredStorage for c in loaded)
    assert tiers_of(loaded) == tiers_of(caches) and loaded[0].storage.memory == caches[0].storage.memory
    rest = [1] * 50
    expected = run_chunks(model, caches, tokens[350:], rest)
    got = run_chunks(model, loaded, tokens[350:], rest)
    assert mx.array_equal(got, expected).item()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv_bits=(5, 3), window_bits=8, low_bits=(3, 2)), r"low_bits=\(3, 2\) needs keys per channel"),
        (dict(kv_bits=(5, 3), window_bits=8, key_group=64, low_bits=(5, 3)), "must take fewer bits than"),
        (dict(kv_bits=(5, 3), window_bits=8, key_group=64, low_bits=(6, 2)), "must take fewer bits than"),
        (dict(kv_bits=(5, 3), window_bits=8, key_group=64, low_bits=(1, 2)), "is not supported"),
    ],
)
def test_bad_tiers_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        make_cache(model64(layers=1), "default", 400, **kwargs)
    assert "\n" not in str(err.value)


def test_spellings_round_trip():
    storage = KVStorage.of((5, 3), D, window_bits=8, key_group=64, low_bits=(3, 2))
    assert KVStorage.from_suffix(storage.suffix) == storage and storage.suffix == ":k5v3w8c64l32"
    assert KVStorage.parse("5,3", window_bits=8, key_group=64, low_bits="3,2") == storage
    assert storage.flags.endswith("--key-group 64 --low-bits 3,2") and storage.label.endswith("3/2-bit below")
    with pytest.raises(ValueError, match="--low-bits 3,2 needs keys per channel"):
        KVStorage.of((5, 3), window_bits=8, low_bits=(3, 2), names=FLAGS)
