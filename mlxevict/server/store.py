"""The conversations a server keeps: their chat sessions, found by the messages so far, bounded by memory."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Hashable, Optional

from ..chat_session import ChatSession

Key = Hashable


def cache_nbytes(session: ChatSession) -> int:
    """KV bytes a session's caches hold now, all layers."""
    return sum(getattr(c, "nbytes", 0) for c in session.caches or ())


def conversation_key(settings: Hashable, messages: Any) -> Key:
    """The key of a conversation: the cache settings and every ``(role, content)`` so far."""
    return (settings, tuple((m["role"], m["content"]) for m in messages))


def session_key(settings: Hashable, session: ChatSession) -> Key:
    """The key a request that continues ``session`` looks up: its system message and turns."""
    system = [{"role": "system", "content": session.system}] if session.system else []
    return conversation_key(settings, [*system, *session.messages])


class ConversationStore:
    """Least recently used chat sessions, at most ``max_count`` of them and ``max_bytes`` of KV.

    A request takes its conversation out (:meth:`take`), so two requests never
    share caches, and puts it back under its new key when the turn is done.
    Each session's KV is bounded by its budget, so ``max_bytes`` bounds how
    many conversations the server keeps.

    Args:
        max_count: most sessions kept (0 keeps none).
        max_bytes: most KV bytes kept, all sessions together.
    """

    def __init__(self, max_count: int, max_bytes: int):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._sessions: "OrderedDict[Key, ChatSession]" = OrderedDict()
        self._lock = threading.Lock()  # the worker changes it, HTTP threads read its size

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes()

    def _nbytes(self) -> int:
        return sum(cache_nbytes(s) for s in self._sessions.values())

    def take(self, key: Key) -> Optional[ChatSession]:
        """The session stored under ``key``, removed from the store; ``None`` if there is none."""
        with self._lock:
            return self._sessions.pop(key, None)

    def put(self, key: Key, session: ChatSession) -> None:
        """Keep ``session``; the least recently used ones go while over either bound."""
        with self._lock:
            self._sessions[key] = session
            self._sessions.move_to_end(key)
            while self._sessions and (len(self._sessions) > self.max_count or self._nbytes() > self.max_bytes):
                self._sessions.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._sessions.clear()
