"""The evicting cache on the real SmolLM2-135M-Instruct test model (slow)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache, load_prompt_cache, save_prompt_cache

import mlxevict
from mlxevict import make_cache, policy_names

pytestmark = pytest.mark.slow

QUESTION = (
    "A farmer has 17 sheep. All but 9 run away. Then he buys twice as many as he has left. "
    "How many sheep does he have now? Think step by step."
)


@pytest.fixture(scope="module")
def smollm(smollm_path):
    model, tokenizer = load(str(smollm_path))
    messages = [{"role": "user", "content": QUESTION}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return model, tokenizer, mx.array(prompt)


def greedy(model, prompt: mx.array, cache, n: int) -> tuple[list[int], list[mx.array]]:
    tokens, logprobs = [], []
    for (token, lp), _ in zip(generate_step(prompt, model, prompt_cache=cache, max_tokens=n), range(n)):
        tokens.append(token)
        logprobs.append(lp)
    return tokens, logprobs


def teacher_forced(model, cache, prompt: mx.array, continuation: list[int]) -> mx.array:
    """Logits of the prompt (in two chunks) and of each continuation token fed one by one."""
    half = prompt.size // 2
    out = [model(prompt[None, :half], cache=cache), model(prompt[None, half:], cache=cache)]
    out += [model(mx.array([[t]]), cache=cache) for t in continuation]
    return mx.concatenate(out, axis=1)


def test_every_policy_equals_kvcache_when_budget_holds_everything(smollm):
    model, _, prompt = smollm
    continuation, _ = greedy(model, prompt, [KVCache() for _ in model.layers], 24)
    reference = teacher_forced(model, [KVCache() for _ in model.layers], prompt, continuation)
    for policy in policy_names():
        logits = teacher_forced(model, make_cache(model, policy, budget=256), prompt, continuation)
        diff = mx.abs(logits - reference).max().item()
        assert diff < 1e-3, f"{policy}: max |Δlogit| = {diff}"


def test_window_matches_rotating_kv_cache_over_300_tokens(smollm):
    model, _, prompt = smollm
    budget = 96  # the prompt fills most of it; generation evicts from the first steps on
    rotating = [RotatingKVCache(max_size=budget, keep=4) for _ in model.layers]
    expected, expected_lp = greedy(model, prompt, rotating, 300)
    ours = make_cache(model, "window", budget=budget, sinks=4, window=0, slack=0)
    got, got_lp = greedy(model, prompt, ours, 300)
    assert got == expected
    assert max(mx.abs(a - b).max().item() for a, b in zip(got_lp, expected_lp)) < 1e-3
    assert mlxevict.cache_stats(ours).evicted > 200


@pytest.mark.parametrize("policy", ["entropy", "uncertainty", "default"])
def test_saved_cache_continues_with_identical_tokens(smollm, policy, tmp_path):
    model, _, prompt = smollm
    caches = make_cache(model, policy, budget=64)
    first, _ = greedy(model, prompt, caches, 40)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    last = mx.array(first[-1:])
    again, _ = greedy(model, last, caches, 30)
    reloaded, _ = greedy(model, last, loaded, 30)
    assert reloaded == again


RELOAD = """
import json, sys
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache
import mlxevict

model_path, cache_path, last, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model, _ = load(model_path)
try:  # mlx-lm's own loader, then an unpatched model: refused with one clear line
    model(mx.array([[last]]), cache=load_prompt_cache(cache_path))
    refused = None
except ValueError as e:
    refused = str(e)
caches = mlxevict.load_cache(cache_path, model)
steps = generate_step(mx.array([last]), model, prompt_cache=caches, max_tokens=n)
print(json.dumps({"refused": refused, "tokens": [t for (t, _), _ in zip(steps, range(n))]}))
"""


def test_a_cache_saved_in_one_process_continues_identically_in_another(smollm, smollm_path, tmp_path):
    """Issue 17: save, then load and continue greedy generation in a fresh process."""
    import json
    import subprocess
    import sys

    from tiny_models import tiny_model

    model, _, prompt = smollm
    caches = make_cache(model, "default", budget=64)
    first, _ = greedy(model, prompt, caches, 40)
    path = tmp_path / "cache.safetensors"
    save_prompt_cache(str(path), caches)
    expected, _ = greedy(model, mx.array(first[-1:]), caches, 60)
    assert mlxevict.cache_stats(caches).evicted > 0
    run = subprocess.run(
        [sys.executable, "-c", RELOAD, str(smollm_path), str(path), str(first[-1]), "60"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert "mlxevict.patch(model)" in result["refused"]
    assert result["tokens"] == expected
    with pytest.raises(ValueError, match="made for another model"):
        mlxevict.load_cache(path, tiny_model("llama", layers=30, head_dim=32))
