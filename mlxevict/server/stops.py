"""Stop sequences (the request's ``stop``) found in streamed text, a sequence split across pieces included."""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    """Passes text through until one of ``stops`` appears; the stop and what follows are dropped.

    Text arrives in arbitrary pieces, so an ending that could start a stop
    sequence is held back until the next piece tells (as ``ThinkSplitter``
    holds back a tag).

    Args:
        stops: the stop sequences (empty: everything passes).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.hit = False
        self._pending = ""

    def feed(self, text: str) -> str:
        """The text that is safe to send now ("" once a stop was seen)."""
        if self.hit:
            return ""
        buffer = self._pending + text
        found = [at for at in (buffer.find(s) for s in self.stops) if at >= 0]
        if found:
            self.hit, self._pending = True, ""
            return buffer[: min(found)]
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(buffer)), 0, -1)
                    if s.startswith(buffer[-k:])), default=0)
        self._pending = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """What was held back, at the end (a stop that never completed is text)."""
        text, self._pending = ("" if self.hit else self._pending), ""
        return text
