"""Preloading OpenBLAS on Linux: MLX's CPU wheel calls a reference BLAS whose matmuls are ~60× slower.

The ``mlxevict`` command re-executes itself once with ``LD_PRELOAD`` pointing
at the system's OpenBLAS (Debian/Ubuntu ``libopenblas0-pthread``), so the
dynamic linker resolves MLX's BLAS calls there. ``MLXEVICT_OPENBLAS_REEXEC``
marks the second run, so it never loops; ``MLXEVICT_NO_OPENBLAS=1`` turns it off.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

REEXEC_GUARD = "MLXEVICT_OPENBLAS_REEXEC"
DISABLE = "MLXEVICT_NO_OPENBLAS"
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def openblas_library() -> Optional[Path]:
    """The first OpenBLAS shared library found on this machine, or ``None``."""
    return next((Path(p) for p in CANDIDATES if Path(p).is_file()), None)


def preload_env(env: Mapping[str, str], platform: str = sys.platform) -> Optional[dict[str, str]]:
    """The environment to re-execute with, or ``None`` when there is nothing to do.

    Nothing to do off Linux, when ``LD_PRELOAD`` is already set (the user's
    choice), after one re-exec, when disabled, or without OpenBLAS installed.
    """
    if not platform.startswith("linux") or "LD_PRELOAD" in env or REEXEC_GUARD in env or env.get(DISABLE):
        return None
    library = openblas_library()
    if library is None:
        return None
    return {**env, "LD_PRELOAD": str(library), REEXEC_GUARD: "1"}


def openblas_loaded() -> bool:
    """Whether this process has OpenBLAS mapped (Linux; ``False`` elsewhere)."""
    try:
        return "libopenblas" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def reexec_with_openblas(args: Sequence[str]) -> None:
    """Replace this process with ``python -m mlxevict.cli ARGS`` under OpenBLAS, when it applies."""
    env = preload_env(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "mlxevict.cli", *args], env)
