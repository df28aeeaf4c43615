"""Patching an mlx-lm model so its attention feeds the evicting caches.

mlx-lm's attention hands the cache only keys and values, but eviction needs the
queries. Model files import ``scaled_dot_product_attention`` by name, so the
patch replaces that name in the model's own module with a function that calls
the original and then shows the queries to any :class:`EvictingKVCache`
(for quantized storage, the cache's storage component runs
:func:`mlxevict.quantized_attention.quantized_attention` instead of the original).
The model's class is swapped for a subclass whose ``__call__`` splits long
prompts into chunks the budget can hold and feeds the prediction entropy
``H(p_t)`` to the caches. Nothing happens at import; :func:`unpatch` (or leaving
the :func:`patched` context) restores both.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn

from .cache import EvictingKVCache
from .kernels import prediction_entropy_compiled
from .room import STATS_CHUNK

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# A policy fed H(p_t) needs every position's logits (B, S, vocab: more bytes a token than the
# whole KV of a small model): small chunks bound them, computed apart from the logits returned.
ENTROPY_CHUNK = 16
_ORIGINAL_SDPA = "_mlxevict_original_sdpa"
# A module's attention is restored when no live model of it is patched any more.
_patched_per_module: dict[str, weakref.WeakValueDictionary] = {}  # id(model) -> model


def check_supported(model: nn.Module) -> None:
    """Raise a ``ValueError`` naming the architecture if mlxevict cannot drive it."""
    model_type = getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {model_type!r} is not supported by mlxevict; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    args = model.args
    layer_types = getattr(args, "layer_types", None) or []
    sliding = any(t != "full_attention" for t in layer_types) or getattr(args, "use_sliding_window", False)
    if sliding:
        raise ValueError(
            f"this {model_type} model has sliding-window attention layers, which mlxevict does not evict; "
            "use mlx-lm's own cache for it"
        )


def _evicting_sdpa(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if not isinstance(cache, EvictingKVCache):
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        # The storage reads its own entries (quantized), or leaves them to the model's attention.
        output = cache.storage.attend(queries, keys, values, scale, mask, sinks)
        if output is None:
            output = original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        cache.observe(queries, scale)
        return output

    setattr(scaled_dot_product_attention, _ORIGINAL_SDPA, original)
    return scaled_dot_product_attention


def _evicting_caches(cache: Any) -> list[EvictingKVCache]:
    if not cache:
        return []
    return [c for c in cache if isinstance(c, EvictingKVCache)]


def _head(model: nn.Module, hidden: mx.array) -> mx.array:
    """The model's output layer over ``(B, S, hidden)``: what llama, mistral, qwen2 and qwen3 apply."""
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)


def _chunked_call(self, inputs: mx.array, cache=None, **kwargs):
    """Run the model in chunks the caches can hold; feed ``H(p_t)`` where wanted."""
    base_call = super(type(self), self).__call__
    caches = _evicting_caches(cache)
    if not caches:
        return base_call(inputs, cache=cache, **kwargs)
    for c in caches:
        c.model_patched = True
        c.feed_prompt(inputs.shape[1])
    wants_entropy = [c for c in caches if c.policy.uses_prediction_entropy]
    step = min(ENTROPY_CHUNK if wants_entropy else STATS_CHUNK, *(c.max_chunk for c in caches))
    embeddings = kwargs.pop("input_embeddings", None)
    length = inputs.shape[1]
    outputs = []
    for start in range(0, length, step):
        end = min(start + step, length)
        chunk_kwargs = dict(kwargs)
        if embeddings is not None:
            chunk_kwargs["input_embeddings"] = embeddings[:, start:end]
        if wants_entropy:
            hidden = self.model(inputs[:, start:end], cache, **chunk_kwargs)  # B, S, hidden
            entropy = prediction_entropy_compiled(_head(self, hidden))  # B, S
            for c in wants_entropy:
                c.feed_prediction_entropy(entropy)
                if end - start > 1:
                    c.flush(compute=True)  # a prompt chunk's logits are computed and freed now
            # What is returned is computed again only if read (generate_step reads the last token's):
            # holding the hidden states, not every position's logits.
            logits = _head(self, hidden)
        else:
            logits = base_call(inputs[:, start:end], cache=cache, **chunk_kwargs)
        outputs.append(logits)
        if end < length:
            # Evaluate the caches now so a long prompt never builds one huge graph.
            mx.eval([c.state[:4] for c in caches])
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=1)


def is_patched(model: nn.Module) -> bool:
    return getattr(type(model), "_mlxevict_base", None) is not None


def patch(model: nn.Module) -> nn.Module:
    """Make ``model``'s attention feed evicting caches. Idempotent; returns the model.

    Raises:
        ValueError: the architecture is not supported (named in the message).
    """
    check_supported(model)
    if is_patched(model):
        return model
    module = sys.modules[type(model).__module__]
    original = module.scaled_dot_product_attention
    if not hasattr(original, _ORIGINAL_SDPA):
        module.scaled_dot_product_attention = _evicting_sdpa(original)
    _patched_per_module.setdefault(module.__name__, weakref.WeakValueDictionary())[id(model)] = model
    base = type(model)
    model.__class__ = type(base.__name__, (base,), {"__call__": _chunked_call, "_mlxevict_base": base})
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch` for ``model`` (the module's attention is restored too)."""
    if not is_patched(model):
        return model
    base = type(model)._mlxevict_base
    model.__class__ = base
    module = sys.modules[base.__module__]
    still_patched = _patched_per_module[module.__name__]
    still_patched.pop(id(model), None)
    original = getattr(module.scaled_dot_product_attention, _ORIGINAL_SDPA, None)
    if original is not None and not still_patched:
        module.scaled_dot_product_attention = original
    return model


@contextmanager
def patched(model: nn.Module) -> Iterator[nn.Module]:
    """``with patched(model): ...`` patches for the block and restores in ``finally``."""
    was_patched = is_patched(model)
    patch(model)
    try:
        yield model
    finally:
        if not was_patched:
            unpatch(model)
