"""Convert a GGUF file into an MLX model folder that ``mlx_lm.load`` opens.

The files are built in a temporary folder (next to a new OUT_DIR, inside an existing
one) and moved into place at the end, so an interrupted or failed conversion never
leaves a half-written model where a finished one is expected. The last file written
is a marker, :data:`MARKER`: ``force`` replaces only a folder that holds one and
nothing but what a conversion writes, so it never deletes a user's own files.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxevict.errors import MlxEvictError, os_error

from .gguf import GGUFFile, check_tensor_types, read_gguf
from .quants import BITS, FLOAT_TYPES, GROUP_SIZE, mlx_bits, precision_note, to_mlx
from .tokenizer import write_tokenizer
from .weights import ROPE_FREQS_TENSOR, check_architecture, make_config, mlx_module, quantization_config

DTYPES: dict[str, mx.Dtype] = {"float16": mx.float16, "float32": mx.float32}
SHARD_BYTES = 2 * 1024**3  # one safetensors file per ~2 GiB of weights
MARKER = ".mlxevict-conversion.json"
PARTIAL_PREFIX = ".mlxevict-partial-"
# What a conversion writes into OUT_DIR; --force deletes nothing else.
OUTPUT_PATTERNS = (
    "config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors",
    "model.safetensors.index.json", "model-*-of-*.safetensors", MARKER, f"{PARTIAL_PREFIX}*",
)  # fmt: skip

Progress = Callable[[int, int], None]
Report = Callable[[str], None]


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
    report: Report | None = None,
    marker: dict | None = None,
    fix: str = "choose another OUT_DIR",
) -> Path:
    """Convert a llama or qwen2 GGUF file into an MLX model folder.

    Writes ``config.json``, ``model.safetensors`` (or numbered shards with an index),
    ``tokenizer.json``, ``tokenizer_config.json`` and the marker :data:`MARKER`.

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: destination folder; must be missing or empty unless ``force``.
        dtype: None keeps quantized tensors quantized (MLX affine, group size 32; see
            quants.py for which types are exact) and F16/BF16/F32 as stored;
            ``"float16"`` or ``"float32"`` dequantizes and casts every tensor.
        force: replace an earlier conversion in ``out_dir`` (a folder with the marker
            and only the files a conversion writes); anything else is refused.
        progress: called as ``progress(bytes_done, bytes_total)`` after each tensor.
        report: called with one line per note worth telling (re-quantized tensor types).
        marker: extra entries for the marker file (the conversion cache keys on them).
        fix: what to tell the user to do when the disk is full or not writable.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        MlxEvictError: unreadable or unsupported GGUF, bad dtype, an ``out_dir`` that
            is not empty (without ``force``) or not an earlier conversion (with it), or
            a file-system fault (full disk, read-only folder), with nothing left behind.
    """
    if dtype is not None and dtype not in DTYPES:
        raise MlxEvictError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)} or None")
    gguf = read_gguf(gguf_path)
    check_architecture(gguf)
    check_tensor_types(gguf)
    # Everything that can be refused is checked before the first tensor is decoded.
    module_bits = _quantized_modules(gguf)
    config = make_config(gguf, None if dtype else quantization_config(module_bits))
    notes = precision_notes(gguf, dtype)
    out = Path(os.path.abspath(out_dir))  # "." has no name to build a sibling from
    old = _check_out_dir(out, gguf.path, force)
    try:
        tmp = _make_build_folder(out)
    except OSError as err:
        err.filename = None  # name OUT_DIR, not the temporary folder that could not be made
        raise os_error(err, out, fix) from None
    try:
        for note in notes if report else ():
            report(note)
        write_tokenizer(gguf, tmp)
        _write_weights(gguf, tmp, DTYPES.get(dtype), progress)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        info = {"source": gguf.path.name, "dtype": dtype, "notes": notes, **(marker or {})}
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        _move_into_place(tmp, out, old)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if err.filename and Path(err.filename).parent == tmp:  # the build folder is gone: name the destination
            name = Path(err.filename).name
            err.filename = str(out / ("model.safetensors" if name.startswith("shard-") else name))
        raise os_error(err, out, fix) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Path(out_dir)


def output_nbytes(gguf: GGUFFile, dtype: str | None = None) -> int:
    """Bytes of the safetensors a conversion writes (quantized: packed values + float16 scales and biases)."""
    total = 0
    for info in gguf.tensors.values():
        if info.name == ROPE_FREQS_TENSOR:
            continue
        n = max(1, int(np.prod(info.shape, dtype=np.int64)))
        bits = mlx_bits(info.type_name)
        if dtype is not None:
            total += n * DTYPES[dtype].size
        elif bits is not None and info.name.endswith(".weight"):
            total += n * bits // 8 + 2 * 2 * (n // GROUP_SIZE)
        elif bits is not None:
            total += 4 * n  # a quantized bias is dequantized to float32
        else:
            total += info.nbytes
    return total


def precision_notes(gguf: GGUFFile, dtype: str | None) -> list[str]:
    """One line per tensor type that does not keep its exact values: which, how many, and how it is kept."""
    if dtype is not None:
        return []
    counts = Counter(t.type_name for t in gguf.tensors.values())
    notes = []
    for type_name, n in sorted(counts.items()):
        if type_name not in FLOAT_TYPES and type_name not in BITS:
            notes.append(f"{n} {type_name} tensor{'s' if n != 1 else ''} {precision_note(type_name)}")
    return notes


def is_conversion(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion (the marker) and nothing a conversion does not write."""
    return (folder / MARKER).is_file() and not _foreign_entries(folder)


def _foreign_entries(folder: Path) -> list[str]:
    return sorted(
        p.name for p in folder.iterdir() if not any(fnmatch.fnmatchcase(p.name, pat) for pat in OUTPUT_PATTERNS)
    )


def _check_out_dir(out: Path, gguf_path: Path, force: bool) -> list[Path]:
    """Refuse an OUT_DIR we may not write; return the files of an earlier conversion to replace."""
    for folder in (out, *out.parents):
        if folder.exists():
            if not folder.is_dir():
                where = "exists and is not a folder" if folder == out else f"is inside {folder}, which is a file"
                raise MlxEvictError(f"{out} {where}; choose another OUT_DIR")
            break
    if not out.is_dir() or not any(out.iterdir()):
        return []
    if not force:
        raise MlxEvictError(
            f"{out} is not empty; choose another OUT_DIR, or pass --force (force=True) to replace an earlier conversion"
        )
    if out.resolve() in gguf_path.resolve().parents:
        raise MlxEvictError(f"{out} holds the GGUF file itself; --force would delete it, choose another OUT_DIR")
    foreign = _foreign_entries(out)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise MlxEvictError(
            f"{out} holds {foreign[0]!r}{more}, which no conversion wrote; --force replaces only an earlier "
            "conversion and deletes nothing else: move those files or choose another OUT_DIR"
        )
    if not (out / MARKER).is_file():
        raise MlxEvictError(
            f"{out} is not an earlier mlxevict conversion (no {MARKER}); --force replaces only those: "
            "choose another OUT_DIR"
        )
    return sorted(out.iterdir())


def _make_build_folder(out: Path) -> Path:
    """A private folder on OUT_DIR's file system: inside OUT_DIR when it exists, else next to it."""
    if out.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=out))
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is an ordinary folder
    return tmp


def _quantized_modules(gguf: GGUFFile) -> dict[str, int]:
    """mlx-lm module path -> bits, for every weight that stays quantized (also checks every name maps)."""
    modules = {}
    for info in gguf.tensors.values():
        if info.name == ROPE_FREQS_TENSOR:
            continue
        module, param = mlx_module(info.name)
        bits = mlx_bits(info.type_name)
        if bits is not None and param == "weight":
            modules[module] = bits
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
        # Through a Python file, so a full disk is an OSError naming ENOSPC (MLX's own
        # writer says only "Unable to write N bytes").
        try:
            with open(path, "wb") as fh:
                mx.save_safetensors(fh, self.pending, metadata={"format": "mlx"})
        except OSError as err:
            raise OSError(err.errno, err.strerror, str(path)) from None
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


def _move_into_place(tmp: Path, out: Path, old: list[Path]) -> None:
    """Publish the finished build at ``out``, replacing the earlier conversion's files ``old``.

    A new OUT_DIR is one atomic rename. An existing one keeps its inode (it may be the
    shell's working folder): the old files go, the new ones are renamed in, marker last.
    """
    if not out.exists():
        os.replace(tmp, out)
        return
    for path in old:
        if path == tmp:
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    for path in sorted(tmp.iterdir(), key=lambda p: p.name == MARKER):
        os.replace(path, out / path.name)
    tmp.rmdir()
