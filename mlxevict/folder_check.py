"""Checks of a model folder before ``mlx_lm.load``: whole weights and a tokenizer, or one line naming the file.

A truncated ``model.safetensors`` (an interrupted download) makes MLX raise
``RuntimeError [load_safetensors]`` without naming the file, and a missing tokenizer
makes transformers ask for sentencepiece or tiktoken; both are caught here first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from .errors import MlxEvictError

if TYPE_CHECKING:
    from .resolve import Resolved

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")


def redo_hint(resolved: "Resolved") -> str:
    """How to get a whole model folder again, for where it came from."""
    if resolved.source in ("hub", "family"):
        return f"download it again with `hf download {resolved.name} --force-download`"
    if resolved.source == "gguf":
        return f"delete the cached conversion with `mlxevict cache remove {resolved.path.name}` and run again"
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
            f"{path} has no tokenizer file ({' or '.join(TOKENIZER_FILES[:2])}); copy it from the model's "
            f"original folder, or {redo_hint(resolved)}"
        )
