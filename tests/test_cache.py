"""The evicting cache on real mlx-lm models with random weights (fast)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache, load_prompt_cache, save_prompt_cache
from tiny_models import ARCHITECTURES, random_tokens, run_chunks, tiny_model

import mlxevict
from mlxevict import EvictingKVCache, make_cache, policy_names

EVICTING = [p for p in policy_names() if p != "full"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("policy", policy_names())
def test_equal_to_kvcache_when_budget_holds_everything(arch, policy):
    model = tiny_model(arch)
    tokens = random_tokens(48)
    chunks = [20, 7, 1, 1, 1, 1, 17]  # prefill chunks, then decode steps
    full = run_chunks(model, [KVCache() for _ in model.layers], tokens, chunks)
    ours = run_chunks(model, make_cache(model, policy, budget=64, window=8), tokens, chunks)
    assert mx.allclose(ours, full, atol=1e-5).item()


def test_window_matches_rotating_kv_cache_while_evicting():
    model = tiny_model("llama")
    prompt = random_tokens(20)
    steps = random_tokens(100, seed=2)
    rotating = [RotatingKVCache(max_size=32, keep=4) for _ in model.layers]
    ours = make_cache(model, "window", budget=32, sinks=4, window=0, slack=0)
    for cache in (rotating, ours):
        model(prompt[None], cache=cache)
    for t in range(steps.size):
        expected = model(steps[None, t : t + 1], cache=rotating)
        got = model(steps[None, t : t + 1], cache=ours)
        assert mx.allclose(got, expected, atol=1e-5).item(), f"step {t}"
    assert mlxevict.cache_stats(ours).evicted == 20 + 100 - 32


def check_invariants(caches: list[EvictingKVCache], tokens_seen: int, sinks: int) -> None:
    for cache in caches:
        assert cache.size() <= cache.budget
        assert cache.capacity <= cache.budget
        assert cache.offset == tokens_seen
        positions = cache.positions[0].tolist()  # H lists of C positions
        for head in positions:
            kept = [p for p in head[: cache.size()]]
            assert all(p >= 0 for p in kept) and all(p == -1 for p in head[cache.size() :])
            assert kept == sorted(kept) and len(set(kept)) == len(kept)
            assert kept[: min(sinks, tokens_seen)] == list(range(min(sinks, tokens_seen)))
            assert kept[-1] == tokens_seen - 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(EVICTING),
    budget=st.integers(min_value=24, max_value=64),
    slack=st.integers(min_value=0, max_value=6),
    chunks=st.lists(st.integers(min_value=1, max_value=40), min_size=2, max_size=8),
)
def test_budget_holds_after_every_chunk(policy, budget, slack, chunks):
    model = tiny_model("llama", layers=1)
    caches = make_cache(model, policy, budget=budget, sinks=3, window=6, slack=slack)
    run_chunks(model, caches, random_tokens(sum(chunks)), chunks, after=lambda seen: check_invariants(caches, seen, sinks=3))


@pytest.mark.parametrize("policy", EVICTING)
def test_decode_evicts_and_keeps_invariants(policy):
    model = tiny_model("qwen3")
    caches = make_cache(model, policy, budget=24, sinks=4, window=4, slack=2)
    tokens = random_tokens(80)
    model(tokens[None, :10], cache=caches)
    for t in range(10, 80):
        model(tokens[None, t : t + 1], cache=caches)
        check_invariants(caches, t + 1, sinks=4)
    stats = mlxevict.cache_stats(caches)
    assert stats.evicted == 80 - stats.kept > 0
    assert stats.nbytes < stats.full_nbytes


def test_slots_reused_after_compaction_start_with_zero_stats():
    """Positions and stats of new slots are written lazily; a read must see them fresh."""
    model = tiny_model("llama")
    caches = make_cache(model, "h2o", budget=24, sinks=4, window=4, slack=2)
    tokens = random_tokens(40)
    model(tokens[None, :20], cache=caches)
    for t in range(20, 40):
        model(tokens[None, t : t + 1], cache=caches)
        for cache in caches:
            end = cache.size()
            new = cache.offset - cache.positions[0, 0, end - 1].item()
            # Slots filled since the last flush have seen no query yet: stats exactly 0.
            assert new == 1 and (cache.stats[..., end - 1] == 0).all().item()
    assert mlxevict.cache_stats(caches).evicted > 0 and any(c.stats.max().item() > 0 for c in caches)


@pytest.mark.parametrize("policy", EVICTING)
def test_save_and_load_continue_identically(policy, tmp_path):
    model = tiny_model("llama")
    caches = make_cache(model, policy, budget=24, window=4, slack=2)
    tokens = random_tokens(60)
    run_chunks(model, caches, tokens, [12] + [1] * 30)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert all(type(c) is EvictingKVCache for c in loaded)
    rest = [1] * 18
    expected = run_chunks(model, caches, tokens[42:], rest)
    got = run_chunks(model, loaded, tokens[42:], rest)
    assert mx.allclose(got, expected, atol=1e-5).item()


def test_works_as_mlx_lm_prompt_cache():
    model = tiny_model("llama")
    caches = make_cache(model, "entropy", budget=24, window=4)
    steps = generate_step(random_tokens(30), model, prompt_cache=caches, max_tokens=40)
    produced = [token for token, _ in steps]
    assert len(produced) == 40
    assert mlxevict.cache_stats(caches).tokens_seen == 30 + 40  # generate_step runs one step ahead
    assert caches[0].size() <= 24


def test_budget_holds_over_1000_generated_tokens():
    """The cache issue's invariants over a long generation: capacity, offset, sinks, time order."""
    model = tiny_model("llama", layers=4)
    prompt = random_tokens(40)
    caches = make_cache(model, "entropy", budget=128)
    steps = generate_step(prompt, model, prompt_cache=caches, max_tokens=1000)
    for n, _ in enumerate(steps, start=1):
        seen = prompt.size + n  # generate_step runs one step ahead of what it yields
        for cache in caches:
            assert cache.size() <= cache.capacity == (64 if seen <= 64 else 128)  # grown in 64-slot steps
            assert cache.offset == seen
        if n % 50 == 0 or n == 1000:
            for cache in caches:
                for head in cache.positions[0].tolist():
                    kept = head[: cache.size()]
                    assert kept[:4] == [0, 1, 2, 3] and kept == sorted(kept) and kept[-1] == seen - 1
    assert n == 1000
    stats = mlxevict.cache_stats(caches)
    assert stats.evicted == prompt.size + 1000 - stats.kept
    assert 128 - caches[0].slack - 1 <= stats.kept <= 128


def test_prompt_mode_compress_holds_prompt_then_compresses():
    model = tiny_model("llama")
    caches = make_cache(model, "snapkv", budget=24, window=4, slack=0, prompt_mode="compress")
    tokens = random_tokens(70)
    model(tokens[None, :64], cache=caches)
    assert caches[0].size() == 64  # the whole prompt, held for compression
    model(tokens[None, 64:65], cache=caches)
    check_invariants(caches, 65, sinks=4)
    assert caches[0].size() == 24


def test_pinned_span_is_kept():
    model = tiny_model("llama")
    caches = make_cache(model, "knorm", budget=32, window=4, slack=0, pinned=[(10, 18)])
    run_chunks(model, caches, random_tokens(90), [20] + [1] * 70)
    for cache in caches:
        for head in cache.positions[0].tolist():
            assert set(range(10, 18)) <= set(head)


def test_uncertainty_budget_follows_prediction_entropy():
    model = tiny_model("llama")
    mlxevict.patch(model)
    forward = type(model)._mlxevict_base.__call__  # the model's own forward: feeds no H(p_t)
    sure = make_cache(model, "uncertainty", budget=40, window=4, slack=0, min_fraction=0.5)
    unsure = make_cache(model, "uncertainty", budget=40, window=4, slack=0, min_fraction=0.5)
    tokens = random_tokens(60)
    for caches, entropy in ((sure, 0.0), (unsure, 30.0)):
        for c in caches:  # the model's own forward does not mark the caches as driven by a patched model
            c.model_patched = True
        for t in range(60):
            forward(model, tokens[None, t : t + 1], cache=caches)
            for c in caches:  # a controlled H(p_t) instead of the model's own
                c.feed_prediction_entropy(mx.full((1, 1), entropy))
    assert mlxevict.cache_stats(sure).effective_budget == 20
    assert mlxevict.cache_stats(unsure).effective_budget == 40
    assert sure[0].size() < unsure[0].size()


def test_full_policy_grows_like_kvcache():
    model = tiny_model("llama")
    caches = make_cache(model, "full", budget=16, window=4)
    run_chunks(model, caches, random_tokens(300), [300])
    assert caches[0].size() == 300 and mlxevict.cache_stats(caches).evicted == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(budget=0), "must be a positive"),
        (dict(budget=-5), "must be a positive"),
        (dict(budget=30, sinks=4, window=32), r"sinks \+ window"),
        (dict(policy="entropyy"), "unknown policy 'entropyy'"),
        (dict(window=-1), "window=-1"),
        (dict(prompt_mode="later"), "prompt_mode='later'"),
        (dict(pinned=[(5, 2)]), r"pinned span \(5, 2\) .* 0 <= start < end"),
        (dict(pinned=[(-1, 2)]), r"pinned span \(-1, 2\)"),
        (dict(pinned=[(1.5, 2)]), r"pinned span \(1.5, 2\)"),
        (dict(pinned=[3]), r"pinned span 3 "),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_cache(tiny_model("llama", layers=1), **kwargs)


def test_cache_reused_with_another_model_is_refused():
    model = tiny_model("llama")
    caches = make_cache(model, "window", budget=32)
    model(random_tokens(4)[None], cache=caches)
    other = mlxevict.patch(tiny_model("llama", num_key_value_heads=4))
    with pytest.raises(ValueError, match="made for another model"):
        other(random_tokens(4)[None], cache=caches)


def test_unsupported_architectures_are_named():
    with pytest.raises(ValueError, match="sliding-window"):
        make_cache(tiny_model("llama", layer_types=["sliding_attention", "full_attention"], sliding_window=8))
    from mlx_lm.models import gpt2

    args = gpt2.ModelArgs(
        model_type="gpt2", n_ctx=64, n_embd=32, n_head=2, n_layer=1, n_positions=64,
        layer_norm_epsilon=1e-5, vocab_size=64,
    )
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        make_cache(gpt2.Model(args))


def test_merge_refuses_batching():
    with pytest.raises(NotImplementedError, match="batch"):
        EvictingKVCache.merge([EvictingKVCache("window", 32)])


def test_patch_is_reversible():
    import gc

    import mlx_lm.models.qwen2 as qwen2_module

    gc.collect()  # models patched by earlier tests are gone
    model = tiny_model("qwen2")
    current = qwen2_module.scaled_dot_product_attention
    original = getattr(current, "_mlxevict_original_sdpa", current)  # earlier tests patched too
    base = type(model)
    with mlxevict.patched(model):
        assert qwen2_module.scaled_dot_product_attention is not original
        assert type(model) is not base
    assert qwen2_module.scaled_dot_product_attention is original
    assert type(model) is base


def test_default_pins_the_prompt_while_the_reasoning_is_evicted():
    model = tiny_model("llama")
    caches = make_cache(model, "default", budget=64)
    run_chunks(model, caches, random_tokens(120), [20] + [1] * 100)
    for cache in caches:
        for head in cache.positions[0].tolist():
            assert set(range(20)) <= set(head)
    assert mlxevict.cache_stats(caches).evicted > 0


def test_default_says_when_the_prompt_is_too_long_to_pin():
    model = tiny_model("llama")
    caches = make_cache(model, "default", budget=64)
    with pytest.warns(UserWarning, match=r"prompt \(50 tokens\) .* not pinned"):
        list(generate_step(random_tokens(50), model, prompt_cache=caches, max_tokens=2))
    assert caches[0].pinned == []


def test_the_prompt_is_pinned_whole_however_generate_step_chunks_it():
    """Issue 15: mlx-lm feeds a prompt in prefill chunks; the pin must see all of them."""
    model = tiny_model("llama")
    caches = make_cache(model, "default", budget=128)  # pins prompts of up to 63 tokens
    steps = generate_step(random_tokens(60), model, prompt_cache=caches, max_tokens=150, prefill_step_size=16)
    assert len(list(steps)) == 150
    assert caches[0].pinned == [(0, 60)] and mlxevict.cache_stats(caches).evicted > 50
    for cache in caches:
        for head in cache.positions[0].tolist():
            assert set(range(60)) <= set(head)


def test_a_prompt_too_long_to_pin_is_named_by_its_whole_length():
    model = tiny_model("llama")
    caches = make_cache(model, "default", budget=128)
    with pytest.warns(UserWarning, match=r"prompt \(100 tokens\) is longer than the 63 tokens") as seen:
        list(generate_step(random_tokens(100), model, prompt_cache=caches, max_tokens=40, prefill_step_size=16))
    assert len([w for w in seen if "prompt" in str(w.message)]) == len(caches)  # once per cache, at the end
    assert caches[0].pinned == [] and not caches[0].pins.prompt_open


@pytest.mark.parametrize(("budget", "anchored", "others"), [(64, 16, 8), (128, 32, 16), (1024, 64, 32)])
def test_default_keeps_a_quarter_of_the_budget_recent(budget, anchored, others):
    model = tiny_model("llama", head_dim=32)
    assert make_cache(model, "default", budget=budget)[0].window == anchored
    assert make_cache(model, "snapkv", budget=budget)[0].window == others
    assert make_cache(model, "default", budget=budget, window=5)[0].window == 5
    # The full-precision window of quantized storage does not follow the policy's window.
    quantized = make_cache(model, "default", budget=budget, kv_bits=8, kv_group_size=32)[0]
    assert quantized.full_precision_window == others


def test_pin_refuses_an_empty_span():
    caches = make_cache(tiny_model("llama", layers=1), "default", budget=64)
    with pytest.raises(ValueError, match=r"pinned span \(5, 2\)"):
        mlxevict.pin(caches, 5, 2)
    assert caches[0].pinned == []


def test_a_reloaded_cache_refuses_an_unpatched_model(tmp_path):
    """Issue 17: under a model mlxevict has not patched, a reloaded cache silently diverged."""
    model = tiny_model("llama")
    caches = make_cache(model, "h2o", budget=24, window=4, slack=2)
    tokens = random_tokens(40)
    run_chunks(model, caches, tokens, [12] + [1] * 8)
    path = tmp_path / "cache.safetensors"
    save_prompt_cache(str(path), caches)
    unpatched = tiny_model("llama")
    with pytest.raises(ValueError, match=r"not patched.*mlxevict.patch\(model\)"):
        unpatched(tokens[None, 20:21], cache=load_prompt_cache(str(path)))
    loaded = mlxevict.load_cache(path, unpatched)  # patches the model it is given
    expected = run_chunks(model, caches, tokens[20:], [1] * 20)
    assert mx.allclose(run_chunks(unpatched, loaded, tokens[20:], [1] * 20), expected, atol=1e-5).item()


@pytest.mark.parametrize(
    "other, message",
    [
        (dict(head_dim=32), "2 kv-heads of dim 16 but the model has 2 of dim 32"),
        (dict(num_key_value_heads=4), "2 kv-heads of dim 16 but the model has 4"),
        (dict(layers=3), "2 layers but the model has 3"),
    ],
)
def test_load_cache_refuses_another_model(tmp_path, other, message):
    model = tiny_model("llama")
    caches = make_cache(model, "window", budget=32)
    run_chunks(model, caches, random_tokens(10), [10])
    save_prompt_cache(str(tmp_path / "c.safetensors"), caches)
    with pytest.raises(ValueError, match=message):
        mlxevict.load_cache(tmp_path / "c.safetensors", tiny_model("llama", **other))


def test_load_cache_names_a_file_that_is_not_a_cache(tmp_path):
    weights = tmp_path / "model.safetensors"
    mx.save_safetensors(str(weights), {"w": mx.zeros((2, 2))})
    with pytest.raises(ValueError, match="is not a saved prompt cache"):
        mlxevict.load_cache(weights, tiny_model("llama"))
    with pytest.raises(ValueError, match="does not exist"):
        mlxevict.load_cache(tmp_path / "missing.safetensors", tiny_model("llama"))
