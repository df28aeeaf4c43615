"""Tiny random-weight mlx-lm models in memory, for fast cache and attention tests (folders: model_files.py)."""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
import pytest

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
VOCAB = 128
# Chunks of queries on the CPU read quantized entries dequantized, through BLAS: within 2e-6 of
# mlx-lm's quantized matmul, except qwen3 at 8 bits: 8.7e-5, and the same between mlx-lm's own
# attention and its dense twin (tests/test_baseline_attention.py): the dense read, not the storage.
# Token by token (one query: the quantized matmul) the storage equals mlx-lm's exactly.
QWEN3_8BIT_GAP = pytest.mark.xfail(
    strict=True, reason="qwen3 at 8 bits: dense and quantized matmuls differ by 8.7e-5 (others 2e-6)"
)


def tiny_model(model_type: str = "llama", *, layers: int = 2, seed: int = 0, **overrides) -> nn.Module:
    """A randomly initialised mlx-lm model (GQA: 4 query heads, 2 kv-heads, head_dim 16)."""
    module = importlib.import_module(f"mlx_lm.models.{'llama' if model_type == 'mistral' else model_type}")
    config = dict(
        model_type=model_type,
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    config.update(overrides)
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = module.Model(args)
    mx.eval(model.parameters())
    return model


def random_tokens(n: int, seed: int = 1) -> mx.array:
    return mx.random.randint(0, VOCAB, (n,), key=mx.random.key(seed))


def run_chunks(model: nn.Module, cache, tokens: mx.array, chunks: list[int], after=None) -> mx.array:
    """Feed ``tokens`` in the given chunk sizes; return the logits of every position.

    ``after``: called with the number of tokens fed so far after each chunk (to check invariants).
    """
    out, start = [], 0
    for size in chunks:
        out.append(model(tokens[None, start : start + size], cache=cache))
        start += size
        if after is not None:
            after(start)
    return mx.concatenate(out, axis=1)
