"""Storage grows in steps up to the budget, then stays flat: never above a full cache by more than a step."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from tiny_models import random_tokens, run_chunks, tiny_model

import mlxevict
from mlxevict.stats import full_cache_slots
from mlxevict import make_cache
from mlxevict.cache_slots import FIRST_STEP, GROW_STEP
from mlxevict.budget import storage_nbytes
from mlxevict.kvstorage import KVStorage
from mlxevict.policies import make_policy

GROUP = 32
BUDGET = 1000  # not a multiple of the step: the last capacity is the budget itself
STORAGES = {
    "dtype": dict(),
    "8-bit": dict(kv_bits=8, kv_group_size=GROUP),
    "4-bit": dict(kv_bits=4, kv_group_size=GROUP),
    "5/3-bit, 8-bit window": dict(kv_bits=(5, 3), kv_group_size=GROUP, window_bits=8),
    "keys per channel": dict(kv_bits=(5, 3), kv_group_size=GROUP, window_bits=8, key_group=64),
    "precision tiers": dict(kv_bits=(5, 3), kv_group_size=GROUP, window_bits=8, key_group=64, low_bits=(3, 2)),
    "precision tiers, a layer in 8 bits": dict(
        kv_bits=(5, 3), kv_group_size=GROUP, window_bits=8, key_group=64, low_bits=(3, 2), eight_bit_layers=(1,)
    ),
    "compress": dict(prompt_mode="compress"),
}
# A prompt, then chunks and single steps: 10 lengths from 60 to 1,565 tokens.
CHUNKS = [60, 200, 1, 300, 1, 400, 1, 600, 1, 1]


@pytest.mark.parametrize("storage", STORAGES)
def test_kv_bytes_never_above_a_full_cache_plus_one_step(storage):
    model = tiny_model("llama", layers=2, head_dim=GROUP)
    model.set_dtype(mx.float16)
    options = STORAGES[storage]
    caches = make_cache(model, "default", budget=BUDGET, **options)
    full = [KVCache() for _ in model.layers]
    tokens = random_tokens(sum(CHUNKS))
    quantized = {k: v for k, v in options.items() if k != "prompt_mode"}
    budget_nbytes = storage_nbytes(model, BUDGET, KVStorage.from_options(**quantized))  # all layers
    step = caches[0].step
    assert step == GROW_STEP
    seen, capacities = 0, set()
    for size in CHUNKS:
        run_chunks(model, caches, tokens[seen : seen + size], [size])
        run_chunks(model, full, tokens[seen : seen + size], [size])
        seen += size
        stats = mlxevict.cache_stats(caches)
        full_nbytes = sum(c.nbytes for c in full)  # mlx-lm's KVCache, itself grown in steps of 256
        per_token = stats.full_nbytes // full_cache_slots(seen)
        assert stats.full_nbytes == full_cache_slots(seen) * per_token
        assert stats.nbytes <= stats.full_nbytes, (seen, stats)  # what the stats line, TUI and plots show
        assert stats.nbytes <= seen * per_token + step * per_token, (seen, stats)
        assert stats.nbytes <= full_nbytes + step * per_token
        decoding = size == 1 or options.get("prompt_mode") != "compress"
        if decoding:  # compress mode holds the whole prompt until decoding starts
            assert stats.nbytes <= budget_nbytes and stats.capacity <= BUDGET
        capacities.add(stats.capacity)
    assert stats.kept <= BUDGET and stats.evicted > 0
    # per-channel keys hold a scale table whose rows come and go with their groups: at most the plan's bytes
    assert stats.nbytes <= budget_nbytes if "key_group" in options else stats.nbytes == budget_nbytes
    # the compiled kernels see few, fixed shapes: whole steps (64-slot ones below 256), then the budget
    assert all(c % step == 0 or c == BUDGET or (c < step and c % FIRST_STEP == 0) for c in capacities), capacities
    assert FIRST_STEP in capacities


def test_a_short_chat_holds_a_short_cache():
    """Issue 18's report: budget 2048, a short chat, KV 90 MiB vs 1.8 MiB full."""
    model = tiny_model("llama", layers=2)
    caches = make_cache(model, "default", budget=2048)
    run_chunks(model, caches, random_tokens(30), [20] + [1] * 10)
    stats = mlxevict.cache_stats(caches)
    assert stats.capacity == FIRST_STEP and stats.nbytes * 4 == stats.full_nbytes  # 64 slots against 256


def test_a_large_budget_never_holds_more_slots_than_a_full_cache():
    """Budgets over 4096 grew in steps of 512+ and could show above KVCache between steps."""
    budget = 5000
    model = tiny_model("llama", layers=1, max_position_embeddings=8192)  # a budget under the context
    caches = make_cache(model, "window", budget=budget, window=16)
    assert caches[0].step == GROW_STEP
    capacities, seen = set(), 0
    tokens = random_tokens(6000)
    while seen < tokens.size:
        run_chunks(model, caches, tokens[seen : seen + 300], [300])
        seen += 300
        assert caches[0].capacity <= full_cache_slots(seen), seen
        capacities.add(caches[0].capacity)
    assert capacities <= {*range(GROW_STEP, budget, GROW_STEP), budget} and budget in capacities
    assert caches[0].size() <= budget


# Policies whose own state used to sit above a full cache on short prompts (issue 18): the recent
# queries of a query-window policy, the queued queries of an observing one.
QUERY_READERS = [name for name in mlxevict.policy_names() if name not in ("full", "window", "knorm", "random")]


@pytest.mark.parametrize("policy", QUERY_READERS)
def test_a_short_prompt_leaves_no_query_state_behind(policy):
    model = tiny_model("llama", layers=2, head_dim=GROUP)
    caches = make_cache(model, policy, budget=2048)
    run_chunks(model, caches, random_tokens(40), [40])
    log = caches[0].queries
    held = log.count + (0 if log.recent is None else log.recent.shape[2])
    assert held == 0, (policy, log.count, log.recent)


@pytest.mark.parametrize("policy", ["default", "snapkv", "tova", "rkv"])
def test_queries_no_eviction_reads_are_not_kept_and_nothing_changes(policy, monkeypatch):
    """The same chunks with every query kept (the old behaviour) and with the early ones skipped:
    equal logits and the same entries kept, through many evictions."""
    from mlxevict.eviction import CacheEviction

    model = tiny_model("llama", layers=2, head_dim=GROUP)
    tokens = random_tokens(700)
    chunks = [30, 40] + [1] * 10 + [50] + [1] * 570

    def kept(first_read):
        monkeypatch.setattr(mlxevict.EvictingKVCache, "first_query_read", first_read)
        caches = make_cache(model, policy, budget=400)
        logits = run_chunks(model, caches, tokens, chunks)
        return logits, [c.positions[: c.size()] for c in caches], caches[0].evictions, caches[0].first_query_read

    every_query = kept(property(lambda self: -1))
    skipped = kept(CacheEviction.first_query_read)
    assert skipped[3] > 30 and every_query[2] > 10  # the first chunk's queries were skipped, then many evictions
    assert mx.allclose(every_query[0], skipped[0], atol=1e-5).item()
    assert all(mx.array_equal(a, b).item() for a, b in zip(every_query[1], skipped[1]))


@pytest.mark.parametrize("policy", [name for name in mlxevict.policy_names() if make_policy(name).observes])
def test_observers_fold_a_prompt_chunk_in_pieces_with_the_same_statistics(policy, monkeypatch):
    """Attention rows of a 200-query chunk in 64-query pieces (less peak memory) or all at once: the same stats."""
    import mlxevict.kernels as kernels

    model = tiny_model("llama", layers=2, head_dim=GROUP)
    tokens = random_tokens(230)

    def stats(piece: int):
        monkeypatch.setattr(kernels, "QUERY_PIECE", piece)
        caches = make_cache(model, policy, budget=2048)
        run_chunks(model, caches, tokens, [200, 30])
        return [c.stats for c in caches]

    at_once, in_pieces = stats(10_000), stats(kernels.QUERY_PIECE)
    assert any(mx.any(s != 0).item() for s in at_once)  # the policy did fold something in
    assert all(mx.allclose(a, b, rtol=1e-5, atol=1e-6).item() for a, b in zip(at_once, in_pieces))
