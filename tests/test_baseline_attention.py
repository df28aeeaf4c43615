"""mlx-lm's quantized baselines with prompt chunks read dense on the CPU (benchmarks/baseline_attention.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.base as mlx_lm_base
import pytest
from mlx_lm.models.cache import QuantizedKVCache
from tiny_models import QWEN3_8BIT_GAP, random_tokens, run_chunks, tiny_model

from benchmarks.baseline_attention import dense_prompt_chunks

GROUP = 32  # head_dim 32: mx.quantize's smallest group


@pytest.mark.parametrize("bits", [8, 4, 3])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prompt_chunks_equal_mlx_lm_within_rounding_and_decoding_exactly(arch, bits, request):
    if arch == "qwen3" and bits == 8:
        request.applymarker(QWEN3_8BIT_GAP)
    model = tiny_model(arch, head_dim=GROUP)
    tokens = random_tokens(48)

    def run(chunks):
        return run_chunks(model, [QuantizedKVCache(GROUP, bits) for _ in model.layers], tokens, chunks)

    chunks, steps = [20, 12, 16], [1] * 48
    theirs, theirs_steps = run(chunks), run(steps)
    with dense_prompt_chunks():
        ours, ours_steps = run(chunks), run(steps)
    assert mx.allclose(ours, theirs, rtol=0, atol=1e-5).item()
    assert not mx.array_equal(ours, theirs).item()  # a different path: BLAS's sums, not the quantized matmul's
    assert mx.array_equal(ours_steps, theirs_steps).item()  # one query at a time: mlx-lm's own function


def test_the_swap_is_undone_after_the_block_even_on_an_error():
    original = mlx_lm_base.quantized_scaled_dot_product_attention
    with pytest.raises(KeyboardInterrupt):
        with dense_prompt_chunks():
            assert mlx_lm_base.quantized_scaled_dot_product_attention is not original
            raise KeyboardInterrupt
    assert mlx_lm_base.quantized_scaled_dot_product_attention is original
