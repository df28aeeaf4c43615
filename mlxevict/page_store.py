"""A page store: evicted KV entries in a file, whole pages of ``PAGE`` entries, read back by page.

One file per layer's cache, in a folder the user names (on a Mac: the SSD, which is not the
unified memory the budget counts). Entries are written in the order they are evicted, ``PAGE``
of them a page; page ``p`` of every kv-head is one record, so what a head reads back
(``PAGE`` entries, keys and values side by side: 4 KiB for a head dim of 64 in 16 bits) is one
contiguous block. The bytes are the model's own (bfloat16 included), written and read as raw
words, so an entry comes back exactly as it left. The file is unlinked as soon as it is made: it
has no name in the folder, takes disk space while the store is open, and none once the store is
closed, garbage collected or its process ends, however it ends (a killed process leaves nothing).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from .errors import MlxEvictError

PAGE = 16  # entries per page (Quest's page size)
_RAW = {1: (mx.uint8, np.uint8), 2: (mx.uint16, np.uint16), 4: (mx.uint32, np.uint32)}  # item size: raw words


ELSEWHERE = "; give --page-dir another folder (page_dir=...), or --page-dir none (page_dir=False) for no page store"


class PageStore:
    """Whole pages of ``(heads, PAGE, width)`` entries in a temporary file of ``folder``.

    Args:
        folder: where the file goes; it must exist and be writable.
        heads: rows per page (a cache's batch times kv-heads).
        width: values per entry (key and value dims side by side).
        dtype: the entries' dtype.
    """

    def __init__(self, folder: str | Path, heads: int, width: int, dtype: mx.Dtype) -> None:
        if dtype.size not in _RAW:
            raise MlxEvictError(f"a page store cannot hold {dtype} entries")
        try:
            fd, self.path = tempfile.mkstemp(prefix="mlxevict-", suffix=".pages", dir=folder)
            os.unlink(self.path)  # the open file lives on, nameless, until it is closed or the process ends
        except OSError as err:
            raise MlxEvictError(f"cannot write pages to {folder}: {err.strerror or err}{ELSEWHERE}") from None
        self._file = os.fdopen(fd, "w+b")
        self.heads, self.width, self.dtype = heads, width, dtype
        self._raw_mx, self._raw_np = _RAW[dtype.size]
        self.pages = 0  # whole pages written
        self.bytes_read = 0
        self._map: np.memmap | None = None

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one head."""
        return PAGE * self.width * self.dtype.size

    @property
    def disk_bytes(self) -> int:
        return self.pages * self.heads * self.page_bytes

    def append(self, entries: mx.array) -> None:
        """Write ``(heads, n * PAGE, width)`` entries, oldest first, as ``n`` new pages."""
        heads, count, width = entries.shape
        if (heads, width) != (self.heads, self.width) or count % PAGE:
            raise ValueError(f"pages of ({self.heads}, k*{PAGE}, {self.width}) entries, got {tuple(entries.shape)}")
        words = np.array(entries.astype(self.dtype).view(self._raw_mx))
        pages = words.reshape(heads, count // PAGE, PAGE, width).transpose(1, 0, 2, 3)  # page-major
        try:
            self._file.write(np.ascontiguousarray(pages).tobytes())
            self._file.flush()
        except OSError as err:
            raise MlxEvictError(f"cannot write pages to {self.path}: {err.strerror or err}{ELSEWHERE}") from None
        self.pages += count // PAGE

    def read(self, index: np.ndarray) -> mx.array:
        """``(heads, k * PAGE, width)``: page ``index[h, j]`` of head ``h``, for each of the ``k`` columns."""
        index = np.asarray(index)
        if index.size and (index.min() < 0 or index.max() >= self.pages):
            raise IndexError(f"page index out of range: the store holds {self.pages} pages")
        got = self._mapped()[index, np.arange(self.heads)[:, None]]  # heads, k, PAGE, width
        self.bytes_read += got.nbytes
        return mx.array(got.reshape(self.heads, -1, self.width)).view(self.dtype)

    def pages_from(self, first: int) -> mx.array:
        """``(pages - first, heads, PAGE, width)``: every page from ``first`` on, as written (for a saved cache)."""
        return mx.array(np.ascontiguousarray(self._mapped()[first:])).view(self.dtype)

    def _mapped(self) -> np.memmap:
        """The file's whole pages, mapped (again when pages were written since)."""
        if self._map is None or self._map.shape[0] != self.pages:
            self._map = np.memmap(self._file, self._raw_np, "r", shape=(self.pages, self.heads, PAGE, self.width))
        return self._map

    def close(self) -> None:
        """Free the file's disk space now (reading after this is an error)."""
        self._map = None
        self._file.close()
