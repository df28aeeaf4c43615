"""Per-model calibration: the layers low-bit KV hurts most, kept in 8 bits by the memory rule (random-weight models)."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest
from tiny_models import random_tokens, run_chunks, tiny_model

from mlxevict import cache_stats, make_cache
from mlxevict.calibrate import (
    Calibration, calibrate, calibration_path, find_calibration, fingerprint, folder_fingerprint, sensitive_layers,
)  # fmt: skip
from mlxevict.errors import MlxEvictError
from mlxevict.kvstorage import FLAGS, KVStorage
from mlxevict.plan import plan_cache
from mlxevict.quantized import QuantizedEvictingKVCache

D = 64  # head dim: the memory rule's group size divides it


def model64(layers: int = 4, **overrides):
    return tiny_model("llama", layers=layers, head_dim=D, hidden_size=128, max_position_embeddings=8192, **overrides)


def loud_keys(model, layer: int, scale: float = 40.0):
    """Scale one layer's key projection: its keys get a large range, which low bits store worst."""
    proj = model.layers[layer].self_attn.k_proj
    proj.weight = proj.weight * scale
    mx.eval(model.parameters())
    return model


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXEVICT_CACHE", str(tmp_path))
    return tmp_path


def test_a_layer_with_loud_keys_measures_a_larger_error():
    """Large keys (a wide range per channel) are what low bits store worst: that layer's error grows tenfold."""
    tokens = random_tokens(640).tolist()
    plain = calibrate(model64(), tokens, scored=256)
    loud = calibrate(loud_keys(model64(), 3), tokens, scored=256)
    assert len(plain.errors) == 4 and all(e >= 0 for e in plain.errors + loud.errors)
    assert loud.errors[3] > 10 * plain.errors[3]
    assert loud.tokens == 640 and loud.scored == 256 and loud.model == fingerprint(loud_keys(model64(), 3))
    assert loud.layers == sensitive_layers(loud.errors)


def test_sensitive_layers_take_the_largest_that_stand_out():
    flat = [1.0] * 10
    assert sensitive_layers(flat) == ()  # nothing stands out: no layer costs 8 bits
    assert sensitive_layers([1.0] * 9 + [9.0]) == (9,)
    assert sensitive_layers([1.0] * 8 + [5.0, 9.0], most=2) == (8, 9)
    assert sensitive_layers([1.0] * 8 + [3.0, 9.0], most=2) == (9,)  # 3x the median does not stand out


def test_a_text_no_longer_than_the_scored_tokens_is_refused():
    with pytest.raises(MlxEvictError, match="leaves none unscored"):
        calibrate(model64(), list(range(200)), scored=256)


def trained_norms(model, seed: int):
    """Norm weights as training leaves them (random init sets them all to one)."""
    norm = model.layers[0].input_layernorm
    norm.weight = 1 + 0.1 * mx.random.normal(norm.weight.shape, key=mx.random.key(seed))
    mx.eval(model.parameters())
    return model


def test_the_fingerprint_names_the_weights_not_their_dtype_nor_the_patch(tmp_path):
    from model_files import build_tiny_model
    from mlx_lm import load

    a, b = trained_norms(model64(), 0), trained_norms(model64(), 0)
    b.set_dtype(mx.float16)
    make_cache(b, "default", 256)  # patched
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint(trained_norms(model64(), 1))
    folder = build_tiny_model(tmp_path / "m", layers=2, hidden=128, heads=2, kv_heads=1)
    assert folder_fingerprint(folder) == fingerprint(load(str(folder))[0])


def test_a_saved_calibration_is_found_for_the_model_and_round_trips(cache_home):
    model = trained_norms(model64(), 0)
    assert find_calibration(model) is None
    saved = Calibration((0.1, 0.2, 0.9, 0.1), (2,), ":k5v3w8c64", 640, 256, fingerprint(model), "tiny")
    path = saved.save(calibration_path(model))
    assert path.parent.parent == cache_home and not list(path.parent.glob("*.tmp"))
    assert find_calibration(model) == saved
    assert find_calibration(trained_norms(model64(), 1)) is None
    path.write_text("{not json")
    with pytest.raises(MlxEvictError, match="is not a calibration file"):
        find_calibration(model)


def test_a_memory_budget_keeps_the_calibrated_layer_in_8_bits_at_the_same_bytes(cache_home):
    model = model64()
    Calibration((0.1, 0.1, 0.9, 0.1), (2,), ":k5v3w8c64", 640, 256, fingerprint(model)).save(calibration_path(model))
    budget = "300KB"  # 16-bit full cache: 2,048 bytes a token, so a share of 0.24 at 600 tokens, 0.12 at 1,200
    plan = plan_cache(model, budget, expected_tokens=600)
    assert plan.storage.eight_bit_layers == (2,) and "layer 2 in 8 bits" in plan.storage.label
    plain = plan_cache(model, budget, eight_bit_layers=(), expected_tokens=600)
    assert plain.storage.eight_bit_layers == () and plan.tokens < plain.tokens  # the 8-bit layer's bytes are counted
    # Below 18% of the full cache the bytes go to tokens instead (the layer lost there on the tuning half), and
    # below 14% (the cache evicts most of the context) the tiers are 5/3 over 4/3 instead of 5/4 over 3/2.
    assert (plain.storage.kv_bits, plain.storage.low_bits) == ((5, 4), (3, 2))
    assert plan_cache(model, budget, expected_tokens=900).storage == plain.storage
    heavy = replace(plain.storage, key_bits=5, value_bits=3, low_bits=(4, 3))
    assert plan_cache(model, budget, expected_tokens=1200).storage == heavy
    assert plan_cache(model, budget).storage == heavy  # expected: the model's context, 8,192 tokens
    caches = make_cache(model, "default", budget, expected_tokens=600)
    assert [type(c) is QuantizedEvictingKVCache for c in caches] == [False, False, True, False]
    run_chunks(model, caches, random_tokens(1500), [100] * 15)
    stats = cache_stats(caches)
    assert caches[0].evictions > 0 and caches[2].evictions > 0
    assert stats.nbytes <= plan.nbytes(model) <= 300_000 and stats.nbytes <= stats.full_nbytes
    # Explicit storage is explicit: the calibration is not added to it.
    given = make_cache(model, "default", budget, kv_bits=(5, 3), window_bits=8, key_group=64, low_bits=(3, 2),
                       expected_tokens=600)  # fmt: skip
    assert not any(isinstance(c, QuantizedEvictingKVCache) for c in given)


def test_eight_bit_layers_spell_and_check_like_every_storage_option():
    storage = KVStorage.of((5, 3), 64, window_bits=8, key_group=64, low_bits=(3, 2), eight_bit_layers=(20, 18))
    assert storage.eight_bit_layers == (18, 20) and storage.suffix == ":k5v3w8c64l32e18.20"
    assert KVStorage.from_suffix(storage.suffix) == storage
    assert KVStorage.parse("5,3", window_bits=8, key_group=64, low_bits="3,2", eight_bit_layers="18,20") == storage
    assert storage.flags.endswith("--eight-bit-layers 18,20")
    assert KVStorage.from_options(**storage.options()) == storage
    with pytest.raises(ValueError, match=r"--eight-bit-layers 18 needs the other layers under 8 bits"):
        KVStorage.of(None, eight_bit_layers=(18,), names=FLAGS)
    with pytest.raises(ValueError, match="distinct layer indices"):
        KVStorage.of((5, 3), eight_bit_layers=(3, 3))
    with pytest.raises(ValueError, match="no layer 4 to hold in 8 bits: the model has layers 0 to 3"):
        make_cache(model64(), "default", 512, kv_bits=(5, 3), window_bits=8, eight_bit_layers=(4,))


def test_the_calibrate_command_measures_saves_and_shows(tmp_path, cache_home, capsys, monkeypatch):
    from model_files import build_tiny_model

    from mlxevict.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = build_tiny_model(tmp_path / "m", layers=4, hidden=128, heads=2, kv_heads=1)
    assert main(["calibrate", str(folder), "--tokens", "512"]) == 0
    out, err = capsys.readouterr()
    saved = list((cache_home / "calibration").glob("*.json"))
    assert len(saved) == 1 and f"saved {saved[0]}" in out and "layer 4/4" in err
    result = Calibration.load(saved[0])
    assert len(result.errors) == 4 and result.tokens == 512 and result.name == "m"
    worst = max(range(4), key=lambda i: result.errors[i])
    assert f"layer {worst:>3}  {result.errors[worst]:.5f}" in out
    assert main(["calibrate", str(folder), "--show"]) == 0
    shown, _ = capsys.readouterr()
    assert shown.splitlines()[:3] == out.splitlines()[:3]
    assert main(["calibrate", str(folder), "--tokens", "100"]) == 1
    assert capsys.readouterr().err.strip() == "mlxevict: error: --tokens 100: give at least 512 (the last 256 are scored)"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--eight-bit-layers", "1"], "--eight-bit-layers 1 needs the other layers under 8 bits, such as --kv-bits 5,3"),
        (["--kv-bits", "5,3", "--eight-bit-layers", "x"], "--eight-bit-layers x is not layer numbers; write them like 18,20"),
        (["--kv-bits", "5,3", "--window-bits", "8", "--eight-bit-layers", "9"], "no layer 9 to hold in 8 bits: the model has layers 0 to 1"),
    ],
)
def test_the_eight_bit_layers_flag_fails_in_one_line(tmp_path, capsys, monkeypatch, flags, message):
    from model_files import build_tiny_model

    from mlxevict.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = build_tiny_model(tmp_path / "m", layers=2, hidden=128, heads=2, kv_heads=1)
    assert main(["generate", str(folder), "-p", "hi", "--max-tokens", "2", *flags]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlxevict: error: ") and message in err and len(err.splitlines()) == 1, err


def test_the_eight_bit_layers_flag_stores_that_layer_in_8_bits(tmp_path, capsys, monkeypatch):
    import json

    from model_files import build_tiny_model

    from mlxevict.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = build_tiny_model(tmp_path / "m", layers=2, hidden=128, heads=2, kv_heads=1)
    args = ["generate", str(folder), "-p", "hi", "--max-tokens", "40", "--budget", "64", "--json", "--temp", "0"]
    tiers = ["--kv-bits", "5,3", "--window-bits", "8"]
    assert main([*args, *tiers]) == 0
    plain = json.loads(capsys.readouterr().out)["cache"]["nbytes"]
    assert main([*args, *tiers, "--eight-bit-layers", "1"]) == 0
    eight = json.loads(capsys.readouterr().out)["cache"]["nbytes"]
    assert eight > plain  # the same 64 tokens, one layer of two in 8 bits instead of 5/3


def test_info_says_whether_the_model_is_calibrated(tmp_path, cache_home, capsys, monkeypatch):
    from model_files import build_tiny_model

    from mlxevict.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = build_tiny_model(tmp_path / "m", layers=2, hidden=128, heads=2, kv_heads=1)
    assert main(["info", str(folder)]) == 0
    assert "calibration   none: `mlxevict calibrate MODEL`" in capsys.readouterr().out
    Calibration((0.1, 0.9), (1,), ":k5v3w8c64", 512, 256, "").save(calibration_path(folder))
    assert main(["info", str(folder)]) == 0
    assert "calibration   layer 1 in 8 bits when a --budget in memory evicts" in capsys.readouterr().out
    calibration_path(folder).write_text("{damaged")  # said once, not taken for "never calibrated" in silence
    assert main(["info", str(folder)]) == 0
    out, err = capsys.readouterr()
    assert "calibration   none" in out and err.count("is not a calibration file") == 1
    assert "planning without it; `mlxevict calibrate MODEL` writes it again" in err
