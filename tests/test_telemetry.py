"""Memory telemetry: snapshots, KV bytes per token against real caches, budgets from memory, the guard."""

from __future__ import annotations

import math

import mlx.core as mx
import psutil
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import quantize_model
from model_files import build_tiny_model

import mlxevict
from mlxevict.errors import MlxEvictError
from mlxevict.budget import MIN_AUTO_BUDGET, BudgetRequest, budget_tokens, fit_budget, held_nbytes, tokens_within
from mlxevict.budget import parse_budget, parse_size
from mlxevict.geometry import kv_bytes_per_token, kv_shape
from mlxevict.memory import MemoryGuard, format_bytes, memory_snapshot


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", layers=3, hidden=64, heads=4, kv_heads=2)
    model, tokenizer = load(str(path))
    return path, model


def measured_bytes_per_token(model, n: int = 10) -> int:
    """KV bytes per token as mlx-lm's own ``KVCache`` stores them after a forward pass."""
    caches = make_prompt_cache(model)
    model(mx.arange(n)[None], cache=caches)
    mx.eval([c.state for c in caches])
    return sum((c.keys.nbytes + c.values.nbytes) // c.keys.shape[2] for c in caches)


def test_kv_bytes_per_token_matches_a_real_cache(tiny):
    path, model = tiny
    expected = 3 * 2 * 16 * 2 * 4  # layers x kv-heads x head-dim x 2 x float32
    assert kv_bytes_per_token(model) == expected
    assert kv_bytes_per_token(path) == expected  # dtype read from the safetensors header
    assert measured_bytes_per_token(model) == expected


def test_kv_bytes_per_token_of_a_float16_and_a_quantized_model(tmp_path):
    path = build_tiny_model(tmp_path / "h", dtype=mx.float16)
    model, _ = load(str(path))
    assert (
        kv_bytes_per_token(path) == kv_bytes_per_token(model) == measured_bytes_per_token(model) == 2 * 2 * 16 * 2 * 2
    )
    quantized, _ = quantize_model(model, {}, group_size=32, bits=4)
    assert kv_bytes_per_token(quantized) == measured_bytes_per_token(quantized)


def test_kv_shape_from_a_config_dict():
    config = {
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "hidden_size": 1536,
        "torch_dtype": "bfloat16",
    }
    shape = kv_shape(config)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.dtype_size) == (28, 2, 128, 2)
    assert kv_bytes_per_token(config) == 28 * 2 * 128 * 2 * 2
    with pytest.raises(MlxEvictError, match="num_hidden_layers"):
        kv_shape({"hidden_size": 8})
    with pytest.raises(MlxEvictError, match="unknown dtype 'int7'"):
        kv_shape({**config, "torch_dtype": "int7"})


def test_memory_snapshot_reads_mlx_system_process_and_caches(tiny):
    _, model = tiny
    caches = mlxevict.make_cache(model, "window", 64)
    model(mx.arange(100)[None], cache=caches)
    mx.eval([c.keys for c in caches])
    snap = memory_snapshot(caches)
    system = psutil.virtual_memory()
    assert snap.system_total == system.total
    assert 0 < snap.system_available <= snap.system_total
    assert snap.process_rss > 0 and snap.mlx_active > 0 and snap.mlx_peak >= snap.mlx_active
    stats = mlxevict.cache_stats(caches)
    assert snap.kv_nbytes == stats.nbytes == sum(c.keys.nbytes + c.values.nbytes for c in caches)
    assert snap.kv_full_nbytes == 256 * kv_bytes_per_token(model)  # mlx-lm's KVCache: whole steps of 256 slots
    assert snap.kv_saved_nbytes == snap.kv_full_nbytes - snap.kv_nbytes > 0
    # mlx-lm's own caches: held == full.
    plain = make_prompt_cache(model)
    model(mx.arange(5)[None], cache=plain)
    snap = memory_snapshot(plain)
    assert snap.kv_nbytes == snap.kv_full_nbytes == sum(c.nbytes for c in plain) > 0
    assert memory_snapshot().kv_nbytes == 0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4096", 4096),
        ("1.5GB", 1_500_000_000),
        ("800MB", 800_000_000),
        ("2GiB", 2 * 1024**3),
        ("512 kib", 512 * 1024),
        ("3g", 3 * 10**9),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "1.5XB", "-1GB", "one GB", "1e9"])
def test_parse_size_refuses(text):
    with pytest.raises(MlxEvictError, match="is not a memory size; write it like 1.5GB"):
        parse_size(text)


def test_format_bytes_round_trips_through_parse_size():
    assert format_bytes(1536 * 1024**2) == "1.5 GiB"
    assert format_bytes(512) == "512 B"
    assert parse_size(format_bytes(3 * 1024**2).replace(" ", "")) == 3 * 1024**2


@pytest.mark.parametrize(
    "text, request_",
    [
        ("2048", BudgetRequest("2048", tokens=2048)),
        ("1.5GB", BudgetRequest("1.5GB", nbytes=1_500_000_000)),
        ("auto", BudgetRequest("auto")),
        ("AUTO", BudgetRequest("AUTO")),
    ],
)
def test_parse_budget(text, request_):
    assert parse_budget(text) == request_


@pytest.mark.parametrize(
    "text, message",
    [
        ("abc", "bad --budget 'abc': give tokens (2048), KV memory (1.5GB, 800MB) or auto"),
        ("1.5", "bad --budget '1.5': give tokens"),
        ("12XB", "bad --budget '12XB'"),
        ("0", "bad --budget '0': the budget must be a positive number of tokens"),
        ("-5", "bad --budget '-5': the budget must be a positive number of tokens"),
        ("0MB", "bad --budget '0MB': the KV memory must be positive"),
    ],
)
def test_parse_budget_refuses(text, message):
    with pytest.raises(MlxEvictError) as err:
        parse_budget(text)
    assert str(err.value).startswith(message)


def test_budget_tokens_from_memory(tiny):
    _, model = tiny
    per_token = kv_bytes_per_token(model)
    assert budget_tokens(parse_budget("100"), model) == 100
    assert budget_tokens(parse_budget(f"{per_token * 300}"), model) == per_token * 300  # plain digits are tokens
    assert budget_tokens(parse_budget(f"{per_token * 300 / 1000:.3f}KB"), model) == 300
    auto = budget_tokens(parse_budget("auto"), model, available=per_token * 4096 * 4)
    assert auto == 4096
    assert budget_tokens(parse_budget("auto"), model, available=10**12, context_limit=2048) == 2048


def test_fit_budget():
    assert fit_budget(1000, 4_000_000, fraction=0.25) == 960  # 1000 tokens, floored to 64
    assert fit_budget(1000, 0) == MIN_AUTO_BUDGET
    assert fit_budget(10, 10**12, context_limit=8192) == 8192
    sizes = [fit_budget(1000, n) for n in (10**6, 10**7, 10**8, 10**9)]
    assert sizes == sorted(sizes)


def test_guard_sets_and_restores_mlx_memory_limit():
    before = mx.set_memory_limit(12 * 1024**3)
    try:
        with MemoryGuard(mlx_limit=3 * 1024**3) as guard:
            assert mx.set_memory_limit(3 * 1024**3) == 3 * 1024**3  # the guard's limit was in force
            assert guard.check() == ""
        assert mx.set_memory_limit(12 * 1024**3) == 12 * 1024**3  # restored on exit
    finally:
        mx.set_memory_limit(before)


def test_guard_stops_before_swap_and_at_the_mlx_limit():
    total = psutil.virtual_memory().total
    message = MemoryGuard(margin=2 * total).check()
    assert message.startswith("stopped before the machine would swap:") and "lower --budget" in message
    keep = mx.ones((1024, 1024))
    mx.eval(keep)
    message = MemoryGuard(mlx_limit=1024).check()
    assert message.startswith("stopped at the memory limit: MLX holds") and "1.0 KiB limit" in message


@pytest.mark.parametrize("kwargs, message", [({"margin": -1}, "margin -1"), ({"mlx_limit": 0}, "mlx_limit=0")])
def test_guard_refuses_bad_settings(kwargs, message):
    with pytest.raises(MlxEvictError, match=message):
        MemoryGuard(**kwargs)


def test_default_guard_leaves_the_system_its_margin():
    guard = MemoryGuard()
    total = psutil.virtual_memory().total
    assert guard.mlx_limit == max(total - guard.margin, total // 2)
    assert math.isclose(guard.margin, 1024**3)


@pytest.mark.parametrize("window_bytes, fp_window", [(None, None), (320, None), (1024, None), (1024, 0), (320, 8)])
def test_tokens_within_count_a_quantized_window_at_its_own_size(window_bytes, fp_window):
    for nbytes in (0, 100, 5_000, 100_000, 10**9):
        tokens = tokens_within(nbytes, 192, window_bytes, fp_window)
        assert held_nbytes(tokens, 192, window_bytes, fp_window) <= nbytes
        assert held_nbytes(tokens + 1, 192, window_bytes, fp_window) > nbytes
    assert fit_budget(192, 4 * 100_000, window_bytes_per_token=1024) == tokens_within(100_000, 192, 1024) // 64 * 64


def test_the_old_telemetry_path_still_imports():
    """``mlxevict.telemetry`` (0.1's module) re-exports the objects of memory, geometry, budget and plan."""
    import mlxevict.telemetry as old
    from mlxevict import budget, geometry, memory, plan

    for name in old.__all__:
        home = next(m for m in (budget, geometry, memory, plan) if hasattr(m, name))
        assert getattr(old, name) is getattr(home, name), name
    assert old.MemoryGuard is MemoryGuard and old.parse_budget is parse_budget and old.kv_shape is kv_shape
