"""Entropy-guided KV-cache eviction for mlx-lm models.

    from mlx_lm import load, generate
    import mlxevict

    model, tokenizer = load("mlx-community/DeepSeek-R1-Distill-Qwen-1.5B-4bit")
    cache = mlxevict.make_cache(model, policy="entropy", budget=1024)
    generate(model, tokenizer, prompt, prompt_cache=cache, max_tokens=4096)
    print(mlxevict.cache_stats(cache))

The names below load on first use, so ``import mlxevict`` (and the command
line's ``--help``) does not import MLX or mlx-lm; mlx-lm's ``load_prompt_cache``
still finds the cache classes (see :mod:`mlxevict.register`).
"""

from importlib import import_module
from typing import Any

from .register import register_when_imported

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "make_cache": ".make",
    "pin": ".make",
    "cache_stats": ".stats",
    "CacheStats": ".stats",
    "EvictingKVCache": ".cache",
    "QuantizedEvictingKVCache": ".quantized",
    "Policy": ".policies",
    "policy_names": ".policies",
    "patch": ".model_patch",
    "patched": ".model_patch",
    "unpatch": ".model_patch",
    "DEFAULT_BUDGET": ".cache",
    "DEFAULT_POLICY": ".policies",
    "SUPPORTED_ARCHITECTURES": ".model_patch",
    "load_cache": ".load",
    "KVStorage": ".kvstorage",
    "CachePlan": ".plan",
    "plan_cache": ".plan",
}

__all__ = list(_EXPORTS)

register_when_imported()


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mlxevict' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
