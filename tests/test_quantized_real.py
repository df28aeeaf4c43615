"""Quantized storage on the real SmolLM2-135M-Instruct test model (slow)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache

import mlxevict
from mlxevict import make_cache

pytestmark = pytest.mark.slow

QUESTION = "Explain step by step how a bicycle stays upright, then list five uses of a paperclip."


@pytest.fixture(scope="module")
def smollm(smollm_path):
    model, tokenizer = load(str(smollm_path))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    return model, mx.array(prompt)


def greedy(model, prompt: mx.array, cache, n: int) -> list[int]:
    return [token for (token, _), _ in zip(generate_step(prompt, model, prompt_cache=cache, max_tokens=n), range(n))]


def test_8bit_storage_equals_mlx_lm_quantized_cache_over_300_tokens(smollm):
    model, prompt = smollm
    # Built directly: mlx-lm's own --kv-bits only quantizes from quantized_kv_start (5000) on.
    theirs = greedy_by_token(model, prompt, [QuantizedKVCache(group_size=64, bits=8) for _ in model.layers], 300)
    caches = make_cache(model, "default", budget=512, kv_bits=8, kv_group_size=64, full_precision_window=0)
    ours = greedy_by_token(model, prompt, caches, 300)
    assert mlxevict.cache_stats(caches).evicted == 0
    assert ours == theirs


def greedy_by_token(model, prompt: mx.array, cache, n: int) -> list[int]:
    """Greedy decoding with the prompt fed one token at a time.

    One query per step is where mlxevict's quantized attention is mlx-lm's operation for
    operation; a multi-token step on the CPU dequantizes first (equal within rounding,
    tests/test_quantized.py), which a 300-token greedy run would turn into a different text.
    """
    for token in prompt[:-1].tolist():
        mx.eval(model(mx.array([[token]]), cache=cache))
    y, out = prompt[-1:], []
    for _ in range(n):
        y = model(y[None], cache=cache)[0, -1:].argmax(axis=-1)
        out.append(y.item())
    return out


def mean_kl_to_full(model, tokens: mx.array, caches) -> float:
    """Mean ``KL(p_full ‖ p_cache)`` over ``tokens`` fed in 16-token steps."""
    full = [KVCache() for _ in model.layers]
    kl = []
    for start in range(0, tokens.size, 16):
        chunk = tokens[None, start : start + 16]
        ref = log_probs(model(chunk, cache=full))
        got = log_probs(model(chunk, cache=caches))
        kl.append((mx.exp(ref) * (ref - got)).sum(axis=-1))
    return mx.concatenate(kl, axis=1).mean().item()


def log_probs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def answer_tokens(smollm) -> mx.array:
    """The prompt and the full cache's 150 greedy tokens."""
    model, prompt = smollm
    return mx.concatenate([prompt, mx.array(greedy(model, prompt, None, 150))])


def test_rotation_lowers_4bit_error_on_the_real_model(smollm, answer_tokens):
    """Rotated 4-bit storage is much closer to the full cache than mlx-lm-style unrotated 4-bit."""
    model, tokens = smollm[0], answer_tokens
    kl = {}
    for rotate in (False, True):
        caches = make_cache(model, "default", budget=512, kv_bits=4, full_precision_window=0, kv_rotate=rotate)
        kl[rotate] = mean_kl_to_full(model, tokens, caches)
    assert kl[True] < 0.75 * kl[False]


def test_keys_in_5_bits_values_in_3_beat_4_bits_at_the_same_bytes(smollm, answer_tokens):
    """The keys carry the error of 4-bit storage: a bit moved from the values to the keys lowers it."""
    model, tokens = smollm[0], answer_tokens
    kl, nbytes = {}, {}
    for bits in (4, (5, 3)):  # as `mlxevict eval` runs them: the newest 32 tokens in 8 bits
        caches = make_cache(model, "default", budget=512, kv_bits=bits, window_bits=8)
        kl[bits] = mean_kl_to_full(model, tokens, caches)
        nbytes[bits] = mlxevict.cache_stats(caches).nbytes
    assert nbytes[4] == nbytes[(5, 3)] and kl[(5, 3)] < 0.9 * kl[4]  # measured: 0.0070 vs 0.0088
