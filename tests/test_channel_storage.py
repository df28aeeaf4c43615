"""Keys per channel (KIVI, ``key_group``): the real storage against its simulation, on random-weight models (fast)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from tiny_models import random_tokens, run_chunks, tiny_model

import mlxevict
from benchmarks import storage_variants as sv
from mlxevict import EvictingKVCache, make_cache
from mlxevict.budget import storage_nbytes
from mlxevict.channel_attention import channel_decode_attention, channel_decode_attention_fast
from mlxevict.channel_codes import (
    channel_dequantize,
    channel_dequantize_compiled,
    held_dequantize,
    held_dequantize_compiled,
    pack_planes,
    planes_of,
    token_dequantize,
    token_dequantize_compiled,
    unpack_codes,
    unpack_planes,
)
from mlxevict.channel_storage import ChannelStorage, channel_quantize
from mlxevict.kvstorage import FLAGS, KVStorage
from mlxevict.plan import memory_storage, plan_cache
from mlxevict.budget import parse_budget
from mlxevict.rotation import rotation_matrix
from mlxevict.stats import cache_stats
from mlxevict.tiered_storage import TieredStorage

D = 64  # the simulation quantizes per token in groups of 64 channels
KIVI = dict(kv_bits=(5, 3), kv_group_size=D, window_bits=8, key_group=64)


def mx_quantize_layout(codes: mx.array, bits: int) -> mx.array:
    """``(..., D)`` codes packed LSB first into ``uint32`` words, as ``mx.quantize`` packs them (a plain reference)."""
    c = np.array(codes, dtype=np.uint64).reshape(-1, codes.shape[-1])
    words = []
    for row in c:
        stream = sum(int(v) << (bits * d) for d, v in enumerate(row))
        words.append([(stream >> (32 * w)) & 0xFFFFFFFF for w in range(len(row) * bits // 32)])
    return mx.array(np.array(words, dtype=np.uint32)).reshape(*codes.shape[:-1], -1)


def model64(**overrides):
    return tiny_model("llama", head_dim=D, hidden_size=128, **overrides)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_codes_unpack_as_mx_quantize_packs_them(bits):
    """The storage reads mx.quantize's codes by unpacking its words: the layouts must agree."""
    x = mx.random.normal((2, 3, 128), key=mx.random.key(bits))
    packed, scales, biases = mx.quantize(x, group_size=64, bits=bits)
    codes = unpack_codes(packed, bits)
    assert int(codes.max().item()) < 2**bits
    assert mx.array_equal(mx_quantize_layout(codes, bits), packed).item()
    ours = codes.reshape(2, 3, 2, 64).astype(mx.float32) * scales[..., None] + biases[..., None]
    assert mx.array_equal(
        ours.reshape(2, 3, 128), mx.dequantize(packed, scales, biases, group_size=64, bits=bits)
    ).item()


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7])
def test_bit_planes_round_trip_every_code(bits):
    codes = mx.random.randint(0, 2**bits, (2, 3, 5, 64), key=mx.random.key(bits)).astype(mx.uint32)
    planes = pack_planes(codes, bits)
    assert planes.shape == (2, 3, 5, 64 * bits // 32) and planes.dtype == mx.uint32
    assert mx.array_equal(unpack_planes(planes, bits), codes).item()


@pytest.mark.parametrize("group", [64, 128])  # two groups per row, and one (its scales broadcast as they are)
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
def test_values_in_bit_planes_dequantize_as_mx_dequantize(bits, group):
    x = mx.random.normal((2, 3, 7, 128), key=mx.random.key(bits))
    words, scales, biases = mx.quantize(x, group_size=group, bits=bits)
    expected = mx.dequantize(words, scales, biases, group_size=group, bits=bits)
    planes = planes_of(words, bits)
    assert mx.array_equal(token_dequantize(planes, scales, biases, bits, group), expected).item()
    assert mx.array_equal(token_dequantize_compiled(planes, scales, biases, bits, group), expected).item()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_held_rows_dequantize_as_mx_dequantize(group):
    x = 3 * mx.random.normal((1, 3, 37, 128), key=mx.random.key(group))
    triple = mx.quantize(x, group_size=group, bits=8)
    expected = mx.dequantize(*triple, group_size=group, bits=8)
    assert mx.array_equal(held_dequantize(*triple, group), expected).item()
    assert mx.array_equal(held_dequantize_compiled(*triple, group), expected).item()


def test_channel_quantize_equals_the_simulated_fake_quantization():
    x = mx.random.normal((1, 2, 128, D), key=mx.random.key(3)) * mx.linspace(0.1, 8, D)  # outlier channels
    codes, scales, biases = channel_quantize(x, 5, 64)
    rows = mx.broadcast_to((mx.arange(128) // 64).astype(mx.uint16), (1, 2, 128))

    ours = channel_dequantize(codes, rows, scales, biases, 5)
    assert mx.array_equal(channel_dequantize_compiled(codes, rows, scales, biases, 5), ours).item()
    sim = mx.concatenate([sv.fake_quant_channels(x[..., i : i + 64, :], 5) for i in (0, 64)], axis=2)
    assert mx.array_equal(ours, sim).item()


def test_the_pre_rope_variant_quantizes_keys_before_rope():
    """Keys whose pre-RoPE vector is the same at every position: per channel over a group, that is exact
    before RoPE (each channel constant) and coarse after it (RoPE turns each channel pair by position)."""
    model = tiny_model("llama")
    rope = model.layers[0].self_attn.rope
    dim = model.args.hidden_size // model.args.num_attention_heads
    base = mx.broadcast_to(mx.random.normal((1, 1, 1, dim), key=mx.random.key(5)) * 4, (1, 2, 64, dim))
    keys = rope(base, offset=96)  # positions 96..159, as a model writes them
    errors = {}
    for name in ("kivi-k3v2", "kivi-k3v2-pre"):
        cache = sv.SimulatedStorageCache(sv.VARIANTS[name], 1e9, dim, rope=rope if "pre" in name else None)
        cache.done = 96
        errors[name] = mx.abs(cache._channels(keys, 3) - keys).max().item()
    assert errors["kivi-k3v2-pre"] < 1e-4 < 0.1 < errors["kivi-k3v2"]
    with pytest.raises(ValueError, match="needs the model's RoPE"):
        sv.SimulatedStorageCache(sv.VARIANTS["kivi-k3v2-pre"], 1e9, dim)


def pair(model, budget_bytes: float, sinks: int = 4):
    """The simulation (with the product's rotation) and the real storage, at the simulation's budget in entries."""
    sim = [
        sv.SimulatedStorageCache(sv.VARIANTS["kivi-k5v3"], budget_bytes, D, "default", sinks=sinks)
        for _ in model.layers
    ]
    for c in sim:
        c.storage.rotation = rotation_matrix(D)  # the simulation's plain Hadamard lacks the product's random signs
    budget = sim[0].budget
    real = [
        EvictingKVCache("default", budget, sinks=sinks, storage=ChannelStorage((5, 3), D, 32, 64, rotate_held=False))
        for _ in model.layers
    ]
    mlxevict.patch(model)
    return sim, real


@pytest.mark.parametrize(
    "entries, n, chunks",
    [
        (1000, 300, [64] * 4 + [1] * 44),
        (250, 420, [32] * 8 + [1] * 164),
        (160, 300, [40, 7, 2, 2, 60] + [3] * 63),
        (400, 300, [130] + [1] * 170),
    ],
)
def test_logits_equal_the_simulated_kivi_k5v3(entries, n, chunks):
    """The strongest check: the same logits as benchmarks/storage_variants.py's kivi-k5v3, with and without eviction.

    Prompt chunks read the same dense entries as the simulation; decoding reads the values by a quantized
    matmul, a float rounding apart (2e-6 here), which a 3-bit code can turn into a step on a later token
    (the 160-entry case decoded one token at a time differs by 1e-3): that case feeds chunks only.
    """
    model = model64()
    sim, real = pair(model, entries * 72 + 96 * 136)
    tokens = random_tokens(n)
    expected, got = run_chunks(model, sim, tokens, chunks), run_chunks(model, real, tokens, chunks)
    assert real[0].size() == sim[0].size() and real[0].evictions == sim[0].evictions
    assert (real[0].evictions > 0) == (entries < n)
    assert mx.allclose(got, expected, atol=1e-5).item()


@pytest.mark.parametrize("mask", [None, "causal", "array"])
def test_attention_equals_attention_over_the_dequantized_entries(mask):
    model = model64(layers=1)
    _, real = pair(model, 250 * 72 + 96 * 136)
    run_chunks(model, real, random_tokens(300), [32] * 9 + [1] * 12)
    c, storage = real[0], real[0].storage
    n_quant = c.size() - storage.n_full
    keys_in, values_in = storage.fetch(c.size())
    (codes, rows, table_s, table_b), held = keys_in
    idx = rows[..., None].astype(mx.int32)
    q_keys = unpack_planes(codes, 5).astype(mx.float32) * mx.take_along_axis(table_s, idx, axis=2)
    q_keys = q_keys + mx.take_along_axis(table_b, idx, axis=2)
    assert n_quant > 0 and codes.shape[2] == n_quant and held[0].shape[2] == storage.n_full
    R = rotation_matrix(D)
    held_keys = mx.dequantize(*held, group_size=D, bits=8)  # rotate_held=False: as they came
    held_values = mx.dequantize(*values_in[1], group_size=D, bits=8)
    words, v_scales, v_biases = values_in[0]
    mx_words = mx_quantize_layout(unpack_planes(words, 3), 3)
    ref_v = mx.dequantize(mx_words, v_scales, v_biases, group_size=D, bits=3) @ R.T
    keys = mx.concatenate([q_keys, held_keys], axis=2)  # B, H, N, D
    values = mx.concatenate([ref_v, held_values], axis=2)
    assert mx.allclose(c.dense_keys[..., : c.size(), :], keys).item()
    L = 1 if mask is None else 5
    queries = mx.random.normal((1, 4, L, D), key=mx.random.key(7))
    m = (
        mx.arange(keys.shape[2] - L, keys.shape[2])[:, None] >= mx.arange(keys.shape[2])[None]
        if mask == "array"
        else mask
    )
    got = storage.attend(queries, keys_in, values_in, D**-0.5, m)
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=D**-0.5, mask=m)
    assert mx.allclose(got, expected, atol=1e-5).item()


@pytest.mark.parametrize(
    "storage, dim",
    [(dict(), D), (dict(rotate_held=False), D), (dict(kv_rotate=False), D), (dict(kv_bits=(3, 4)), D), (dict(), 128)],
)
def test_decode_attention_equals_attention_over_dense_entries(storage, dim):
    """The decode kernel, its twin with compiled dequantization, and the dense path (the model's fused attention over
    dequantized entries, taken with an all-true mask) agree."""
    model = tiny_model("llama", layers=1, head_dim=dim, hidden_size=2 * dim)
    caches = [EvictingKVCache("default", 240, storage=ChannelStorage(**{"kv_bits": (5, 3), **storage}))]
    mlxevict.patch(model)
    run_chunks(model, caches, random_tokens(400), [40] * 6 + [1] * 150)
    c, st = caches[0], caches[0].storage
    keys, values = st.fetch(c.size())
    n_quant, table_rows = keys[0][1].shape[2], keys[0][2].shape[2]
    assert c.evictions > 0 and n_quant > 0 and table_rows > 1 and st.n_full > 0
    queries, scale = mx.random.normal((1, 4, 1, dim), key=mx.random.key(5)), dim**-0.5
    dense = st.attend(queries, keys, values, scale, mx.ones((1, c.size()), mx.bool_))
    rotation = st._value_rotation(mx.float32)
    bits = (((st.key_bits, st.value_bits),), 8)
    args = (queries, ((keys[0],), keys[1]), ((values[0],), values[1]), rotation, scale, st.kv_group_size, bits, st.rotate_held)
    plain, compiled = channel_decode_attention(*args), channel_decode_attention_fast(*args)
    assert mx.allclose(plain, dense, atol=1e-5).item() and mx.allclose(compiled, plain, atol=1e-6).item()
    assert mx.array_equal(st.attend(queries, keys, values, scale, None), compiled).item()


@pytest.mark.parametrize("policy", ["default", "window", "h2o", "random"])
def test_the_table_holds_the_live_groups_only(policy):
    """After compaction, every table row is a group some kept slot of its head still uses."""
    model = model64(layers=1)
    caches = make_cache(model, policy, 220, **KIVI)
    run_chunks(model, caches, random_tokens(700), [50] * 6 + [1] * 400)
    c = caches[0]
    assert c.evictions > 0 and isinstance(c.storage, ChannelStorage)
    run_chunks(model, caches, random_tokens(1, seed=9), [1])  # a write collects the table
    n_quant = c.size() - c.storage.n_full
    groups = c.positions[..., :n_quant] // 64  # B, H, n
    live = max(len(set(groups[0, h].tolist())) for h in range(groups.shape[1]))
    assert c.storage.table_rows == live
    rows = c.storage.keys[1][..., :n_quant]
    # Rows follow the groups: equal groups share a row, and rows rise with the positions (time order).
    same = groups[..., 1:] == groups[..., :-1]
    assert mx.array_equal(same, rows[..., 1:] == rows[..., :-1]).item()


@pytest.mark.parametrize("policy", ["window", "default", "random"])
def test_bytes_are_the_arrays_held_and_never_above_the_budget_or_a_full_cache(policy):
    """``random`` leaves a few entries in every group: the table is bounded by evicting whole groups."""
    model = model64()
    plan = plan_cache(model, 200, KVStorage.of((5, 3), D, window_bits=8, key_group=64))
    caches = make_cache(model, policy, plan.tokens, **KIVI)
    tokens = random_tokens(900)
    for i in range(0, 900, 25):
        run_chunks(model, caches, tokens[i : i + 25], [25])
        stats, s = cache_stats(caches), caches[0].storage
        assert s.nbytes == sum(x.nbytes for part in (s.keys, s.values, s.fp_keys, s.fp_values) for x in part)
        assert stats.nbytes <= plan.nbytes(model) and stats.nbytes <= stats.full_nbytes
        assert max(c.storage.table_rows for c in caches) <= s.max_rows(plan.tokens)
    assert caches[0].evictions > 0


def test_a_compressed_prompt_holds_the_budget_once_decoding_starts():
    model = model64(layers=1)
    plan = plan_cache(model, 200, KVStorage.of((5, 3), D, window_bits=8, key_group=64))
    caches = make_cache(model, "snapkv", plan.tokens, prompt_mode="compress", **KIVI)
    logits = run_chunks(model, caches, random_tokens(700), [600] + [1] * 100)
    s = caches[0].storage
    assert caches[0].capacity == plan.tokens and s.table_rows <= s.max_rows(plan.tokens)
    assert cache_stats(caches).nbytes <= plan.nbytes(model) and mx.isfinite(logits).all().item()


@pytest.mark.parametrize("policy", ["default", "knorm"])
def test_save_and_load_continue_identically(policy, tmp_path):
    model = model64()
    caches = make_cache(model, policy, 200, **KIVI)
    tokens = random_tokens(400)
    run_chunks(model, caches, tokens, [40] * 5 + [1] * 150)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert all(type(c) is EvictingKVCache and isinstance(c.storage, ChannelStorage) for c in loaded)
    assert (
        loaded[0].storage.table_rows == caches[0].storage.table_rows
        and loaded[0].storage.n_full == caches[0].storage.n_full
    )
    rest = [1] * 50
    expected = run_chunks(model, caches, tokens[350:], rest)
    got = run_chunks(model, loaded, tokens[350:], rest)
    assert mx.array_equal(got, expected).item()


def test_a_cache_saved_with_mx_quantize_codes_loads_and_continues_identically():
    """States saved before the bit planes hold the codes in mx.quantize's layout: loading repacks them."""
    model = model64()
    caches = make_cache(model, "default", 200, **KIVI)
    tokens = random_tokens(300)
    run_chunks(model, caches, tokens, [40] * 5 + [1] * 50)
    old = []
    for c in caches:
        # Fresh array objects: an update in place would otherwise reach the other cache.
        state = [tuple(map(mx.array, x)) if isinstance(x, (tuple, list)) else x for x in c.state]
        state = [mx.array(x) if isinstance(x, mx.array) else x for x in state]
        meta = json.loads(state[6])
        del meta["key_planes"]
        codes, words = state[0][0], state[1][0]
        state[0] = (mx_quantize_layout(unpack_planes(codes, 5), 5), *state[0][1:])
        state[1] = (mx_quantize_layout(unpack_planes(words, 3), 3), *state[1][1:])
        state[6] = json.dumps(meta)
        loaded = EvictingKVCache.__new__(EvictingKVCache)
        loaded.state = tuple(state)
        assert mx.array_equal(loaded.storage.keys[0], codes).item()
        assert mx.array_equal(loaded.storage.values[0], words).item()
        old.append(loaded)
    rest = [1] * 30
    expected = run_chunks(model, caches, tokens[250:], rest)
    assert mx.array_equal(run_chunks(model, old, tokens[250:], rest), expected).item()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(kv_bits=(5, 3), key_group=64),
            r"key_group=64 needs window_bits=8, such as kv_bits=\(5, 3\) window_bits=8",
        ),
        (dict(kv_bits=8, key_group=64), r"key_group=64 needs key bits under 8 \(not kv_bits=8\) and window_bits=8"),
        (dict(key_group=64), "key_group=64 needs key bits under 8"),
        (dict(kv_bits=(5, 3), window_bits=8, key_group=48), "key_group=48 is not supported; use 32, 64 or 128"),
    ],
)
def test_bad_combinations_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        make_cache(model64(layers=1), "default", 256, kv_group_size=D, **kwargs)
    assert "\n" not in str(err.value)


def test_flags_spell_the_same_rule():
    with pytest.raises(
        ValueError, match=r"--key-group 64 needs key bits under 8 \(not --kv-bits 8\) and --window-bits 8"
    ) as err:
        KVStorage.parse("8", key_group=64, window_bits=None)
    assert "--kv-bits 5,3 --window-bits 8" in str(err.value)


def test_spellings_round_trip():
    s = KVStorage.of((5, 3), window_bits=8, key_group=64)
    assert (s.label, s.flags, s.suffix) == (
        "5/3-bit KIVI-64",
        "--kv-bits 5,3 --window-bits 8 --key-group 64",
        ":k5v3w8c64",
    )
    assert KVStorage.from_suffix(":k5v3w8c64") == KVStorage.parse("5,3", window_bits=8, key_group=64) == s
    assert KVStorage.from_options(**s.options()) == s
    assert s.bytes_per_token(head_dim=64, dtype_size=2) == 40 + 2 + 4 + 28  # codes, row, table share, values


def test_a_memory_budget_that_must_evict_picks_channel_keys_and_explicit_bits_keep_per_token_keys():
    model = model64(max_position_embeddings=4096)
    per_token_all = storage_nbytes(model, 4096, KVStorage.of((5, 3), D, window_bits=8))
    picked = memory_storage(parse_budget(f"{per_token_all // 2}B"), model, 4096)
    assert picked.key_group == 64 and picked.kv_bits == (5, 4) and picked.window_bits == 8 and picked.low_bits == (3, 2)
    assert memory_storage(parse_budget(f"{per_token_all}B"), model, 4096).key_group is None  # holds everything
    # 150 entries: the 96 tokens held in 8 bits would be more than half of them, so keys stay per token
    small = storage_nbytes(model, 150, KVStorage.of((5, 3), D, window_bits=8, key_group=64, low_bits=(3, 2)))
    assert memory_storage(parse_budget(f"{small}B"), model, 4096) == KVStorage.of((5, 3), D, window_bits=8)
    caches = make_cache(model, "default", f"{per_token_all // 2}B")
    assert isinstance(caches[0].storage, TieredStorage)
    explicit = make_cache(model, "default", f"{per_token_all // 2}B", kv_bits=(5, 3), kv_group_size=D, window_bits=8)
    assert type(explicit[0]).__name__ == "QuantizedEvictingKVCache"
    assert FLAGS["key_group"].format(64) == "--key-group 64"


def test_the_8bit_rows_are_held_rotated_so_an_outlier_channel_costs_little():
    keys = mx.random.normal((1, 2, 40, D), key=mx.random.key(5)) * mx.where(mx.arange(D) == 3, 60.0, 1.0)
    errors = {}
    for rotate_held in (True, False):
        s = ChannelStorage((5, 3), D, 32, 64, rotate_held=rotate_held)
        s.allocate(1, 2, D, D, mx.float32, 256)
        s.write(keys, keys, 0)
        errors[rotate_held] = mx.abs(s.dense_keys(40, 40) - keys).max().item()
    assert errors[True] < errors[False] / 2  # measured: 0.14 vs 0.32
