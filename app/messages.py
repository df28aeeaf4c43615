"""What the generation worker hands to the UI thread: dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mlxevict.events import Finished, Progress


@dataclass
class Update:
    """Everything one worker flush brings: text by kind, entropies, the newest numbers.

    The worker batches events and hands one ``Update`` over every
    ``UPDATE_INTERVAL`` seconds, so a fast model never floods the event loop.
    """

    reasoning: str = ""
    answer: str = ""
    reasoning_tokens: int = 0
    answer_tokens: int = 0
    entropies: list[float] = field(default_factory=list)
    progress: Optional[Progress] = None

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.answer or self.entropies or self.progress)


@dataclass
class TurnEnded:
    """The end of a turn: the session's ``Finished``, or the error that ended it early.

    ``stopped`` is set when the user pressed Esc / Ctrl-C, whatever the session reports.
    """

    finished: Optional[Finished] = None
    error: Optional[BaseException] = None
    stopped: bool = False
