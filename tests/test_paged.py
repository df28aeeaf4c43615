"""The paged pilot (``benchmarks/paged.py``): evicted entries kept aside and read back by page."""

from __future__ import annotations

import mlx.core as mx
import pytest
from tiny_models import random_tokens, run_chunks, tiny_model

from mlxevict.benchmarks import caches as bcaches
from mlxevict.benchmarks import long_runs
from mlxevict.errors import MlxEvictError

CHUNKS = [32] * 12 + [1] * 16  # 400 tokens streamed into 128 entries, then single steps


def logits(model, name: str, budget: int | None = 128):
    caches = bcaches.make_caches(model, name, budget, bcaches.CacheSettings())
    return run_chunks(model, caches, random_tokens(sum(CHUNKS)), CHUNKS), caches


@pytest.mark.parametrize("kind", ["paged", "quest", "shared"])
def test_every_page_read_back_is_the_full_cache_and_none_is_the_evicting_cache(kind):
    model = tiny_model()
    full, _ = logits(model, "kvcache", None)
    plain, _ = logits(model, "default")
    every, caches = logits(model, f"{kind}-1000")
    none, _ = logits(model, f"{kind}-0")
    some, _ = logits(model, f"{kind}-2")
    c = caches[0]
    assert c.evictions > 0 and c.size() <= 128 and c.storage.spilled[0].shape[2] + c.size() == c.offset  # nothing lost
    assert mx.allclose(every, full, atol=1e-4) and not mx.allclose(plain, full, atol=1e-3)
    assert mx.array_equal(none, plain)
    gap = lambda x: mx.abs(x - full).max().item()  # noqa: E731
    assert gap(every) < gap(some) and not mx.array_equal(some, plain)


def test_shared_pages_are_a_choice_per_kv_head_not_per_query_head():
    model = tiny_model()  # 2 query heads per kv-head
    quest, shared = logits(model, "quest-2")[0], logits(model, "shared-2")[0]
    assert not mx.allclose(quest, shared, atol=1e-4)
    one_head = tiny_model(num_key_value_heads=4)  # one query head per kv-head: the same choice
    assert mx.array_equal(logits(one_head, "quest-2")[0], logits(one_head, "shared-2")[0])


def test_a_paged_name_is_known_to_the_suite_and_a_bad_one_is_one_error_line():
    long_runs.LongConfig(policies=("default", "paged-8", "quest-8", "shared-8")).check()
    with pytest.raises(MlxEvictError, match="--policies paged-x: unknown cache or policy"):
        long_runs.LongConfig(policies=("paged-x",)).check()
    with pytest.raises(MlxEvictError, match="--policies shared-8b7: unknown cache or policy"):
        long_runs.LongConfig(policies=("shared-8b7",)).check()  # mx.quantize has no 7 bits


def test_reads_are_counted_per_kv_head_k_pages_shared_up_to_k_per_query_head():
    from mlxevict.benchmarks.paged import PAGE
    from mlxevict.benchmarks.paged_reads import measure

    model = tiny_model()  # 2 query heads per kv-head
    tokens = random_tokens(400)[None]
    shared = measure(model, tokens, "shared-2", 64, decode=6, chunk=32)
    quest = measure(model, tokens, "quest-2", 64, decode=6, chunk=32)
    assert shared["evicted"] > 8 * PAGE
    assert shared["decode_step_entries"] == 2 * PAGE  # the K pages, once for the kv-head
    assert 2 * PAGE <= quest["decode_step_entries"] <= 2 * 2 * PAGE  # the union of 2 heads' K pages
    assert 0 <= shared["decode_step_new_entries"] <= shared["decode_step_entries"]
    assert shared["prompt_call_entries"] >= 2 * PAGE


def test_pages_in_fewer_bits_are_read_back_rounded():
    model = tiny_model(head_dim=64)  # mx.quantize's group of 64 channels
    plain, b8, b3 = (logits(model, n)[0] for n in ("shared-4", "shared-4b8", "shared-4b3"))
    gap = lambda x: mx.abs(x - plain).max().item()  # noqa: E731
    assert 0 < gap(b8) < gap(b3)


def test_pages_scored_from_sketched_keys_choose_otherwise_than_the_bound_and_8_bits_near_the_keys_themselves():
    model = tiny_model(head_dim=64)  # mx.quantize's group of 64 channels
    full = logits(model, "kvcache", None)[0]
    bound, s2, s8, every = (logits(model, n)[0] for n in ("shared-2", "shared-2s2", "shared-2s8", "shared-1000s2"))
    c = logits(model, "shared-2s2")[1][0]
    assert c.storage.sketch.shape == c.storage.spilled[0].shape  # a sketch of every evicted key
    assert not mx.allclose(bound, s2, atol=1e-4) and not mx.allclose(s2, s8, atol=1e-4)
    assert mx.allclose(every, full, atol=1e-4)  # every page read: the scores choose nothing
