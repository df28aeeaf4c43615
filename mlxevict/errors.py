"""The project's exception: an expected, user-facing failure with one clear line."""

from __future__ import annotations

import errno
from pathlib import Path

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
