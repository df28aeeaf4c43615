"""The conversation: user turns, the model's reasoning (dimmed, collapsible) and its Markdown answer."""

from __future__ import annotations

from rich.markup import escape
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Collapsible, Markdown, Static

from mlxevict.events import Finished

from .gauges import format_bytes, format_count

REASON_TEXT = {
    "stop": "done",
    "length": "stopped at max tokens",
    "memory": "stopped by the memory guard",
    "interrupted": "stopped",
}


class UserTurn(Static):
    """What the user typed."""

    def __init__(self, text: str) -> None:
        super().__init__(escape(text), classes="user-turn", markup=True)
        self.text = text


class Notice(Static):
    """An error or a warning shown in the conversation instead of crashing the app."""

    def __init__(self, text: str, *, severity: str = "error") -> None:
        super().__init__(escape(text), classes=f"notice -{severity}")
        self.text = text


class ModelTurn(Vertical):
    """One reply: the reasoning in a collapsible block, then the answer, then a status line.

    Args:
        started: the clock reading when the turn began, for "thought for N s".
    """

    def __init__(self, started: float) -> None:
        super().__init__(classes="model-turn")
        self.started = started
        self.reasoning_text = ""
        self.answer_text = ""
        self.reasoning_tokens = 0
        self.thought_for: float | None = None
        self.reasoning_block = Collapsible(title="Thinking…", collapsed=False, classes="reasoning")
        self.reasoning_body = Static("", classes="reasoning-text", markup=False)
        self.answer = Markdown("", classes="answer")
        self.status = Static("reading the prompt…", classes="turn-status")

    def compose(self) -> ComposeResult:
        with self.reasoning_block:
            yield self.reasoning_body
        yield self.answer
        yield self.status

    async def add(self, reasoning: str, answer: str, reasoning_tokens: int, now: float) -> None:
        """Append streamed text. When the answer starts, the reasoning folds away."""
        if reasoning:
            self.reasoning_text += reasoning
            self.reasoning_tokens += reasoning_tokens
            self.add_class("-has-reasoning")
            self.reasoning_body.update(self.reasoning_text.strip("\n"))
            self.status.update("thinking…")
        if answer:
            if not self.answer_text and self.reasoning_text:
                self.end_reasoning(now)
            self.answer_text += answer
            await self.answer.append(answer)
            self.status.update("answering…")

    def end_reasoning(self, now: float) -> None:
        """Fold the reasoning block and title it with how long the model thought."""
        if self.thought_for is not None:
            return
        self.thought_for = now - self.started
        self.reasoning_block.title = (
            f"Thought for {self.thought_for:.1f} s · {format_count(self.reasoning_tokens)} tokens"
        )
        self.reasoning_block.collapsed = True

    async def finish(self, finished: Finished | None, *, stopped: bool, now: float) -> None:
        """Settle the text on the session's final version and write the status line."""
        if self.reasoning_text:
            self.end_reasoning(now)
        if finished is not None:
            if finished.answer and finished.answer != self.answer_text:
                self.answer_text = finished.answer
                await self.answer.update(finished.answer)
            if finished.reasoning and finished.reasoning != self.reasoning_text:
                self.reasoning_text = finished.reasoning
                self.reasoning_body.update(finished.reasoning.strip("\n"))
                self.add_class("-has-reasoning")
        reason = "interrupted" if stopped else (finished.reason if finished else "interrupted")
        parts = [REASON_TEXT.get(reason, reason)]
        if finished is not None:
            p = finished.progress
            parts.append(f"{format_count(p.generated_tokens)} tokens")
            parts.append(f"{p.tokens_per_s:.1f} tok/s")
            if p.cache is not None:
                parts.append(f"KV {format_count(p.cache.kept)}/{format_count(p.cache.capacity)}")
                if p.cache.saved_nbytes:
                    parts.append(f"saved {format_bytes(p.cache.saved_nbytes)}")
        parts.append(f"{now - self.started:.1f} s")
        self.status.update(" · ".join(parts))
        self.add_class(f"-{reason}")
        if not self.answer_text and not self.reasoning_text:
            self.add_class("-empty")


class Conversation(VerticalScroll):
    """The scrolling list of turns; it follows the newest text unless the user scrolls up.

    Args:
        welcome: a first paragraph (markup) that stays at the top, also after a clear.
    """

    def __init__(self, welcome: str = "", *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.welcome = welcome

    def compose(self) -> ComposeResult:
        if self.welcome:
            yield Static(self.welcome, classes="welcome")

    def on_mount(self) -> None:
        self.anchor()

    async def add_user(self, text: str) -> UserTurn:
        turn = UserTurn(text)
        await self.mount(turn)
        return turn

    async def add_model(self, started: float) -> ModelTurn:
        turn = ModelTurn(started)
        await self.mount(turn)
        self.anchor()
        return turn

    async def add_notice(self, text: str, *, severity: str = "error") -> Notice:
        notice = Notice(text, severity=severity)
        await self.mount(notice)
        return notice

    async def clear(self) -> None:
        """Remove every turn and notice; the welcome stays."""
        await self.query(".user-turn, .model-turn, .notice").remove()


def welcome_text(model_name: str) -> str:
    """The first paragraph of the conversation: what the screen shows and the two keys to know."""
    return (
        f"Ask [b]{escape(model_name)}[/b] something. Its reasoning streams here, dimmed, and folds away "
        "when the answer starts; the panel shows unified memory, the KV cache the policy keeps, "
        "speed and how unsure each token was.\n"
        "[b]Ctrl-O[/b] policy and budget · [b]Ctrl-P[/b] all commands"
    )


def describe_error(err: BaseException) -> str:
    """One line for the conversation: the message, with the type when it says something."""
    text = str(err).strip() or type(err).__name__
    if type(err).__name__ in ("ValueError", "MlxEvictError", "MemoryError"):
        return text
    return f"{type(err).__name__}: {text}"
