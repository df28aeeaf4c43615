"""What the app needs from a chat session: the seam between the generation loop and the screens."""

from __future__ import annotations

from typing import Iterator, Protocol, Union

from mlxevict.events import Finished, Progress, TextChunk

Event = Union[TextChunk, Progress, Finished]


class ChatSessionLike(Protocol):
    """What the app needs from a chat session (``mlxevict.generate.ChatSession``).

    ``send`` yields the events of one turn, ending with ``Finished``; ``stop``
    (called from the UI thread) makes the running turn end soon with
    ``Finished(reason="interrupted")`` (a session without it has its generator
    closed instead); ``reset`` forgets the turns and frees the cache;
    ``set_policy`` takes effect from the next turn and raises ``ValueError``
    for settings that cannot work. A session that can size memory also has
    ``replan(budget, storage, policy=...)`` (``mlxevict.chat_session.ChatSession.replan``),
    which the settings use for budgets in memory and KV bits.
    """

    policy: str
    budget: int

    def send(self, text: str) -> Iterator[Event]: ...

    def stop(self) -> None: ...

    def reset(self) -> None: ...

    def set_policy(self, policy: str, budget: int) -> None: ...
