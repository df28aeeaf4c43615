"""Quantized storage (``kv_bits``) for the evicting cache, on random-weight mlx-lm models (fast)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache, QuantizedKVCache, load_prompt_cache, save_prompt_cache
from tiny_models import QWEN3_8BIT_GAP, random_tokens, run_chunks, tiny_model

import mlxevict
from mlxevict import QuantizedEvictingKVCache, make_cache, policy_names
from mlxevict.quantized import key_value_bits, quantized_attention, rotation_matrix

EVICTING = [p for p in policy_names() if p != "full"]
GROUP = 32  # tiny models have head_dim 32 here: mx.quantize's smallest group


def small_model(arch: str = "llama", **overrides):
    return tiny_model(arch, head_dim=GROUP, **overrides)


def dequantized(packed: tuple[mx.array, ...], n: int, bits: int) -> mx.array:
    return mx.dequantize(*(x[..., :n, :] for x in packed), group_size=GROUP, bits=bits)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_equal_to_mlx_lm_quantized_cache_when_nothing_is_evicted(arch, bits, request):
    if arch == "qwen3" and bits == 8:
        request.applymarker(QWEN3_8BIT_GAP)
    model = small_model(arch)
    tokens = random_tokens(48)
    chunks = [20, 7, 1, 1, 1, 1, 17]
    theirs = run_chunks(model, [QuantizedKVCache(GROUP, bits) for _ in model.layers], tokens, chunks)
    caches = make_cache(
        model,
        "default",
        budget=64,
        window=8,
        kv_bits=bits,
        kv_group_size=GROUP,
        full_precision_window=0,
        kv_rotate=False,
    )
    ours = run_chunks(model, caches, tokens, chunks)
    # Multi-token chunks on the CPU dequantize first and use a dense matmul: equal within float
    # rounding (token by token the storage is mlx-lm's exactly: tests/test_quantized_real.py).
    assert mx.allclose(ours, theirs, rtol=0, atol=1e-5).item()
    exact = run_chunks(model, [KVCache() for _ in model.layers], tokens, chunks)
    assert not mx.allclose(ours, exact, atol=1e-4).item()  # the storage really is quantized


def test_full_precision_window_holding_every_token_equals_kvcache():
    model = small_model()
    tokens = random_tokens(40)
    chunks = [20, 7, 1, 1, 11]
    full = run_chunks(model, [KVCache() for _ in model.layers], tokens, chunks)
    caches = make_cache(model, "rkv", budget=64, kv_bits=4, kv_group_size=GROUP, full_precision_window=40)
    assert mx.allclose(run_chunks(model, caches, tokens, chunks), full, atol=1e-5).item()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_8bit_window_holding_every_token_equals_mlx_lm_8bit_cache(arch):
    """The recent window in 8 bits is stored and attended exactly as mlx-lm's 8-bit cache does."""
    model = small_model(arch)
    tokens = random_tokens(40)
    chunks = [20, 7, 1, 1, 11]
    theirs = run_chunks(model, [QuantizedKVCache(GROUP, 8) for _ in model.layers], tokens, chunks)
    caches = make_cache(
        model, "rkv", budget=64, kv_bits=4, kv_group_size=GROUP, full_precision_window=40, window_bits=8,
        kv_rotate=False,
    )
    ours = run_chunks(model, caches, tokens, chunks)
    assert mx.allclose(ours, theirs, atol=1e-5).item()
    exact = run_chunks(model, [KVCache() for _ in model.layers], tokens, chunks)
    assert not mx.allclose(ours, exact, atol=1e-5).item()  # the window really is 8-bit
    assert caches[0].n_full == 40 and caches[0].size() == 40


@pytest.mark.parametrize("bits", [4, (5, 3)])
@pytest.mark.parametrize("mask", [None, "causal", "array"])
def test_quantized_attention_equals_attention_over_dequantized_entries(mask, bits):
    B, H, G, L, Q, F, D = 1, 2, 3, 4, 20, 6, 64
    key_bits, value_bits = key_value_bits(bits)
    k = mx.random.split(mx.random.key(0), 5)
    queries = mx.random.normal((B, H * G, L, D), key=k[0])
    q_keys = mx.quantize(mx.random.normal((B, H, Q, D), key=k[1]), group_size=GROUP, bits=key_bits)
    q_values = mx.quantize(mx.random.normal((B, H, Q, D), key=k[2]), group_size=GROUP, bits=value_bits)
    f_keys, f_values = mx.random.normal((B, H, F, D), key=k[3]), mx.random.normal((B, H, F, D), key=k[4])
    if mask == "array":
        mask = mx.random.uniform(shape=(L, Q + F), key=k[0]) > 0.3
        mask[:, 0] = True
    got = quantized_attention(queries, (q_keys, f_keys), (q_values, f_values), 0.125, mask, GROUP, bits)
    keys = mx.concatenate([mx.dequantize(*q_keys, group_size=GROUP, bits=key_bits), f_keys], axis=2)
    values = mx.concatenate([mx.dequantize(*q_values, group_size=GROUP, bits=value_bits), f_values], axis=2)
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=mask)
    assert mx.allclose(got, expected, atol=1e-4).item()


@pytest.mark.parametrize("dim", [32, 64, 128, 80, 96])
def test_rotation_matrix_is_orthogonal_and_fixed(dim):
    r = rotation_matrix(dim)
    assert mx.allclose(r @ r.T, mx.eye(dim), atol=1e-5).item()
    rotation_matrix.cache_clear()
    assert mx.array_equal(rotation_matrix(dim), r).item()  # a reloaded cache gets the same matrix
    assert not mx.allclose(mx.abs(r), mx.eye(dim)).item()  # it mixes channels


@pytest.mark.parametrize("mask", [None, "causal"])
def test_rotated_attention_equals_attention_over_unrotated_entries(mask):
    """Entries stored as ``xR`` give the attention of ``x``: only the quantization error differs."""
    B, H, G, L, Q, F, D, bits = 1, 2, 3, 4, 20, 6, 64, 8
    k = mx.random.split(mx.random.key(1), 5)
    queries = mx.random.normal((B, H * G, L, D), key=k[0])
    keys, values = mx.random.normal((B, H, Q + F, D), key=k[1]), mx.random.normal((B, H, Q + F, D), key=k[2])
    r = rotation_matrix(D)
    rk, rv = keys @ r, values @ r
    q_keys = mx.quantize(rk[..., :Q, :], group_size=GROUP, bits=bits)
    q_values = mx.quantize(rv[..., :Q, :], group_size=GROUP, bits=bits)
    got = quantized_attention(
        queries, (q_keys, rk[..., Q:, :]), (q_values, rv[..., Q:, :]), 0.125, mask, GROUP, bits, rotation=r
    )
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=mask)
    assert mx.allclose(got, expected, atol=2e-2).item()
    unrotated = quantized_attention(
        queries, (q_keys, rk[..., Q:, :]), (q_values, rv[..., Q:, :]), 0.125, mask, GROUP, bits
    )
    assert not mx.allclose(unrotated, expected, atol=2e-2).item()


@pytest.mark.parametrize("bits, rotated", [(4, True), (8, False), ((5, 3), True), ((8, 4), True)])
def test_rotation_is_on_under_8_bits_and_policies_see_unrotated_keys(bits, rotated):
    model = small_model(layers=1)
    caches = make_cache(model, "default", budget=64, kv_bits=bits, kv_group_size=GROUP, full_precision_window=8)
    plain = make_cache(model, "default", budget=64)
    tokens = random_tokens(40)
    for c in (caches, plain):
        run_chunks(model, c, tokens, [30, 10])
    q = caches[0]
    assert q.kv_rotate is rotated and (q.rotation is not None) is rotated
    # the full-precision entries are stored as kR; dense_keys turns them back into k
    assert mx.allclose(q.dense_keys[..., 32:40, :], plain[0].keys[..., 32:40, :], atol=1e-5).item()
    stored = q.fp_keys[..., : q.n_full, :]
    assert mx.allclose(stored, plain[0].keys[..., 32:40, :], atol=1e-5).item() is not rotated


def check_invariants(caches: list[QuantizedEvictingKVCache], seen: int, sinks: int) -> None:
    for cache in caches:
        assert cache.size() <= cache.capacity == cache.budget
        assert cache.offset == seen
        assert cache.n_full == min(cache.full_precision_window, seen)
        for head in cache.positions[0].tolist():
            kept = head[: cache.size()]
            assert all(p == -1 for p in head[cache.size() :])
            assert kept == sorted(kept) and len(set(kept)) == len(kept)
            assert kept[: min(sinks, seen)] == list(range(min(sinks, seen)))
            # the full-precision entries are the newest tokens, in every head
            assert kept[len(kept) - cache.n_full :] == list(range(seen - cache.n_full, seen))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("policy", EVICTING)
def test_budget_and_invariants_hold_for_every_policy(policy, bits):
    model = small_model("qwen3", layers=1)
    caches = make_cache(model, policy, budget=24, sinks=4, window=4, slack=2, kv_bits=bits, kv_group_size=GROUP)
    nbytes = None
    tokens = random_tokens(60)
    model(tokens[None, :10], cache=caches)
    for t in range(10, 60):
        model(tokens[None, t : t + 1], cache=caches)
        check_invariants(caches, t + 1, sinks=4)
        nbytes = nbytes or caches[0].nbytes
        assert caches[0].nbytes == nbytes  # fixed storage: nothing grows
    stats = mlxevict.cache_stats(caches)
    assert stats.evicted == 60 - stats.kept > 0 and stats.kv_bits == bits


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(EVICTING),
    bits=st.sampled_from([8, 4, "4w8", "5,3w8"]),
    budget=st.integers(min_value=24, max_value=64),
    full=st.integers(min_value=0, max_value=12),
    chunks=st.lists(st.integers(min_value=1, max_value=30), min_size=2, max_size=6),
)
def test_budget_holds_after_every_chunk(policy, bits, budget, full, chunks):
    model = small_model(layers=1)
    caches = make_cache(
        model,
        policy,
        budget=budget,
        sinks=3,
        window=4,
        slack=2,
        kv_bits={"4w8": 4, "5,3w8": (5, 3)}.get(bits, bits),
        window_bits=8 if isinstance(bits, str) else None,
        kv_group_size=GROUP,
        full_precision_window=full,
    )
    run_chunks(model, caches, random_tokens(sum(chunks)), chunks, after=lambda seen: check_invariants(caches, seen, sinks=3))


@pytest.mark.parametrize("bits", [8, 4, (5, 3)])
def test_compaction_moves_every_quantized_component(bits):
    """Layer 0's keys do not depend on the cache: the kept ones must be exactly the plain cache's, quantized."""
    model = small_model()
    kwargs = dict(budget=32, sinks=4, window=4, slack=3, seed=7)
    plain = make_cache(model, "random", **kwargs)
    quant = make_cache(
        model, "random", **kwargs, kv_bits=bits, kv_group_size=GROUP, full_precision_window=4, kv_rotate=False
    )
    tokens = random_tokens(90)
    for caches in (plain, quant):
        run_chunks(model, caches, tokens, [20] + [1] * 70)
    p, q = plain[0], quant[0]
    assert mx.array_equal(p.positions, q.positions).item() and q.evictions > 5
    n_quant = q.size() - q.n_full
    key_bits, value_bits = key_value_bits(bits)
    kinds = ((q.keys, q.fp_keys, p.keys, key_bits), (q.values, q.fp_values, p.values, value_bits))
    for stored, full, dense, b in kinds:
        expected = mx.quantize(dense[..., :n_quant, :], group_size=GROUP, bits=b)
        assert all(mx.array_equal(x[..., :n_quant, :], e).item() for x, e in zip(stored, expected))
        assert mx.array_equal(full[..., : q.n_full, :], dense[..., n_quant : q.size(), :]).item()
    assert mx.array_equal(q.dense_keys[..., :n_quant, :], dequantized(q.keys, n_quant, key_bits)).item()


@pytest.mark.parametrize("bits, window_bits", [(8, None), (4, None), (4, 8), ((5, 3), 8)])
@pytest.mark.parametrize("policy", ["default", "uncertainty", "knorm"])
def test_save_and_load_continue_identically(policy, bits, window_bits, tmp_path):
    """At 4 bits the storage is rotated: the reloaded cache must rotate the same way."""
    model = small_model()
    caches = make_cache(
        model, policy, budget=24, window=4, slack=2, kv_bits=bits, kv_group_size=GROUP, window_bits=window_bits
    )
    tokens = random_tokens(60)
    run_chunks(model, caches, tokens, [12] + [1] * 30)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert all(type(c) is QuantizedEvictingKVCache and c.kv_bits == bits for c in loaded)
    assert all(c.kv_rotate is (bits != 8) and c.window_bits == window_bits for c in loaded)
    rest = [1] * 18
    expected = run_chunks(model, caches, tokens[42:], rest)
    got = run_chunks(model, loaded, tokens[42:], rest)
    assert mx.array_equal(got, expected).item()


def test_save_and_load_without_full_precision_window(tmp_path):
    model = small_model()
    caches = make_cache(model, "window", budget=24, kv_bits=8, kv_group_size=GROUP, full_precision_window=0)
    tokens = random_tokens(40)
    run_chunks(model, caches, tokens, [30, 1])
    save_prompt_cache(str(tmp_path / "c.safetensors"), caches)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert mx.array_equal(
        run_chunks(model, loaded, tokens[31:], [1] * 9), run_chunks(model, caches, tokens[31:], [1] * 9)
    ).item()


def test_full_and_compress_modes_resize_quantized_storage():
    model = small_model(layers=1)
    full = make_cache(model, "full", budget=32, kv_bits=8, kv_group_size=GROUP)
    run_chunks(model, full, random_tokens(300), [300])
    assert full[0].size() == 300 and full[0].capacity == 512
    compress = make_cache(
        model, "snapkv", budget=24, window=4, slack=0, prompt_mode="compress", kv_bits=4, kv_group_size=GROUP
    )
    run_chunks(model, compress, random_tokens(70), [64, 1])
    check_invariants(compress, 65, sinks=4)
    assert compress[0].size() == 24


@pytest.mark.parametrize("bits, low, high", [(8, 0.5, 0.56), (4, 0.25, 0.3), ((5, 3), 0.25, 0.3)])
def test_nbytes_is_about_half_or_quarter_of_float16(bits, low, high):
    model = tiny_model("llama", head_dim=64, hidden_size=128)
    model.set_dtype(mx.float16)
    tokens = random_tokens(40)
    plain = make_cache(model, "window", budget=64)
    quant = make_cache(model, "window", budget=64, kv_bits=bits, full_precision_window=0)
    with_window = make_cache(model, "window", budget=64, kv_bits=bits, full_precision_window=8)
    for caches in (plain, quant, with_window):
        model(tokens[None], cache=caches)
    ratio = mlxevict.cache_stats(quant).nbytes / mlxevict.cache_stats(plain).nbytes
    assert low <= ratio <= high
    # the window costs its tokens in float16 and no quantized rows
    per_slot = mlxevict.cache_stats(plain).nbytes / 64
    expected = (64 - 8) * ratio * per_slot + 8 * per_slot
    assert mlxevict.cache_stats(with_window).nbytes == pytest.approx(expected)
    assert mlxevict.cache_stats(quant).full_nbytes == mlxevict.cache_stats(plain).full_nbytes


def test_8bit_window_costs_its_tokens_in_8_bits():
    model = tiny_model("llama", head_dim=64, hidden_size=128)
    model.set_dtype(mx.float16)
    sizes = {}
    for name, storage in {
        "q4": dict(kv_bits=4, full_precision_window=0),
        "q8": dict(kv_bits=8, full_precision_window=0),
        "q4w8": dict(kv_bits=4, full_precision_window=8, window_bits=8),
    }.items():
        caches = make_cache(model, "window", budget=64, **storage)
        model(random_tokens(40)[None], cache=caches)
        sizes[name] = mlxevict.cache_stats(caches).nbytes
    assert sizes["q4w8"] == pytest.approx((56 * sizes["q4"] + 8 * sizes["q8"]) / 64)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv_bits=3), r"kv_bits=3 is not supported; use 8 or 4, key and value bits of 2, 3, 4, 5, 6 or 8 such as \(5, 3\)"),
        (dict(kv_bits=(7, 3)), r"kv_bits=\(7, 3\) is not supported"),
        (dict(kv_bits=(5, 3, 2)), r"kv_bits=\(5, 3, 2\) is not supported"),
        (dict(kv_bits=(8, 4), kv_group_size=GROUP, window_bits=8), r"window_bits=8 needs kv_bits under 8 \(not kv_bits=\(8, 4\)\)"),
        (dict(kv_bits=16), r"kv_bits=16 is not supported"),
        (dict(kv_bits=8, kv_group_size=48), r"kv_group_size=48 is not supported by mx.quantize; use 32, 64 or 128"),
        (
            dict(kv_bits=8, kv_group_size=64),
            r"kv_group_size=64 does not divide the head dim 32; use --kv-group-size 32",
        ),
        (dict(kv_bits=4, kv_group_size=GROUP, full_precision_window=-1), r"full_precision_window=-1 must be"),
        (dict(kv_bits=8, kv_group_size=GROUP, window_bits=8), r"window_bits=8 needs kv_bits under 8 \(not kv_bits=8\), such as 4 or \(5, 3\): the recent window"),
        (dict(kv_bits=4, kv_group_size=GROUP, window_bits=4), r"window_bits=4 is not supported; use 8"),
        (dict(window_bits=8), r"window_bits=8 needs kv_bits under 8, such as 4 or \(5, 3\)"),
        (
            dict(kv_bits=4, kv_group_size=GROUP, budget=40, full_precision_window=36),
            r"full_precision_window=36 leaves no room",
        ),
    ],
)
def test_bad_storage_arguments_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_cache(small_model(layers=1), **kwargs)


def test_plain_cache_has_no_kv_bits():
    caches = make_cache(small_model(layers=1), "window", budget=32)
    assert type(caches[0]) is mlxevict.EvictingKVCache and caches[0].kv_bits is None


# ---- a budget in memory ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "budget, kv_bits, cls, bits, tokens",
    [
        # 2 layers x 2 kv-heads x head dim 32 in float32: 1,024 B a token, 4,096 tokens of context
        ("8MB", None, "EvictingKVCache", None, 4096),  # the whole context fits in the dtype
        ("2MB", None, "QuantizedEvictingKVCache", 8, 4096),  # in 8 bits
        # precision tiers: 96 tokens held in 8 bits, 2 reserved table rows (512 B per kv-head), 168 B a token
        # (an entry counted in the low tier: 4/3 bits, 100 KB being under 14% of a 16-bit cache of the context)
        ("100KB", None, "EvictingKVCache", (5, 3), (100_000 - 96 * 320 - 4 * 512) // 168 + 32),
        ("100KB", 4, "QuantizedEvictingKVCache", 4, (100_000 - 32 * 1024) // 192 + 32),  # window in float32
        ("512", None, "EvictingKVCache", None, 512),
    ],
)
def test_make_cache_takes_a_budget_in_memory(budget, kv_bits, cls, bits, tokens):
    model = tiny_model(head_dim=32, hidden_size=128)
    caches = make_cache(model, "default", budget, kv_bits=kv_bits, kv_group_size=32)
    assert type(caches[0]).__name__ == cls and caches[0].budget == tokens
    assert getattr(caches[0], "kv_bits", None) == bits
    run_chunks(model, caches, random_tokens(40), [40])
    if budget.endswith("B"):
        memory = int(float(budget[:-2]) * (10**6 if budget.endswith("MB") else 10**3))
        assert sum(c.nbytes for c in caches) <= memory


@pytest.mark.parametrize("budget, message", [("lots", "bad --budget 'lots'"), ("1B", "holds no token")])
def test_a_bad_budget_in_memory_is_a_clear_error(budget, message):
    with pytest.raises(ValueError, match=message):
        make_cache(tiny_model(head_dim=32, hidden_size=128), "default", budget)
