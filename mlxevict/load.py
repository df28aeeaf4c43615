"""``load_cache``: reload a saved evicting cache for the model it was made for, patched.

mlx-lm's ``save_prompt_cache`` saves mlxevict's caches as they are. Its
``load_prompt_cache`` rebuilds them by class name from mlx-lm's own module, where
``import mlxevict`` registers the names (without it: ``KeyError: 'EvictingKVCache'``);
the caches then refuse to run until a patched model drives them. ``load_cache``
does both steps and checks that the model is the kind the cache was made for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import load_prompt_cache

from .cache import EvictingKVCache
from .model_patch import patch
from .geometry import model_head_dim


def load_cache(path: str | Path, model: nn.Module, *, return_metadata: bool = False) -> Any:
    """Load a cache saved with ``mlx_lm.models.cache.save_prompt_cache`` and patch ``model`` for it.

    Args:
        path: the ``.safetensors`` file written by ``save_prompt_cache``.
        model: the mlx-lm model the cache was made for (patched here, see :func:`mlxevict.patch`).
        return_metadata: also return the metadata saved with the cache.

    Returns:
        The list of per-layer caches (and the metadata dict when ``return_metadata``).

    Raises:
        ValueError: the file is missing or not a saved prompt cache, or the cache's layers,
            kv-heads or head dims are not the model's (it was made for another model).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"saved cache {str(path)!r} does not exist; save one with mlx_lm's save_prompt_cache")
    try:
        caches, metadata = load_prompt_cache(str(path), return_metadata=True)
    except KeyError as e:
        raise ValueError(f"{str(path)!r} holds a cache class mlx-lm and mlxevict do not know: {e}") from None
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"{str(path)!r} is not a saved prompt cache ({e}); pass the file save_prompt_cache wrote") from None
    check_cache_fits(caches, model)
    patch(model)
    return (caches, metadata) if return_metadata else caches


def check_cache_fits(caches: list[Any], model: nn.Module) -> None:
    """Raise a ``ValueError`` unless ``caches`` have the model's layers, kv-heads and head dims."""
    layers = len(model.layers)
    if len(caches) != layers:
        raise ValueError(
            f"the saved cache has {len(caches)} layers but the model has {layers}: it was made for another "
            "model; load it with the model that made it, or build a new one with mlxevict.make_cache(model)"
        )
    args = model.args
    heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    head_dim = model_head_dim(model)
    for c in caches:
        if not isinstance(c, EvictingKVCache) or c.empty():
            continue
        _, H, D, Dv, _ = c.dense_shape
        if (H, D, Dv) != (heads, head_dim, head_dim):
            raise ValueError(
                f"the saved cache holds {H} kv-heads of dim {D} but the model has {heads} of dim {head_dim}: "
                "it was made for another model; load it with the model that made it"
            )
