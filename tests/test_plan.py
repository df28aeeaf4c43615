"""The storage value and the one planner: every spelling of a storage, every budget form, one rule each."""

from __future__ import annotations

import warnings

import pytest
from tiny_models import tiny_model

from mlxevict import make_cache
from mlxevict.budget import parse_budget, storage_nbytes
from mlxevict.errors import MlxEvictError
from mlxevict.kvstorage import API, DTYPE, FLAGS, KVStorage, check
from mlxevict.plan import memory_storage, plan_cache, protected_room

SPLIT = KVStorage.of((5, 3), window_bits=8)


@pytest.mark.parametrize(
    "storage, label, flags, suffix",
    [
        (DTYPE, "model dtype", "--kv-bits none", ""),
        (KVStorage.of(8), "8-bit", "--kv-bits 8", ":q8"),
        (KVStorage.of(4, window_bits=8), "4-bit", "--kv-bits 4 --window-bits 8", ":q4w8"),
        (SPLIT, "5/3-bit", "--kv-bits 5,3 --window-bits 8", ":k5v3w8"),
        (KVStorage.of((5, 3), 32, 16), "5/3-bit", "--kv-bits 5,3 --kv-group-size 32 --fp-window 16", ":k5v3"),
    ],
)
def test_one_storage_in_every_spelling(storage, label, flags, suffix):
    assert (storage.label, storage.flags, storage.suffix) == (label, flags, suffix)
    assert KVStorage.from_suffix(suffix) == KVStorage.of(storage.kv_bits, window_bits=storage.window_bits)
    bits, *rest = flags.split()[1:]
    options = dict(zip(rest[::2], map(int, rest[1::2])))
    parsed = KVStorage.parse(
        bits, options.get("--kv-group-size"), options.get("--fp-window"), options.get("--window-bits")
    )
    assert parsed == storage and KVStorage.from_options(**storage.options()) == storage


def test_one_message_per_rule_in_the_api_and_the_flags_spelling():
    for names, window, bits in ((API, "window_bits=8", "kv_bits under 8"), (FLAGS, "--window-bits 8", "--kv-bits under 8")):
        with pytest.raises(ValueError) as err:
            check(None, window_bits=8, names=names)
        assert str(err.value).startswith(f"{window} needs {bits}, such as 4 or ")
    with pytest.raises(ValueError, match=r"^kv_bits=7 is not supported"):
        KVStorage(7, 7)
    with pytest.raises(ValueError, match="give both, or neither"):
        KVStorage(4, None)
    with pytest.raises(ValueError, match=r"^'q7': kv_bits=7 is not supported"):  # read, but not a storage: why
        KVStorage.from_suffix("q7")
    with pytest.raises(ValueError, match=r"'q' is not a storage suffix; use :q8"):
        KVStorage.from_suffix("q")


def test_bytes_per_token_by_storage():
    # head dim 128, 2-byte dtype, group 64: 256 B in the dtype; 8 bits 128 + 8 of scales/biases; 5/3: 80+48+16
    assert DTYPE.bytes_per_token(128, 2) == 2 * 256
    assert KVStorage.of(8).bytes_per_token(128, 2) == 2 * (128 + 8)
    assert SPLIT.bytes_per_token(128, 2) == (80 + 8) + (48 + 8)
    assert SPLIT.window_bytes_per_token(128, 2) == 2 * (128 + 8) and DTYPE.window_bytes_per_token(128, 2) is None


def test_an_integer_budget_is_capped_at_the_model_context():
    model = tiny_model(max_position_embeddings=8192)
    plan = plan_cache(model, 60000)
    assert plan.tokens == 8192 == plan.context_limit and plan.storage == DTYPE
    assert plan.notes == ("--budget 60000 is 60000 tokens, more than the model's context of 8192; using 8192",)
    assert plan_cache(model, "60000").tokens == 8192 and plan_cache(model).notes == ()  # the default says nothing
    with pytest.warns(UserWarning, match="more than the model's context of 8192"):
        caches = make_cache(model, budget=60000)
    assert caches[0].budget == 8192
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_cache(model, budget=4096)[0].budget == 4096


def test_a_budget_in_memory_takes_the_storage_rule_in_every_caller():
    model = tiny_model(head_dim=32, hidden_size=128)  # 1,024 B a token in float32, 4,096 tokens of context
    request = parse_budget("100KB")
    plan = plan_cache(model, "100KB")
    # 100 KB is 5% of a 16-bit cache of the 4,096-token context: the low tier for heavy eviction (HEAVY_SHARE)
    assert plan.storage == memory_storage(request, model, 4096) == KVStorage.of((5, 3), 32, window_bits=8, key_group=64, low_bits=(4, 3))
    usual = memory_storage(request, model, 4096, expected_tokens=500)  # 39%: the usual 5/4 over 3/2
    assert (usual.kv_bits, usual.low_bits) == ((5, 4), (3, 2))
    assert plan.nbytes(model) <= 100_000 < storage_nbytes(model, plan.tokens + 1, plan.storage)
    caches = make_cache(model, "default", "100KB")
    assert caches[0].budget == plan.tokens and caches[0].kv_bits == (5, 3) and caches[0].window_bits == 8
    # asked-for storage wins; a budget in tokens stays in the dtype
    assert plan_cache(model, "100KB", KVStorage.of(8, 32)).storage == KVStorage.of(8, 32)
    assert plan_cache(model, 64).storage == DTYPE
    with pytest.raises(MlxEvictError, match=r"--budget 10B holds no token of this model's KV \(192 bytes"):
        plan_cache(model, "10B")
    with pytest.raises(ValueError, match="kv_group_size=64 does not divide the head dim 32"):
        plan_cache(model, 64, KVStorage.of(8))


def test_protected_room_is_what_the_cache_refuses():
    model = tiny_model()
    room = protected_room(64, "default", sinks=4, window=8, slack=4, pinned=[(10, 20)])
    assert room == 4 + 8 + 10 + 4
    assert protected_room(64, sinks=4, window=8, slack=4, storage=KVStorage.of(8, full_precision_window=12)) == 4 + 12 + 4
    for budget in (room, room + 1):
        try:
            make_cache(model, "default", budget, sinks=4, window=8, slack=4, pinned=[(10, 20)])
            fits = True
        except ValueError:
            fits = False
        assert fits == (budget > room)
    # a quantized cache's full-precision window counts instead of a smaller recent window: the same rule
    model = tiny_model(head_dim=32, hidden_size=128)
    storage = KVStorage.of(8, 32, full_precision_window=12)
    room = protected_room(64, sinks=4, window=8, slack=4, storage=storage)
    for budget in (room, room + 1):
        try:
            make_cache(model, "default", budget, sinks=4, window=8, slack=4, **storage.options())
            fits = True
        except ValueError as e:
            assert "full_precision_window=12 leaves no room to evict" in str(e)
            fits = False
        assert fits == (budget > room)
