"""Command-palette entries (Ctrl-P): policy, budget, clear, reasoning, save, stop."""

from __future__ import annotations

import re
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterator

from textual.command import DiscoveryHit, Hit, Hits, Provider

from mlxevict.policies import policy_names

if TYPE_CHECKING:
    from .main import ChatApp

BUDGET_PRESETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ChatCommands(Provider):
    """The chat's commands; typing a number offers it as a budget ("budget 300")."""

    @property
    def chat(self) -> "ChatApp":
        return self.app  # type: ignore[return-value]

    def commands(self, query: str = "") -> Iterator[tuple[str, Callable[[], object], str]]:
        chat = self.chat
        policy, budget = chat.next_settings
        yield "Stop generation", chat.action_stop, "Esc / Ctrl-C: stop and keep what was written"
        yield "Clear conversation", chat.action_clear, "Ctrl-L: forget the turns and free the KV cache"
        yield "Toggle reasoning", chat.action_toggle_reasoning, "Ctrl-R: show or hide the thinking blocks"
        yield "Save transcript", chat.action_save, "Ctrl-S: Markdown with the cache statistics"
        yield "Policy and budget…", chat.action_settings, "Ctrl-O: a dialog for the next turn"
        for name in policy_names():
            yield f"Policy: {name}", partial(chat.choose_settings, name, budget), "evict with this policy from the next turn"
        numbers = [int(n) for n in re.findall(r"\d+", query)]
        for value in dict.fromkeys([*numbers, *BUDGET_PRESETS]):
            if value > 0:
                yield f"Budget: {value:,} tokens", partial(chat.choose_settings, policy, value), "KV entries per layer, next turn"

    async def discover(self) -> Hits:
        for name, callback, help in self.commands():
            if not name.startswith("Budget:"):
                yield DiscoveryHit(name, callback, help=help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, callback, help in self.commands(query):
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), callback, help=help)
