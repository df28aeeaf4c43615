"""GGUF → MLX model folders (installed as ``mlxevict.convert``)."""

from .convert import convert_gguf
from .gguf import SUPPORTED_TYPES
from .weights import SUPPORTED_ARCHITECTURES

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_TYPES", "convert_gguf"]
