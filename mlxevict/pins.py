"""Pinned spans: positions an eviction never drops, the prompt among them as it arrives.

A caller pins absolute ``(start, end)`` spans (``make_cache(pinned=...)``,
``mlxevict.pin``); a policy with ``pins_prompt`` (the default) has the prompt pinned
while it arrives. The prompt is every token fed before the first single-token
call, and that token too: mlx-lm's ``generate_step`` feeds a prompt in 2,048-token
chunks and its last token alone (a loop that feeds the whole prompt in one call
gets its first generated token pinned with it, if it fits).
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

PROMPT_PIN_SHARE = 0.75  # most of the evictable room a pinned prompt may take


def check_pinned(pinned: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``pinned`` as a list of ``(start, end)`` int pairs, or a ``ValueError`` naming the bad span."""
    spans = []
    for span in pinned:
        try:
            if any(isinstance(x, bool) for x in span):
                raise TypeError
            start, end = (operator.index(x) for x in span)
            ok = 0 <= start < end
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(
                f"pinned span {span!r} is not a (start, end) pair of positions with 0 <= start < end; "
                "give half-open spans such as (2, 5)"
            )
        spans.append((start, end))
    return spans


class Pins:
    """The pinned spans of one cache, and the prompt's while it arrives.

    Args:
        spans: the caller's ``(start, end)`` spans.
        pin_prompt: pin the prompt as it arrives (the policy's ``pins_prompt``).
    """

    def __init__(self, spans: Sequence[tuple[int, int]] = (), pin_prompt: bool = False):
        self.spans: list[tuple[int, int]] = check_pinned(spans)
        self.prompt_open = pin_prompt  # until the first single-token call
        self.prompt_span: Optional[tuple[int, int]] = None
        self.prompt_too_long = False

    @property
    def tokens(self) -> int:
        return sum(b - a for a, b in self.spans)

    def add(self, start: int, end: int) -> tuple[int, int]:
        (span,) = check_pinned([(start, end)])
        self.spans.append(span)
        return span

    def feed_prompt(self, offset: int, S: int, room: int) -> Optional[str]:
        """Pin the prompt through the call of ``S`` tokens at ``offset``; the warning to give when it ends.

        Args:
            room: the evictable room besides the prompt's pin; the prompt is pinned while
                it fits in ``PROMPT_PIN_SHARE`` of it, and unpinned once a chunk makes it longer.

        Returns:
            ``None``, or (at the prompt's end, when it was too long) the line that says so.
        """
        if not self.prompt_open:
            return None
        if self.prompt_span in self.spans:
            self.spans.remove(self.prompt_span)
        length = offset + S
        limit = int((room - self.tokens) * PROMPT_PIN_SHARE)
        closing = S == 1
        if length > limit and not (closing and self.prompt_span):
            self.prompt_too_long = True  # (a last token that does not fit leaves the pin as it is)
        self.prompt_span = None if self.prompt_too_long else (0, min(length, limit))
        if self.prompt_span:
            self.spans.append(self.prompt_span)
        if not closing:
            return None
        self.prompt_open = False
        if not self.prompt_too_long:
            return None
        return (
            f"the prompt ({length} tokens) is longer than the {limit} tokens the budget lets "
            "mlxevict pin; it is not pinned and may be evicted: raise --budget to keep it"
        )

    def meta(self) -> dict[str, Any]:
        return {"pinned": self.spans, "prompt": [self.prompt_open, self.prompt_span, self.prompt_too_long]}

    def restore(self, meta: dict[str, Any], offset: int) -> None:
        """State from :meth:`meta` (caches saved before the prompt was tracked: open if nothing was fed)."""
        prompt_open, span, too_long = meta.get("prompt", [offset == 0 and self.prompt_open, None, False])
        self.prompt_open, self.prompt_too_long = prompt_open, too_long
        self.prompt_span = tuple(span) if span else None
