"""The project's exception: an expected, user-facing failure with one clear line."""

from __future__ import annotations

import errno
import sys
import threading
from pathlib import Path

ERROR_PREFIX = "mlxevict: error: "

# errno -> what happened, in words a user acts on.
_OS_FAULTS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a file is in the way where a folder is needed",
    errno.EEXIST: "a file is in the way where a folder is needed",
}


class MlxEvictError(ValueError):
    """Bad input or an expected fault; the CLI prints ``str(err)`` and exits non-zero."""


class Stopped(MlxEvictError):
    """The process is being ended (mlx.launch's SIGTERM): a loop that goes on after an error lets it through."""


_last_word = threading.Lock()
_said = False


def say_error(message: str) -> None:
    """Print ``mlxevict: error: MESSAGE``; a rank under mlx.launch prints only its first (its last word).

    A rank can reach its end on two threads at once (its main thread, and the stop watcher of
    :mod:`mlxevict.launch`): one line must come out, whole, whichever is first.
    """
    from .defaults import started_by_launcher

    global _said
    with _last_word:
        if _said:
            return
        _said = started_by_launcher()
        sys.stderr.write(f"{ERROR_PREFIX}{message}\n")
        sys.stderr.flush()


def os_error(err: OSError, path: str | Path | None, fix: str) -> MlxEvictError:
    """One line for a file-system fault: which file, what happened, what to do.

    Args:
        err: the ``OSError`` raised.
        path: the file or folder being written (``err.filename`` when it names one).
        fix: what the user should do, e.g. ``"choose another OUT_DIR"`` (a full disk adds
            ``"free some space or "``).
    """
    where = err.filename or path or "?"
    what = _OS_FAULTS.get(err.errno, err.strerror or str(err))
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free some space or {fix}"
    return MlxEvictError(f"cannot write {where}: {what}; {fix}")
