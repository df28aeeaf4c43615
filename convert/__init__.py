"""GGUF → MLX model folders (installed as ``mlxevict.convert``)."""
