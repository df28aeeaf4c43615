"""The GGUF conversion cache: a ``.gguf`` given as MODEL is converted once into ``$MLXEVICT_CACHE/gguf``.

An entry is keyed on the file's content (its header, which holds the metadata and the
tensor table, and samples of its tensor data), not its path or mtime: a ``touch``ed or
moved file finds its conversion again. Each GGUF file keeps one copy per dtype: when a
file at the same path changes, its older conversion is removed after the new one is
written. ``mlxevict conversions list`` and ``mlxevict conversions remove`` show and delete entries.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .convert.convert import MARKER, convert_gguf, is_conversion, output_nbytes
from .convert.gguf import GGUFFile, read_gguf
from .convert.weights import check_architecture, make_config
from .demo_model import cache_dir
from .errors import MlxEvictError, os_error
from .memory import format_bytes

SAMPLE_BYTES = 64 * 1024  # bytes hashed at each sample of tensor data
SAMPLES = 16  # samples spread over the data: a fine-tune with the same header still differs
PLANS = ".plans"  # header-only folders (config.json) for `info` on an unconverted GGUF
CACHE_FIX = "set MLXEVICT_CACHE to another folder"

Report = Callable[[str], None]


@dataclass(frozen=True)
class Conversion:
    """One cached conversion.

    Attributes:
        path: the MLX model folder.
        source: the GGUF file it was converted from (absolute path, as it was then).
        dtype: ``None`` (as stored) or ``"float16"``/``"float32"``.
        nbytes: bytes on disk.
    """

    path: Path
    source: str
    dtype: Optional[str]
    nbytes: int

    @property
    def source_exists(self) -> bool:
        return Path(self.source).is_file()


def cache_root() -> Path:
    return cache_dir() / "gguf"


def content_key(gguf: GGUFFile) -> str:
    """A hash of the header (metadata + tensor table), the file size and samples of the tensor data."""
    size = gguf.path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with gguf.path.open("rb") as fh:
        digest.update(fh.read(gguf.data_offset))
        span = max(0, size - gguf.data_offset - SAMPLE_BYTES)
        for i in range(SAMPLES):
            fh.seek(gguf.data_offset + span * i // max(1, SAMPLES - 1))
            digest.update(fh.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def conversion_folder(gguf: GGUFFile, dtype: Optional[str] = None) -> Path:
    """Where ``gguf``'s conversion lives in the cache: found by content under any earlier file name."""
    tail = f"-{dtype or 'native'}-{content_key(gguf)[:12]}"
    for folder in sorted(cache_root().glob(f"*{tail}")):
        if is_conversion(folder):
            _note_source(folder, gguf.path)
            return folder
    return cache_root() / f"{gguf.path.stem}{tail}"


def _note_source(folder: Path, gguf_path: Path) -> None:
    """Record where the GGUF is now (it may have moved), so `conversions list` and `conversions remove FILE` find it."""
    marker = folder / MARKER
    try:
        info = json.loads(marker.read_text())
        source = str(gguf_path.resolve())
        if info.get("source_path") != source:
            marker.write_text(json.dumps(info | {"source_path": source}, indent=2) + "\n")
    except (OSError, json.JSONDecodeError):
        pass  # a read-only cache still serves its conversions; only the listing goes stale


def cached_conversion(gguf_path: Path, dtype: Optional[str] = None) -> Optional[Path]:
    """The cached conversion of ``gguf_path`` if there is one."""
    folder = conversion_folder(read_gguf(gguf_path), dtype)
    return folder if is_conversion(folder) else None


def convert_once(
    gguf_path: Path,
    *,
    dtype: Optional[str] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    report: Optional[Report] = None,
) -> Path:
    """Convert ``gguf_path`` into the cache unless an earlier run already did; return the folder.

    Says so through ``report`` before converting; removes this file's older conversion after.

    Raises:
        MlxEvictError: the GGUF is refused, or the cache folder is full or not writable.
    """
    gguf = read_gguf(gguf_path)
    out = conversion_folder(gguf, dtype)
    if is_conversion(out):
        return out
    check_architecture(gguf)
    source = str(gguf.path.resolve())
    if report:
        report(
            f"converting {gguf.path.name} once into {out} (about {format_bytes(output_nbytes(gguf, dtype))}; "
            "`mlxevict conversions list` shows conversions, `mlxevict conversions remove` deletes them)"
        )
    try:
        cache_root().mkdir(parents=True, exist_ok=True)
        if out.exists():  # our own folder, left unfinished by a crash: no marker, so not reused
            shutil.rmtree(out)
    except OSError as err:
        raise os_error(err, cache_root(), CACHE_FIX) from None
    convert_gguf(
        gguf.path, out, dtype=dtype, force=True, progress=progress, report=report,
        marker={"source_path": source}, fix=CACHE_FIX,
    )  # fmt: skip
    for old in list_conversions():
        if old.source == source and old.dtype == dtype and old.path != out:
            shutil.rmtree(old.path, ignore_errors=True)
            if report:
                report(f"removed the older conversion of {gguf.path.name}: {old.path.name}")
    return out


def plan_folder(gguf_path: Path) -> tuple[Path, int]:
    """A folder holding only the ``config.json`` a conversion would write, and the weights' bytes.

    Lets ``info`` plan memory for a GGUF without converting it.
    """
    gguf = read_gguf(gguf_path)
    config = make_config(gguf, None)
    embed = gguf.tensors["token_embd.weight"].type_name
    config["torch_dtype"] = {"F32": "float32", "BF16": "bfloat16"}.get(embed, "float16")
    folder = cache_root() / PLANS / content_key(gguf)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    except OSError as err:
        raise os_error(err, folder, CACHE_FIX) from None
    return folder, output_nbytes(gguf)


def list_conversions() -> list[Conversion]:
    """Every finished conversion in the cache, by name."""
    root = cache_root()
    if not root.is_dir():
        return []
    found = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and (p / MARKER).is_file()):
        try:
            info = json.loads((folder / MARKER).read_text())
        except (OSError, json.JSONDecodeError):
            info = {}
        nbytes = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        found.append(Conversion(folder, str(info.get("source_path", "?")), info.get("dtype"), nbytes))
    return found


def remove_conversions(names: list[str], *, everything: bool = False) -> list[Conversion]:
    """Delete the conversions named (folder name, or the GGUF file they came from); all with ``everything``.

    Raises:
        MlxEvictError: a name matches no conversion (nothing is deleted then).
    """
    entries = list_conversions()
    if everything:
        chosen = entries
    else:
        chosen = []
        for name in names:
            source = str(Path(name).expanduser().resolve()) if name.endswith(".gguf") else None
            match = [c for c in entries if c.path.name == name or c.source == source]
            if not match:
                known = ", ".join(c.path.name for c in entries) or "the cache is empty"
                raise MlxEvictError(f"no cached conversion {name!r}; `mlxevict conversions list` shows them ({known})")
            chosen += [c for c in match if c not in chosen]
    for entry in chosen:
        shutil.rmtree(entry.path)
    if everything:  # also the header-only plans and builds a crash left behind
        shutil.rmtree(cache_root() / PLANS, ignore_errors=True)
        for partial in cache_root().glob(".*.partial"):
            shutil.rmtree(partial, ignore_errors=True)
    return chosen
