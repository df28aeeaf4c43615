"""GGUF tensor names and hyper-parameters -> mlx-lm ``llama``/``qwen2`` names and ``config.json``.

RoPE order: llama.cpp's converter permutes a llama model's Q/K rows into the
interleaved (GPT-J) RoPE layout, so llama needs ``rope_traditional: true`` and the
weights are used as stored; qwen2 is stored un-permuted (NeoX layout) and keeps
``rope_traditional: false``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

import numpy as np

from mlxevict.errors import MlxEvictError

from .gguf import GGUFFile
from .quants import GROUP_SIZE, to_mlx

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# llama.cpp's llama3 RoPE scaling stores only per-frequency factors (``rope_freqs``);
# these are the defaults its converter (and Meta's configs) use for the other knobs.
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_CONTEXT = 8192
ROPE_FREQS_TENSOR = "rope_freqs.weight"

_GLOBAL_MODULES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_MODULES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def check_architecture(gguf: GGUFFile) -> str:
    """The architecture name, or a clear error naming an unsupported one."""
    arch = gguf.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise MlxEvictError(
            f"{gguf.path}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def mlx_module(gguf_name: str) -> tuple[str, str]:
    """Map a GGUF tensor name to its mlx-lm module path and parameter.

    Args:
        gguf_name: e.g. ``blk.3.attn_q.weight``.

    Returns:
        ``(module, param)``, e.g. ``("model.layers.3.self_attn.q_proj", "weight")``.

    Raises:
        MlxEvictError: the name has no mlx-lm equivalent.
    """
    if m := _BLOCK_RE.fullmatch(gguf_name):
        layer, part, param = m.groups()
        if part in _BLOCK_MODULES:
            return f"model.layers.{layer}.{_BLOCK_MODULES[part]}", param
    else:
        base, _, param = gguf_name.rpartition(".")
        if base in _GLOBAL_MODULES and param in ("weight", "bias"):
            return _GLOBAL_MODULES[base], param
    raise MlxEvictError(f"tensor {gguf_name!r} has no mlx-lm equivalent; this GGUF is not a plain llama/qwen2 model")


def quantization_config(module_bits: dict[str, int]) -> dict[str, Any] | None:
    """The ``quantization`` entry of config.json for the modules kept quantized.

    The most common bit width is the default; modules with another width (GGUF often
    keeps the embedding at 8 bits) get a per-module entry, which mlx-lm's loader honours.

    Args:
        module_bits: mlx-lm module path -> bits, for every quantized module.

    Returns:
        The dict, or None when nothing is quantized.
    """
    if not module_bits:
        return None
    default_bits = Counter(module_bits.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default_bits, "mode": "affine"}
    for module, bits in sorted(module_bits.items()):
        if bits != default_bits:
            config[module] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
    return config


def make_config(gguf: GGUFFile, quantization: dict[str, Any] | None) -> dict[str, Any]:
    """Build mlx-lm's ``config.json`` from the GGUF hyper-parameters.

    Args:
        gguf: the parsed file (architecture already checked).
        quantization: from ``quantization_config``, or None for a float model.

    Returns:
        The config dict.
    """
    arch = check_architecture(gguf)
    meta = gguf.metadata
    if "token_embd.weight" not in gguf.tensors:
        raise MlxEvictError(f"{gguf.path}: GGUF has no token_embd.weight tensor; the file is incomplete")

    def key(name: str) -> Any:
        return gguf.require(f"{arch}.{name}")

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", meta.get(f"{arch}.rope.dimension_count", hidden // heads)))
    if arch == "qwen2" and head_dim != hidden // heads:
        raise MlxEvictError(f"{gguf.path}: qwen2 with head_dim {head_dim} != hidden/heads is not supported by mlx-lm")
    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": [_HF_CLASSES[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_traditional": arch == "llama",
        "rope_scaling": _rope_scaling(gguf, arch, head_dim),
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": gguf.tensors["token_embd.weight"].shape[0],
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in gguf.tensors
    eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    if "tokenizer.ggml.bos_token_id" in meta:
        config["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    if eos:
        config["eos_token_id"] = eos[0] if len(set(eos)) == 1 else sorted(set(eos))
    if quantization is not None:
        config["quantization"] = quantization
    return config


def _rope_scaling(gguf: GGUFFile, arch: str, head_dim: int) -> dict[str, Any] | None:
    """mlx-lm's ``rope_scaling`` from the GGUF: linear, or llama3 recovered from ``rope_freqs``."""
    meta = gguf.metadata
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if ROPE_FREQS_TENSOR in gguf.tensors:
        return _llama3_scaling(gguf, arch, head_dim)
    if kind == "none":
        return None
    if kind == "linear":
        return {"type": "linear", "factor": _f32(gguf.require(f"{arch}.rope.scaling.factor"))}
    raise MlxEvictError(f"{gguf.path}: RoPE scaling {kind!r} is not supported (only linear and llama3)")


def _llama3_scaling(gguf: GGUFFile, arch: str, head_dim: int) -> dict[str, Any]:
    """Recover llama3 RoPE parameters from the ``rope_freqs`` factors, and check they reproduce them."""
    info = gguf.tensors[ROPE_FREQS_TENSOR]
    if info.type_name != "F32":
        raise MlxEvictError(f"{gguf.path}: {ROPE_FREQS_TENSOR} is {info.type_name}, expected F32")
    stored = np.array(to_mlx(gguf.read_tensor_bytes(info), info.shape, info.type_name).weight)
    original = int(gguf.metadata.get(f"{arch}.rope.scaling.original_context_length", LLAMA3_ORIGINAL_CONTEXT))
    scaling = {
        "rope_type": "llama3",
        "factor": float(stored.max()),
        "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
        "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": original,
    }
    base = float(gguf.metadata.get(f"{arch}.rope.freq_base", 10000.0))
    expected = llama3_rope_factors(base, head_dim, scaling)
    if expected.shape != stored.shape or not np.allclose(expected, stored, rtol=1e-4):
        raise MlxEvictError(
            f"{gguf.path}: {ROPE_FREQS_TENSOR} does not match llama3 RoPE scaling with factor "
            f"{scaling['factor']}, low/high frequency factors 1/4 and original context {original}"
        )
    return scaling


def llama3_rope_factors(base: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """The per-frequency wavelength multipliers of llama3 RoPE scaling, as llama.cpp stores them.

    Returns:
        float32 array of shape ``(head_dim // 2,)``.
    """
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _f32(value: Any) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))
