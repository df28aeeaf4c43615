"""Storage modes in the evaluation harness (``NAME:q8``), 16-bit byte accounting and the kv_bits report."""

from __future__ import annotations

import pytest
from tiny_models import random_tokens, tiny_model

from mlxevict import QuantizedEvictingKVCache
from mlxevict.benchmarks import caches as bcaches
from mlxevict.benchmarks import kv_bits


@pytest.fixture(scope="module")
def model():
    return tiny_model(head_dim=64)  # mlx-lm's quantized caches group by 64


def test_storage_suffix_names():
    assert bcaches.split_storage("default:q8") == ("default", {"kv_bits": 8})
    assert bcaches.split_storage("rkv:q4") == ("rkv", {"kv_bits": 4}) and bcaches.split_storage("rkv") == ("rkv", {})
    assert bcaches.split_storage("rkv:q4w8") == ("rkv", {"kv_bits": 4, "window_bits": 8})
    # any suffix the storage reads, not only the swept ones
    assert bcaches.split_storage("default:k4v2w8c64") == ("default", {"kv_bits": (4, 2), "window_bits": 8, "key_group": 64})
    assert bcaches.parse_names("default:q8,rkv:q4") == ["kvcache", "default:q8", "rkv:q4"]
    assert bcaches.takes_budget("h2o:q8") and not bcaches.takes_budget("full:q4")
    for bad in ("quantized8:q8", "rotating:q4", "nope:q8"):
        with pytest.raises(ValueError, match="a policy with :q8 or :q4 stores"):
            bcaches.parse_names(bad)
    # a suffix that reads but is not a storage: the storage's own reason
    with pytest.raises(ValueError, match=r"^default:q3: kv_bits=3 is not supported"):
        bcaches.parse_names("default:q3")


def test_make_caches_with_storage_suffix(model):
    caches = bcaches.make_caches(model, "rkv:q4", 32, bcaches.CacheSettings())
    assert all(type(c) is QuantizedEvictingKVCache for c in caches)
    assert (caches[0].kv_bits, caches[0].kv_group_size, caches[0].policy_name) == (4, 64, "rkv")


def test_kv_bytes_16bit_counts_floats_at_two_bytes(model):
    tokens = random_tokens(40)[None]
    names = ("kvcache", "quantized8", "default:q8", "rotating")
    made = {n: bcaches.make_caches(model, n, 32, bcaches.CacheSettings()) for n in names}
    for caches in made.values():
        model(tokens, cache=caches)
    layers, H, D = len(model.layers), 2, 64
    # mlx-lm: the 40 entries held (of 256 slots allocated), 64 bytes of packed words plus a 16-bit scale and bias
    assert bcaches.kv_bytes_16bit(made["quantized8"]) == layers * 2 * H * 40 * (64 + 2 * 2)
    assert bcaches.kv_bytes_16bit(made["kvcache"]) == layers * 2 * H * 40 * D * 2
    # mlxevict: budget 32 with the recent window of 4 in 16-bit, the other 28 slots quantized
    c = made["default:q8"][0]
    assert c.full_precision_window == 4
    assert bcaches.kv_bytes_16bit(made["default:q8"]) == layers * 2 * H * (28 * (64 + 2 * 2) + 4 * D * 2)
    assert bcaches.kv_bytes_16bit(made["rotating"]) == layers * 2 * H * 32 * D * 2  # max_size 32 of 40 seen


def row(cache, fraction, retrieval, kl, nbytes, kind="mlxevict"):
    return {
        "cache": cache, "kind": kind, "budget_fraction": fraction, "budget": None if fraction is None else 100,
        "retrieval_accuracy": retrieval, "fidelity_kl": kl, "kv_bytes_16bit": nbytes, "bookkeeping_bytes": 10,
        "kv_fraction_16bit": nbytes / 1000,
    }  # fmt: skip


def test_check_target():
    rows = [
        row("kvcache", None, 1.0, 0.0, 1000, "mlx-lm"),
        row("quantized8", None, 1.0, 0.001, 530, "mlx-lm"),
        row("default:q8", 0.5, 1.0, 0.011, 265),  # meets: KL within 0.01, exactly half the bytes
        row("default:q8", 0.25, 1.0, 0.0111, 140),  # KL 0.0001 too high
        row("h2o:q8", 0.5, 0.9, 0.002, 200),  # misses a retrieval answer
        row("default", 0.5, 1.0, 0.002, 500),  # too many bytes
    ]
    target = kv_bits.check_target(rows)
    assert target["met_by"] == ["default:q8 @ 0.5"]
    checks = {(c["cache"], c["budget_fraction"]): c for c in target["rows"]}
    assert checks[("default:q8", 0.5)]["bytes"] and not checks[("default:q8", 0.5)]["bytes_with_bookkeeping"]
    assert not checks[("default:q8", 0.25)]["kl"] and not checks[("h2o:q8", 0.5)]["retrieval"]
    assert not checks[("default", 0.5)]["bytes"]


def test_speed_ratios_are_medians_of_per_round_ratios():
    decode = [
        {"cache": "quantized8", "round_tok_s": [10.0, 20.0, 10.0], "decode_tok_s": 12.0},
        {"cache": "default:q8", "round_tok_s": [9.0, 10.0, 11.0], "decode_tok_s": 10.0},
        {"cache": "default", "round_tok_s": [1.0, 1.0, 1.0], "decode_tok_s": 1.0},
        {"cache": "rkv:q4", "round_tok_s": [1.0], "decode_tok_s": 1.0},  # no quantized4 in the run
    ]
    (ratio,) = kv_bits.speed_ratios(decode)
    assert ratio["cache"] == "default:q8" and ratio["versus"] == "quantized8"
    assert ratio["ratio"] == pytest.approx(0.9) and ratio["rounds"] == 3


def test_a_key_value_pair_is_compared_at_the_same_bytes():
    decode = [
        {"cache": "quantized4", "round_tok_s": [10.0, 10.0], "decode_tok_s": 10.0},
        {"cache": "quantized8", "round_tok_s": [20.0, 20.0], "decode_tok_s": 20.0},
        {"cache": "default:k5v3w8", "round_tok_s": [8.0, 7.0], "decode_tok_s": 7.5},
    ]
    (ratio,) = kv_bits.speed_ratios(decode)
    assert ratio["versus"] == "quantized4" and ratio["ratio"] == pytest.approx(0.75)


def test_storage_step_times_every_mode(capsys):
    from mlxevict.benchmarks import storage_step

    assert storage_step.main(["--budget", "160", "--rounds", "2", "--steps", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split("|") for line in out if line.startswith("| ") and not line.startswith("| storage")]
    assert [r[1].strip() for r in rows] == [*storage_step.MODES, storage_step.MLX_LM_Q4]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 and int(r[4]) > 0 for r in rows)


def test_entries_within_refuses_an_unknown_cache(model):
    with pytest.raises(ValueError, match="unknown cache 'default:zz'"):
        bcaches.entries_within(model, "default:zz", 0.25, 256, bcaches.CacheSettings())
