"""Checks before ``mlx_lm.load``: whole weights, a tokenizer, and address space to load them into.

A truncated ``model.safetensors`` (an interrupted download) makes MLX raise
``RuntimeError [load_safetensors]`` without naming the file, and a missing tokenizer
makes transformers ask for sentencepiece or tiktoken; both are caught here first.

Under an address-space limit (``ulimit -v``) too small for the model, OpenBLAS retries
its 128 MiB per-thread buffer in ``blas_memory_alloc`` forever, ignoring Ctrl-C, and
MLX without OpenBLAS segfaults or fails to map its compiled kernels (docs/faults.md has
the measurements); so the limit is compared with what loading needs before loading.
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from .errors import MlxEvictError
from .openblas import openblas_loaded
from .geometry import weights_nbytes
from .memory import format_bytes

if TYPE_CHECKING:
    from .resolve import Resolved

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")


def redo_hint(resolved: "Resolved") -> str:
    """How to get a whole model folder again, for where it came from."""
    if resolved.source in ("hub", "family"):
        return f"download it again with `hf download {resolved.name} --force-download`"
    if resolved.source == "gguf":
        return f"delete the cached conversion with `mlxevict conversions remove {resolved.path.name}` and run again"
    if resolved.source == "demo":
        return f"delete {resolved.path} and run again to rebuild it"
    return "copy, download or convert the model again"


def _check_safetensors(file: Path) -> Optional[str]:
    """What is wrong with a safetensors file's size or header (``None``: it looks whole)."""
    size = file.stat().st_size
    with file.open("rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            return f"is truncated ({size:,} bytes, its header alone needs more)"
        try:
            header = json.loads(fh.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            return "is damaged (its header is not valid safetensors)"
    if 8 + n + end > size:
        return f"is truncated ({size:,} of {8 + n + end:,} bytes: an interrupted download or copy?)"
    return None


def check_files(resolved: "Resolved") -> None:
    """Refuse a model folder whose weights are damaged or whose tokenizer is missing, naming the file.

    Raises:
        MlxEvictError: names the file and how to get it whole again.
    """
    path = resolved.path
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise MlxEvictError(f"{path} holds no *.safetensors weights; {redo_hint(resolved)}")
    for file in weights:
        problem = _check_safetensors(file)
        if problem:
            raise MlxEvictError(f"{file} {problem}; {redo_hint(resolved)}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES) and not any(path.glob("*.tiktoken")):
        raise MlxEvictError(
            f"{path} has no tokenizer file ({' or '.join(TOKENIZER_FILES[:2])}): the model folder is incomplete; "
            f"{redo_hint(resolved)}"
        )


BLAS_BUFFER_NBYTES = 128 * 1024**2 + 4096  # OpenBLAS's per-thread buffer (seen in gdb: malloc in blas_memory_alloc)
ADDRESS_MARGIN_NBYTES = 512 * 1024**2  # MLX's compiled kernels, activations, the first KV steps


def address_space_needed(path: Path) -> int:
    """Bytes of address space loading and running ``path`` needs beyond what the process maps now (an estimate)."""
    threads = int(os.environ.get("OPENBLAS_NUM_THREADS") or os.cpu_count() or 1) if openblas_loaded() else 0
    return weights_nbytes(path) + (threads + 1) * BLAS_BUFFER_NBYTES + ADDRESS_MARGIN_NBYTES


def check_address_space(path: Path, name: str) -> None:
    """Refuse to load when ``ulimit -v`` leaves too little address space (rather than hang or crash).

    Raises:
        MlxEvictError: the limit, what the model needs, and how to raise it.
    """
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit == resource.RLIM_INFINITY:
        return
    import psutil

    mapped = psutil.Process().memory_info().vms
    need = mapped + address_space_needed(path)
    if need > limit:
        raise MlxEvictError(
            f"the address-space limit (ulimit -v {limit // 1024}) is {format_bytes(limit)}, below the about "
            f"{format_bytes(need)} loading {name} needs (weights, OpenBLAS buffers, MLX); under it OpenBLAS "
            "hangs and MLX crashes: raise it (ulimit -v unlimited) and cap memory with --budget instead"
        )
