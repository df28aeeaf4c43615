"""Paged storage: what the cache evicts goes to a page store on disk, and comes back by page when it is needed.

At 12.5% of a 16-bit full cache's bytes any eviction of a long context loses the facts asked
later (docs/tiers.md): what is evicted is gone. Here it is not: every evicted entry is written,
in the model's dtype, to a :class:`~mlxevict.page_store.PageStore` (a file; on a Mac, the SSD) in
pages of ``PAGE`` entries, and a ``bits``-bit copy of its key (the *sketch*: per entry, groups of
64 channels, ``mx.quantize``) stays in memory. For each token of a call, each kv-head scores every
whole page by the attention mass its sketched keys would take (``logsumexp`` over the page of
``scale · q·k̂``, the most over the kv-head's query heads); the token attends to its ``pages``
best beside the entries held and the unfinished last page (held in memory until it is whole).
A call reads from the store the union of its tokens' pages (``pages`` a kv-head for one token).

Memory: :attr:`nbytes` counts the entries held (the cache's budget), the sketch (2 bits a channel
and a 16-bit scale and bias per 64 channels: 20 bytes per evicted entry and kv-head for a head dim
of 64, 7.8% of a 16-bit entry) and the unfinished page; the pages read live for one layer's call.
The sketch grows with the context: :func:`~mlxevict.plan.paged_tokens` sizes the entries held so
that all of it, and one layer's pages read, fit a memory budget at the tokens expected. A decode
step reads ``pages · PAGE`` entries per layer and kv-head from the store (a prompt chunk: the union
of its tokens' choices), and waits for the choice (one sync per layer). Measured in docs/tiers.md;
the scoring is the pilot's (``benchmarks/paged.py``, ``shared-32s2``), whose logits it reproduces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import create_causal_mask

from .dense_storage import DenseStorage
from .errors import MlxEvictError
from .page_store import PAGE, PageStore
from .rotation import rotation_in

DEFAULT_PAGES = 32  # pages read back per call and kv-head: 512 entries (the pilot's shared-32s2)
SKETCH_BITS = 2
ROTATE_SKETCH = True  # the sketch's default (PagedStorage; make_cache's kv_rotate=None): chosen on the tuning half (docs/tiers.md)
PAGE_SCORES = ("logsumexp", "max")  # how a page's entries' scores make the page's: their mass, or the best one
SCORE_TOKENS = 16  # a prompt chunk's tokens scored at a time: their scores over every evicted entry are transient


def sketch_group(head_dim: int) -> int:
    """Channels per sketch scale: 64, or 32 for a head dim 64 does not divide."""
    for group in (64, 32):
        if head_dim % group == 0:
            return group
    raise MlxEvictError(f"a paged cache needs a head dim that 32 divides; this model's is {head_dim}")


def sketch_bytes(head_dim: int, bits: int = SKETCH_BITS, scale_bytes: int = 2) -> int:
    """Bytes of one key's sketch: ``bits`` a channel, a 16-bit scale and bias per :func:`sketch_group` channels."""
    return head_dim * bits // 8 + 2 * scale_bytes * (head_dim // sketch_group(head_dim))


def held_mask(mask: Any, shape: tuple[int, int, int, int]) -> mx.array:
    """The model's mask over the entries held (an array, boolean or added; ``"causal"``; ``None``) as a
    boolean ``(B, Hq, L, S)`` array, to stand beside the pages'."""
    L, S = shape[2:]
    if isinstance(mask, mx.array):
        kept = mask if mask.dtype == mx.bool_ else mask > -1e9
    elif mask == "causal":
        kept = create_causal_mask(L, S - L)
    else:
        kept = mx.ones((L, S), mx.bool_)
    return mx.broadcast_to(kept, shape)


class PagedStorage(DenseStorage):
    """Dense entries under the budget; every entry compaction drops goes to a page store and is read back by page.

    The cache's compaction gathers the kept slots to the front in time order and the dropped ones
    after them (:func:`mlxevict.kernels.compact`), so the slots ``[n_keep, size)`` it hands back are
    the entries evicted, oldest first: :meth:`set_slots` moves them to the store.

    Args:
        folder: where the page file goes (made if missing); it is nameless there, and freed with the cache.
        pages: pages read back per call and kv-head. Default 32.
        bits: the sketch's bits, one of ``mx.quantize``'s (2-6, 8). Default 2.
        sketch_limit: most evicted entries sketched (what a memory budget holds); past it the oldest whole
            pages lose their sketch and are never read back (evicted for good). ``None``: no limit.
        page_score: ``"logsumexp"`` (default: the attention mass a page's sketched keys would take) or ``"max"``
            (its one best key: a page holding one fact is not outranked by pages of many middling keys).
        rotate: sketch the keys rotated by :func:`~mlxevict.rotation.rotation_matrix` (and score with the
            queries rotated the same way: ``(qR)·(kR) = q·k``), which spreads the few large key channels that
            make a 2-bit group coarse. Default :data:`ROTATE_SKETCH` (chosen on the tuning half).
    """

    def __init__(self, folder: str | Path, pages: int = DEFAULT_PAGES, bits: int = SKETCH_BITS,
                 sketch_limit: Optional[int] = None, rotate: bool = ROTATE_SKETCH,
                 page_score: str = PAGE_SCORES[0]) -> None:  # fmt: skip
        super().__init__()
        folder = Path(folder).expanduser()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise MlxEvictError(f"cannot make page folder {folder}: {err.strerror or err}") from None
        if pages < 0 or bits not in (2, 3, 4, 5, 6, 8) or page_score not in PAGE_SCORES:
            raise MlxEvictError(f"pages={pages}, bits={bits}, page_score={page_score!r}: pages must be 0 or more, bits "
                                f"one of 2-6 or 8, page_score one of {', '.join(PAGE_SCORES)}")  # fmt: skip
        self.folder, self.pages, self.bits, self.rotate = folder, pages, bits, rotate
        self.page_score = page_score
        self.store: Optional[PageStore] = None
        self.sketch: Optional[list[mx.array]] = None  # mx.quantize's (words, scales, biases) of every evicted key
        self.tail: Optional[mx.array] = None  # (B, H, < PAGE, D + Dv): evicted entries short of a whole page
        self.evicted = 0  # entries in the store and the tail
        self.sketch_limit = sketch_limit
        self.first_page = 0  # the oldest page still sketched (those before it are never read back)
        self._cut: Optional[tuple[int, int]] = None

    # ---- what compaction drops ---------------------------------------------
    def limit_groups(self, rank_key: mx.array, n_keep: int, size: int, budget: int) -> tuple[mx.array, int]:
        self._cut = (n_keep, size)  # the compaction that follows drops slots [n_keep, size)
        return rank_key, n_keep

    def set_slots(self, arrays: list[mx.array]) -> None:
        super().set_slots(arrays)
        if self._cut is not None:
            a, b = self._cut
            self._cut = None
            self._spill(self.keys[..., a:b, :], self.values[..., a:b, :])

    def _spill(self, keys: mx.array, values: mx.array) -> None:
        """Sketch ``(B, H, n, D)`` evicted keys; write whole pages of them and their values to the store."""
        B, H, n, D = keys.shape
        sketch = mx.quantize(self._turned(keys), group_size=sketch_group(D), bits=self.bits)
        if self.sketch is None:
            self.sketch = list(sketch)
        else:
            self.sketch = [mx.concatenate([s, t], axis=2) for s, t in zip(self.sketch, sketch)]
        entries = mx.concatenate([keys, values], axis=-1)
        tail = entries if self.tail is None else mx.concatenate([self.tail, entries], axis=2)
        whole = tail.shape[2] // PAGE * PAGE
        if whole:
            if self.store is None:
                self.store = PageStore(self.folder, B * H, tail.shape[3], keys.dtype)
            self.store.append(tail[:, :, :whole].reshape(B * H, whole, tail.shape[3]))
        self.tail = tail[:, :, whole:]
        self.evicted += n
        over = self.sketch[0].shape[2] - self.sketch_limit if self.sketch_limit is not None else 0
        drop = min(-(-over // PAGE), self.store.pages - self.first_page if self.store else 0) if over > 0 else 0
        if drop:  # the oldest whole pages: evicted for good, the memory flat
            self.sketch = [x[:, :, drop * PAGE :] for x in self.sketch]
            self.first_page += drop
        mx.eval(self.sketch, self.tail)

    # ---- attention -----------------------------------------------------------
    def attend(self, queries, keys, values, scale, mask, sinks=None) -> Optional[mx.array]:
        if self.sketch is None or sinks is not None:
            return None
        B, H, S, D = keys.shape
        _, Hq, L, _ = queries.shape
        full = self.store.pages - self.first_page if self.store is not None else 0
        k = min(self.pages, full)
        paged, seen = self.tail, mx.ones((B, Hq, L, self.tail.shape[2]), mx.bool_)  # the unfinished page: seen
        if k:
            read, chosen = self._read(queries, scale, full, k)
            paged = mx.concatenate([read, paged], axis=2)
            seen = mx.concatenate([mx.repeat(mx.repeat(chosen, Hq // H, axis=1), PAGE, axis=-1), seen], axis=-1)
        paged = paged.astype(keys.dtype)
        keys = mx.concatenate([paged[..., :D], keys], axis=2)
        values = mx.concatenate([paged[..., D:], values], axis=2)
        mask = mx.concatenate([seen, held_mask(mask, (B, Hq, L, S))], axis=-1)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    def page_scores(self, queries: mx.array, scale: float, full: int) -> mx.array:
        """``(B, H, L, full)``: each token's score of the first ``full`` sketched pages, per kv-head: ``logsumexp``
        over a page's entries of ``scale · q·k̂`` (``k̂`` the sketch), the most over the kv-head's query heads."""
        B, H = self.tail.shape[:2]
        L = queries.shape[2]
        sketch = [x[:, :, : full * PAGE] for x in self.sketch]
        group = sketch_group(queries.shape[-1])
        q = self._turned(scale * queries).reshape(B, H, -1, L, queries.shape[-1])  # a kv-head's query heads, tokens
        pieces, reduce = [], mx.logsumexp if self.page_score == "logsumexp" else mx.max
        for t in range(0, L, SCORE_TOKENS):  # a prompt chunk in pieces: tokens x evicted entries scores each
            piece = q[:, :, :, t : t + SCORE_TOKENS]
            s = mx.quantized_matmul(piece.reshape(B, H, -1, piece.shape[-1]), *sketch, transpose=True,
                                    group_size=group, bits=self.bits)  # fmt: skip
            pieces.append(reduce(s.reshape(B, H, -1, piece.shape[3], full, PAGE), axis=-1).max(axis=2))
            if L > SCORE_TOKENS:
                mx.eval(pieces[-1])
        return mx.concatenate(pieces, axis=2) if len(pieces) > 1 else pieces[0]

    def _read(self, queries: mx.array, scale: float, full: int, k: int) -> tuple[mx.array, mx.array]:
        """The pages this call's tokens choose, read from the store: ``(B, H, U*PAGE, D+Dv)`` entries, the union of
        each kv-head's tokens' ``k`` best whole pages (``U`` the most any kv-head reads), and ``(B, H, L, U)``: which
        of them each token chose (for each token, the ``k`` pages its kv-head's query heads score highest)."""
        B, H = self.tail.shape[:2]
        score = self.page_scores(queries, scale, full)
        kth = mx.sort(score, axis=-1)[..., -k:][..., :1]
        chosen = np.array(score >= kth)  # waits for the choice: the pages are read on the host
        union = chosen.any(axis=2)  # B, H, full
        width = int(union.sum(axis=-1).max())
        # Each kv-head's pages in order, padded with its first (never chosen there) to the widest head's count.
        index = np.argsort(~union, axis=-1, kind="stable")[..., :width]
        used = np.take_along_axis(union, index, axis=-1)
        index = np.where(used, index, index[..., :1])
        picked = np.take_along_axis(chosen, index[:, :, None, :], axis=-1) & used[:, :, None, :]
        read = self.store.read(self.first_page + index.reshape(B * H, width)).reshape(B, H, width * PAGE, -1)
        return read, mx.array(picked)

    def _turned(self, x: mx.array) -> mx.array:
        """Keys or queries as the sketch holds them: rotated (``rotate``) or as they are."""
        return x @ rotation_in(x.shape[-1], x.dtype) if self.rotate else x

    # ---- bytes ---------------------------------------------------------------
    def arrays(self) -> list[mx.array]:
        """The entries held, the sketch and the unfinished page: the memory this storage holds."""
        extra = [] if self.sketch is None else [*self.sketch, self.tail]
        return [*super().arrays(), *extra]

    @property
    def disk_bytes(self) -> int:
        return self.store.disk_bytes if self.store is not None else 0

    @property
    def bytes_read(self) -> int:
        return self.store.bytes_read if self.store is not None else 0

    def close(self) -> None:
        """Free the page file's disk space now (it is freed with the storage anyway)."""
        if self.store is not None:
            self.store.close()

    # ---- save / load ---------------------------------------------------------
    @property
    def state(self) -> tuple[Any, Any]:
        """The entries held, and once anything was evicted also the sketch, the unfinished page and every page
        still sketched, read from the store: a saved paged cache holds all it can read back."""
        if self.sketch is None:
            return super().state
        pages = self.store.pages_from(self.first_page) if self.store is not None else mx.zeros((1,), self.keys.dtype)
        return (self.keys, *self.sketch, self.tail, pages), (self.values,)

    @state.setter
    def state(self, v: tuple[Any, Any]) -> None:
        keys, values = v
        if not isinstance(keys, (tuple, list)):  # nothing was evicted
            self.keys, self.values = keys, values
            return
        self.keys, self.values = keys[0], values[0]
        self.sketch, self.tail, pages = list(keys[1:4]), keys[4], keys[5]
        if pages.ndim == 4 and pages.shape[0]:  # (pages, B*H, PAGE, width): written again, in a new file
            self.store = PageStore(self.folder, pages.shape[1], pages.shape[3], pages.dtype)
            self.store.append(pages.transpose(1, 0, 2, 3).reshape(pages.shape[1], -1, pages.shape[3]))

    def meta(self) -> dict[str, Any]:
        """The page store's settings and counters (``paged``: its pages read back a call)."""
        return {"paged": self.pages, "page_dir": str(self.folder), "sketch_bits": self.bits,
                "sketch_rotate": self.rotate, "sketch_limit": self.sketch_limit, "evicted": self.evicted,
                "page_score": self.page_score}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> "PagedStorage":
        """Rebuild from :meth:`meta`, its pages in a new file of the saved folder (made if missing).

        Raises:
            MlxEvictError: a cache saved before pages were saved (0.1's first page stores), whose pages are gone.
        """
        if "page_dir" not in meta:
            raise MlxEvictError("this cache was saved with a page store (--page-dir) whose evicted entries were in a "
                                "temporary file: it cannot be loaded; run it again")  # fmt: skip
        storage = cls(meta["page_dir"], meta["paged"], meta["sketch_bits"], meta["sketch_limit"], meta["sketch_rotate"],
                      meta.get("page_score", PAGE_SCORES[0]))  # fmt: skip
        storage.evicted = meta["evicted"]
        return storage
