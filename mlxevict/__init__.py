"""Entropy-guided KV-cache eviction for mlx-lm models.

    from mlx_lm import load, generate
    import mlxevict

    model, tokenizer = load("mlx-community/DeepSeek-R1-Distill-Qwen-1.5B-4bit")
    cache = mlxevict.make_cache(model, policy="entropy", budget=1024)
    generate(model, tokenizer, prompt, prompt_cache=cache, max_tokens=4096)
    print(mlxevict.cache_stats(cache))
"""

import mlx_lm.models.cache as _mlx_lm_cache

from .cache import DEFAULT_BUDGET, EvictingKVCache
from .load import load_cache
from .make import make_cache, pin
from .patch import SUPPORTED_ARCHITECTURES, patch, patched, unpatch
from .policies import DEFAULT_POLICY, Policy, policy_names
from .quantized import QuantizedEvictingKVCache
from .stats import CacheStats, cache_stats
from .kvstorage import KVStorage
from .plan import CachePlan, plan_cache

__version__ = "0.1.0"

# mlx-lm's load_prompt_cache rebuilds caches by class name from its own module.
_mlx_lm_cache.EvictingKVCache = EvictingKVCache
_mlx_lm_cache.QuantizedEvictingKVCache = QuantizedEvictingKVCache

__all__ = [
    "make_cache",
    "cache_stats",
    "CacheStats",
    "EvictingKVCache",
    "QuantizedEvictingKVCache",
    "Policy",
    "policy_names",
    "pin",
    "patch",
    "patched",
    "unpatch",
    "load_cache",
    "DEFAULT_BUDGET",
    "DEFAULT_POLICY",
    "SUPPORTED_ARCHITECTURES",
    "KVStorage",
    "CachePlan",
    "plan_cache",
]
