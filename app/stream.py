"""Batching the session's events into UI updates, so the worker hands over a few per second."""

from __future__ import annotations

import time
from typing import Callable

from mlxevict.events import Finished, Progress, TextChunk

from .messages import Update

UPDATE_INTERVAL = 1 / 15  # seconds between UI updates during a turn


class Batcher:
    """Collects ``TextChunk`` and ``Progress`` events until :meth:`due`, then :meth:`take` them.

    Args:
        interval: seconds between updates; 0 hands over every event (tests).
        now: the clock the interval is measured with.
    """

    def __init__(self, interval: float = UPDATE_INTERVAL, now: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.now = now
        self.pending = Update()
        self.last = float("-inf")

    def add(self, event: TextChunk | Progress | Finished) -> None:
        """Fold one event into the pending update (``Finished`` is the caller's business)."""
        if isinstance(event, TextChunk):
            if event.kind == "reasoning":
                self.pending.reasoning += event.text
                self.pending.reasoning_tokens += 1
            else:
                self.pending.answer += event.text
                self.pending.answer_tokens += 1
            self.pending.entropies.append(float(event.prediction_entropy))
        elif isinstance(event, Progress):
            self.pending.progress = event

    def due(self) -> bool:
        return bool(self.pending) and self.now() - self.last >= self.interval

    def take(self) -> Update:
        """The pending update; starts a new one and the interval."""
        update, self.pending = self.pending, Update()
        self.last = self.now()
        return update
