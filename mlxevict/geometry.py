"""Model geometry: what one token of a model costs in KV memory, read from a loaded model, a config or a folder.

:func:`kv_shape` reads layers, kv-heads, head dim and the activation type from a
loaded mlx-lm model, its ``ModelArgs``, a ``config.json`` dict or a model folder
(without loading weights); :class:`KVShape` turns that and a
:class:`~mlxevict.kvstorage.KVStorage` into bytes per token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from .errors import MlxEvictError
from .kvstorage import DEFAULT_GROUP_SIZE, DTYPE, KVBits, KVStorage

_DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_SAFETENSORS_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}


@dataclass(frozen=True)
class KVShape:
    """What one token costs in KV memory: ``layers × kv_heads × head_dim × 2 × dtype_size``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_size: int

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_size

    def storage_bytes(self, storage: KVStorage = DTYPE) -> int:
        """Bytes per token, all layers, in ``storage`` (a quantized cache's window: :meth:`window_bytes`)."""
        groups = storage.layer_groups(self.layers)  # layers in 8 bits apart
        return self.kv_heads * sum(n * s.bytes_per_token(self.head_dim, self.dtype_size) for n, s in groups)

    def fixed_bytes(self, storage: KVStorage = DTYPE) -> int:
        """Bytes, all layers, that ``storage`` holds whatever its tokens (a table's reserved rows)."""
        return self.layers * self.kv_heads * storage.fixed_bytes(self.head_dim, self.dtype_size)

    def window_bytes(self, storage: KVStorage = DTYPE) -> Optional[int]:
        """Bytes per token of a quantized cache's recent window; ``None`` when the window costs what any token does."""
        window = storage.window_bytes_per_token(self.head_dim, self.dtype_size)
        return None if window is None else self.layers * self.kv_heads * window

    def storage_bytes_per_token(self, kv_bits: Optional[KVBits] = None, group_size: int = DEFAULT_GROUP_SIZE) -> int:
        """Bytes per token with keys and values stored in ``kv_bits`` (``None``: the dtype)."""
        return self.storage_bytes(KVStorage.of(kv_bits, group_size if kv_bits else None))


def read_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a model folder, as a dict."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise MlxEvictError(f"{file} not found: not an MLX model folder") from None
    except json.JSONDecodeError as err:
        raise MlxEvictError(f"{file} is not valid JSON ({err})") from None


def weights_nbytes(path: str | Path) -> int:
    """Bytes of a model folder's ``*.safetensors`` files."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def _safetensors_dtypes(path: Path) -> dict[str, str]:
    """Tensor name → safetensors dtype (``"F32"``, ``"BF16"``...) from the first file's header."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return {}
    with open(files[0], "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {name: meta["dtype"] for name, meta in header.items() if isinstance(meta, dict) and "dtype" in meta}


def folder_dtype_size(path: str | Path) -> Optional[int]:
    """Bytes per activation of a model folder, read from its weights' float type (``None``: no weights)."""
    dtypes = _safetensors_dtypes(Path(path))
    floats = [d for name, d in dtypes.items() if d in _SAFETENSORS_SIZES and ("scales" in name or "embed" in name)]
    floats = floats or [d for d in dtypes.values() if d in _SAFETENSORS_SIZES]
    return _SAFETENSORS_SIZES[floats[0]] if floats else None


def config_dtype_size(config: Mapping[str, Any]) -> int:
    """Bytes per KV element from a config's ``torch_dtype`` (float16 when absent)."""
    name = str(config.get("torch_dtype") or config.get("dtype") or "float16").replace("torch.", "")
    if name not in _DTYPE_SIZES:
        raise MlxEvictError(f"unknown dtype {name!r} in the model config; expected one of {sorted(_DTYPE_SIZES)}")
    return _DTYPE_SIZES[name]


def model_dtype(model: Any) -> Any:
    """The float type (``mx.Dtype``) a loaded model computes in (its embedding's, or its scales' when quantized)."""
    embed = model.model.embed_tokens if hasattr(model, "model") else model.embed_tokens
    return getattr(embed, "scales", embed.weight).dtype


def _config(model_or_config: Any) -> Mapping[str, Any]:
    config = model_or_config
    if isinstance(config, (str, Path)):
        config = read_config(config)
    elif hasattr(config, "args") and hasattr(config, "layers"):
        config = config.args
    return config if isinstance(config, Mapping) else vars(config)


def head_share(model: Any) -> int:
    """How many ranks the model's heads are split over: 1 unless ``model.shard()`` ran.

    ``shard()`` divides each attention's ``n_kv_heads`` by the group size and
    leaves ``model.args`` as the checkpoint says, so the ratio is the share.
    """
    attention = model.layers[0].self_attn
    total = getattr(model.args, "num_key_value_heads", None) or model.args.num_attention_heads
    return max(1, total // attention.n_kv_heads)


def kv_shape(model_or_config: Any, dtype_size: Optional[int] = None) -> KVShape:
    """The KV geometry of a loaded mlx-lm model, its ``ModelArgs``, a config dict or a model folder.

    A loaded model sharded over ``N`` ranks (``model.shard()``) counts this rank's
    ``1/N`` of the KV heads. The KV cache is stored in the type the model computes in: a loaded model's
    embedding (or quantization scales) type, a folder's weights type, else the
    config's ``torch_dtype``.

    Args:
        model_or_config: an ``nn.Module`` with ``args``, a ``ModelArgs``, a
            ``config.json`` dict, or a path to a model folder.
        dtype_size: bytes per element, overriding what is read.

    Returns:
        A :class:`KVShape`.
    """
    share = 1
    if isinstance(model_or_config, (str, Path)):
        dtype_size = dtype_size or folder_dtype_size(model_or_config)
    elif hasattr(model_or_config, "args") and hasattr(model_or_config, "layers"):
        dtype_size = dtype_size or model_dtype(model_or_config).size
        share = head_share(model_or_config)  # a sharded model (mlx.launch) holds its block of the KV heads
    config = _config(model_or_config)
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError):
        raise MlxEvictError("the model config lacks num_hidden_layers, num_attention_heads or hidden_size") from None
    kv_heads = int(config.get("num_key_value_heads") or heads) // share
    return KVShape(layers, kv_heads, head_dim, dtype_size or config_dtype_size(config))


def model_head_dim(model: Any) -> int:
    """The attention head dim of an mlx-lm model (or its ``ModelArgs`` or config)."""
    config = _config(model)
    return int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))


def context_limit(model_or_config: Any) -> Optional[int]:
    """The model's context length (``max_position_embeddings``), or ``None`` when it does not say."""
    try:
        limit = _config(model_or_config).get("max_position_embeddings")
    except (TypeError, MlxEvictError):
        return None
    return int(limit) if limit else None


def kv_bytes_per_token(
    model_or_config: Any,
    dtype_size: Optional[int] = None,
    *,
    kv_bits: Optional[KVBits] = None,
    kv_group_size: int = DEFAULT_GROUP_SIZE,
) -> int:
    """KV bytes one token costs: ``layers × kv_heads × head_dim × 2 × dtype_size``.

    Args:
        model_or_config, dtype_size: see :func:`kv_shape`.
        kv_bits, kv_group_size: quantized storage (see :meth:`KVShape.storage_bytes_per_token`).
    """
    return kv_shape(model_or_config, dtype_size).storage_bytes_per_token(kv_bits, kv_group_size)
