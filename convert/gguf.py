"""Read a GGUF file's header: metadata, tensor names, types, shapes and where their bytes lie.

Parsing the header ourselves (rather than trusting ``mx.load``) lets us refuse a
non-GGUF, truncated or unsupported file with one clear line before touching any
tensor data; ``mx.load`` silently casts unknown quantizations to float16.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from mlxevict.errors import MlxEvictError

from .quants import BITS, FLOAT_TYPES, KQUANT_BITS, REQUANT_BITS

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# ggml type id -> name, for every type a GGUF may hold (names appear in errors).
GGML_TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip

# Every ggml type's block: name -> (elements per block, bytes per block), as the gguf package's
# GGML_QUANT_SIZES gives them (copied so reading a header does not import it).
BLOCK_LAYOUT: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "F64": (1, 8),
    "I8": (1, 1), "I16": (1, 2), "I32": (1, 4), "I64": (1, 8),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34), "Q8_1": (32, 40),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "Q8_K": (256, 292), "IQ2_XXS": (256, 66), "IQ2_XS": (256, 74), "IQ2_S": (256, 82), "IQ3_XXS": (256, 98),
    "IQ3_S": (256, 110), "IQ1_S": (256, 50), "IQ1_M": (256, 56), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
    "TQ1_0": (256, 54), "TQ2_0": (256, 66), "MXFP4": (32, 17),
}  # fmt: skip
# The types the converter reads (see quants.py for how each is kept); the rest are refused.
SUPPORTED_TYPES = (*FLOAT_TYPES, *BITS, *KQUANT_BITS, *REQUANT_BITS)

# GGUF metadata value types: id -> struct format of a scalar (8 = string, 9 = array).
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file.

    Attributes:
        name: GGUF tensor name, e.g. ``blk.0.attn_q.weight``.
        shape: numpy order (outermost first); GGUF stores it innermost first.
        type_name: ggml type, e.g. ``Q4_1``.
        offset: absolute byte offset of the data in the file.
        nbytes: size of the data in bytes.
    """

    name: str
    shape: tuple[int, ...]
    type_name: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF header; tensor data stays on disk.

    Attributes:
        path: the file.
        version: GGUF format version (2 or 3).
        metadata: key -> str, int, float, bool or list (numeric arrays as numpy arrays).
        tensors: name -> TensorInfo, in file order.
        data_offset: where tensor data starts; the bytes before are the header.
    """

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int = 0

    @property
    def architecture(self) -> str:
        """``general.architecture``, e.g. ``llama``."""
        return str(self.require("general.architecture"))

    def require(self, key: str) -> Any:
        """The metadata value for ``key``; a clear error if the file lacks it."""
        if key not in self.metadata:
            raise MlxEvictError(f"{self.path}: GGUF metadata has no {key!r}; the file is incomplete")
        return self.metadata[key]

    def read_tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The raw bytes of one tensor as a read-only uint8 array (memory-mapped)."""
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))


class _Reader:
    """Sequential little-endian reads that report a short file as truncation."""

    def __init__(self, fh: BinaryIO, path: Path, size: int):
        self.fh, self.path, self.size = fh, path, size

    def take(self, n: int) -> bytes:
        # Check before reading: a corrupt length could ask for exabytes.
        if n > self.size - self.fh.tell():
            raise MlxEvictError(f"{self.path}: GGUF file is truncated (header ends early)")
        data = self.fh.read(n)
        if len(data) != n:
            raise MlxEvictError(f"{self.path}: GGUF file is truncated (header ends early)")
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("<Q"))
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _SCALAR_FORMATS:
                # Numeric arrays (token types, scores) can be large: read them in one go.
                dtype = np.dtype(_SCALAR_FORMATS[etype])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
            return [self.value(etype) for _ in range(count)]
        raise MlxEvictError(f"{self.path}: unknown GGUF metadata value type {vtype}; the file is corrupt")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse and validate the header of a GGUF file.

    Checks the magic, the version, that every tensor's data lies inside the file,
    and nothing else: whether the architecture and tensor types are convertible is
    the caller's question (see ``check_tensor_types``).

    Args:
        path: the ``.gguf`` file.

    Returns:
        The parsed header.

    Raises:
        MlxEvictError: missing, non-GGUF, unsupported version or truncated file.
    """
    path = Path(path)
    if not path.is_file():
        raise MlxEvictError(f"{path}: no such file")
    size = path.stat().st_size
    with path.open("rb") as fh:
        reader = _Reader(fh, path, size)
        magic = fh.read(4)
        if magic != GGUF_MAGIC:
            raise MlxEvictError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        version = reader.scalar("<I")
        if version not in SUPPORTED_VERSIONS:
            raise MlxEvictError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
        n_tensors, n_kv = reader.scalar("<Q"), reader.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = reader.string()
            metadata[key] = reader.value(reader.scalar("<I"))
        raw_tensors = []
        for _ in range(n_tensors):
            name = reader.string()
            ndim = reader.scalar("<I")
            dims = [reader.scalar("<Q") for _ in range(ndim)]
            type_id, rel_offset = reader.scalar("<I"), reader.scalar("<Q")
            raw_tensors.append((name, tuple(reversed(dims)), type_id, rel_offset))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise MlxEvictError(f"{path}: general.alignment={alignment!r} is invalid; the file is corrupt")
        data_start = -(-fh.tell() // alignment) * alignment

    tensors: dict[str, TensorInfo] = {}
    for name, shape, type_id, rel_offset in raw_tensors:
        type_name = GGML_TYPE_NAMES.get(type_id, f"type {type_id}")
        nbytes = _tensor_nbytes(shape, type_name)
        offset = data_start + rel_offset
        if nbytes is not None and offset + nbytes > size:
            raise MlxEvictError(
                f"{path}: GGUF file is truncated (tensor {name!r} needs bytes up to "
                f"{offset + nbytes}, the file has {size})"
            )
        tensors[name] = TensorInfo(name, shape, type_name, offset, nbytes or 0)
    return GGUFFile(path, version, metadata, tensors, data_start)


def _tensor_nbytes(shape: tuple[int, ...], type_name: str) -> int | None:
    """Bytes of a tensor; None for a type of unknown layout (refused later by ``check_tensor_types``)."""
    if type_name not in BLOCK_LAYOUT:
        return None
    block, block_bytes = BLOCK_LAYOUT[type_name]
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return -(-n // block) * block_bytes


def check_tensor_types(gguf: GGUFFile) -> None:
    """Refuse a file holding a tensor type the converter cannot map, naming it.

    Raises:
        MlxEvictError: names the unsupported types, how many tensors use them,
            and the supported types.
    """
    bad = [t for t in gguf.tensors.values() if t.type_name not in SUPPORTED_TYPES]
    if bad:
        kinds = sorted({t.type_name for t in bad})
        count = f"{len(bad)} tensor{'s' if len(bad) != 1 else ''}"
        raise MlxEvictError(
            f"{gguf.path}: tensor type {', '.join(kinds)} is not supported ({count}, e.g. {bad[0].name!r}); "
            f"supported: {', '.join(SUPPORTED_TYPES)}; use a GGUF of this model in one of those"
        )
