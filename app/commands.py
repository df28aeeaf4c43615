"""Command-palette entries (Ctrl-P): policy, budget (tokens or memory), KV bits, clear, reasoning, save, stop."""

from __future__ import annotations

import re
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterator

from textual.command import DiscoveryHit, Hit, Hits, Provider

from mlxevict.kvstorage import KVStorage
from mlxevict.policies import policy_names

if TYPE_CHECKING:
    from .main import ChatApp

BUDGET_PRESETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
KV_BITS_CHOICES = ("8", "4", "5,3", "none")  # as --kv-bits takes them
SIZE = re.compile(r"\d+(?:\.\d+)?\s*[kmgt]i?b\b", re.IGNORECASE)  # a memory size in the query: 1.5GB, 800 MiB


class ChatCommands(Provider):
    """The chat's commands; typing a number or a size offers it as a budget ("budget 300", "budget 1.5GB")."""

    @property
    def chat(self) -> "ChatApp":
        return self.app  # type: ignore[return-value]

    def commands(self, query: str = "") -> Iterator[tuple[str, Callable[[], object], str]]:
        chat = self.chat
        choice = chat.next_choice
        policy, budget = choice.policy, choice.budget
        yield "Stop generation", chat.action_stop, "Esc / Ctrl-C: stop and keep what was written"
        yield "Clear conversation", chat.action_clear, "Ctrl-L: forget the turns and free the KV cache"
        yield "Toggle reasoning", chat.action_toggle_reasoning, "Ctrl-R: show or hide the thinking blocks"
        yield "Save transcript", chat.action_save, "Ctrl-S: Markdown with the cache statistics"
        yield "Policy, budget and storage…", chat.action_settings, "Ctrl-O: a dialog for the next turn"
        for name in policy_names():
            yield f"Policy: {name}", partial(chat.choose_settings, name, budget), "evict with this policy from the next turn"
        # Budgets in memory as --budget takes them ("budget 1.5GB", "budget auto"), then in tokens.
        sizes = [m.group(0).replace(" ", "") for m in SIZE.finditer(query)]
        for text in dict.fromkeys([*sizes, "auto"]):
            yield f"Budget: {text} of KV memory", partial(chat.choose_settings, policy, text), "all layers, next turn"
        numbers = [int(n) for n in re.findall(r"\d+", SIZE.sub(" ", query))]
        for value in dict.fromkeys([*numbers, *BUDGET_PRESETS]):
            if value > 0:
                yield f"Budget: {value:,} tokens", partial(chat.choose_settings, policy, value), "KV entries per layer, next turn"
        for bits in KV_BITS_CHOICES:
            storage = KVStorage.parse(bits)
            yield f"KV bits: {bits}", partial(chat.choose_settings, policy, budget, storage), f"{storage.label}, next turn"

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
