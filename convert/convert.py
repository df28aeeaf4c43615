"""Convert a GGUF file into an MLX model folder that ``mlx_lm.load`` opens.

The folder is built next to its destination under a temporary name and renamed
into place at the end, so an interrupted conversion never leaves a half-written
model where a finished one is expected.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from mlxevict.errors import MlxEvictError

from .gguf import GGUFFile, check_tensor_types, read_gguf
from .quants import BITS, to_mlx
from .tokenizer import write_tokenizer
from .weights import ROPE_FREQS_TENSOR, check_architecture, make_config, mlx_module, quantization_config

DTYPES: dict[str, mx.Dtype] = {"float16": mx.float16, "float32": mx.float32}
SHARD_BYTES = 2 * 1024**3  # one safetensors file per ~2 GiB of weights

Progress = Callable[[int, int], None]


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Convert a llama or qwen2 GGUF file into an MLX model folder.

    Writes ``config.json``, ``model.safetensors`` (or numbered shards with an index),
    ``tokenizer.json`` and ``tokenizer_config.json``.

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: destination folder; must be missing or empty unless ``force``.
        dtype: None keeps Q4_0/Q4_1/Q8_0 quantized (MLX affine, group size 32) and
            F16/BF16/F32 as stored; ``"float16"`` or ``"float32"`` dequantizes and
            casts every tensor.
        force: replace a non-empty ``out_dir``.
        progress: called as ``progress(bytes_done, bytes_total)`` after each tensor.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        MlxEvictError: unreadable or unsupported GGUF, bad dtype, or a non-empty
            ``out_dir`` without ``force``.
    """
    if dtype is not None and dtype not in DTYPES:
        raise MlxEvictError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)} or None")
    gguf = read_gguf(gguf_path)
    check_architecture(gguf)
    check_tensor_types(gguf)
    # Everything that can be refused is checked before the first tensor is decoded.
    module_bits = _quantized_modules(gguf)
    config = make_config(gguf, None if dtype else quantization_config(module_bits))
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, gguf.path, force)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is an ordinary folder
    try:
        write_tokenizer(gguf, tmp)
        _write_weights(gguf, tmp, DTYPES.get(dtype), progress)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _check_out_dir(out_dir: Path, gguf_path: Path, force: bool) -> None:
    """Refuse to overwrite a non-empty folder unless forced, and never the GGUF's own folder."""
    if out_dir.exists() and not out_dir.is_dir():
        raise MlxEvictError(f"{out_dir} exists and is not a folder; choose another OUT_DIR")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not force:
        raise MlxEvictError(f"{out_dir} is not empty; pass --force (force=True) to replace it")
    if out_dir.resolve() in gguf_path.resolve().parents:
        raise MlxEvictError(f"{out_dir} holds the GGUF file itself; --force would delete it, choose another OUT_DIR")


def _quantized_modules(gguf: GGUFFile) -> dict[str, int]:
    """mlx-lm module path -> bits, for every weight that stays quantized (also checks every name maps)."""
    modules = {}
    for info in gguf.tensors.values():
        if info.name == ROPE_FREQS_TENSOR:
            continue
        module, param = mlx_module(info.name)
        if info.type_name in BITS and param == "weight":
            modules[module] = BITS[info.type_name]
    return modules


def _write_weights(gguf: GGUFFile, out: Path, dtype: mx.Dtype | None, progress: Progress | None) -> None:
    """Decode every tensor and write the safetensors shards."""
    total = sum(t.nbytes for t in gguf.tensors.values())
    done = 0
    shards = _ShardWriter(out)
    for info in gguf.tensors.values():
        done += info.nbytes
        if info.name == ROPE_FREQS_TENSOR:
            continue  # becomes rope_scaling in config.json
        module, param = mlx_module(info.name)
        tensor = to_mlx(gguf.read_tensor_bytes(info), info.shape, info.type_name)
        if tensor.quantized and dtype is None and param == "weight":
            shards.add(f"{module}.weight", tensor.weight)
            shards.add(f"{module}.scales", tensor.scales)
            shards.add(f"{module}.biases", tensor.biases)
        elif tensor.quantized or dtype is not None:
            shards.add(f"{module}.{param}", tensor.dequantize(dtype or mx.float32))
        else:
            shards.add(f"{module}.{param}", tensor.weight)
        if progress is not None:
            progress(done, total)
    shards.close()


class _ShardWriter:
    """Collects arrays and writes ``model.safetensors``, or numbered shards plus an index when large."""

    def __init__(self, out: Path):
        self.out = out
        self.pending: dict[str, mx.array] = {}
        self.pending_bytes = 0
        self.files: list[Path] = []
        self.weight_map: dict[str, int] = {}

    def add(self, name: str, array: mx.array) -> None:
        mx.eval(array)  # bound the lazy graph to one tensor
        self.pending[name] = array
        self.weight_map[name] = len(self.files)
        self.pending_bytes += array.nbytes
        if self.pending_bytes >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        path = self.out / f"shard-{len(self.files):05d}.safetensors"
        mx.save_safetensors(str(path), self.pending, metadata={"format": "mlx"})
        self.files.append(path)
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        self._flush()
        if len(self.files) == 1:
            self.files[0].rename(self.out / "model.safetensors")
            return
        n = len(self.files)
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for path, name in zip(self.files, names, strict=True):
            path.rename(self.out / name)
        index = {"metadata": {}, "weight_map": {k: names[i] for k, i in sorted(self.weight_map.items())}}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished folder to ``out_dir``, replacing what is there (already checked)."""
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
    os.replace(out_dir, old / out_dir.name)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
