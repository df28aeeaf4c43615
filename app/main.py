"""The chat app: assembles the conversation, the input and the live panel; runs turns in a worker.

    from mlxevict.app.main import run_chat_app
    run_chat_app(session, model_name="SmolLM2-135M-Instruct")

``make_app`` builds the app without running it, for tests (``app.run_test()``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional, Union

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, Input, Static
from textual.worker import Worker, WorkerFailed, get_current_worker

from mlxevict.events import Finished, Progress, TextChunk
from mlxevict.kvstorage import KVStorage
from mlxevict.memory import memory_snapshot

from .commands import ChatCommands
from .conversation import Conversation, ModelTurn, describe_error, welcome_text
from .messages import TurnEnded, Update
from .panel import MemorySource, StatsPanel
from .session import ChatSessionLike
from .settings import KEEP_STORAGE, Choice, SettingsScreen, configure, storage_label
from .stream import UPDATE_INTERVAL, Batcher
from .transcript import TurnRecord, render_transcript, save_transcript

Event = Union[TextChunk, Progress, Finished]
STOP_WAIT_S = 10.0  # how long quitting waits for a stopped turn to wind down


class ChatApp(App[int]):
    """Chat with a reasoning model and watch its memory and KV cache while it thinks.

    Args:
        session: the chat session (see :class:`ChatSessionLike`).
        model_name: shown in the header and the transcript.
        memory_source: returns a fresh ``MemorySnapshot`` for the idle panel; None: none.
        clock: seconds, for "thought for N s" (tests fix it).
        update_interval: seconds between UI updates during a turn (0: every event).
        save_dir: where Ctrl-S writes transcripts. Default: the working directory.
    """

    CSS_PATH = "app.tcss"
    TITLE = "mlxevict"
    COMMANDS = App.COMMANDS | {ChatCommands}
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (90, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (24, "-tall")]
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+c", "stop", "Stop", show=False, priority=True),
        Binding("ctrl+o", "settings", "Policy/budget"),
        Binding("ctrl+r", "toggle_reasoning", "Reasoning"),
        Binding("ctrl+l", "clear", "Clear"),
        Binding("ctrl+s", "save", "Save"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        session: ChatSessionLike,
        *,
        model_name: str,
        memory_source: MemorySource | None = None,
        clock: Callable[[], float] = time.monotonic,
        update_interval: float = UPDATE_INTERVAL,
        save_dir: Path | None = None,
    ) -> None:
        super().__init__()
        self.session = session
        self.model_name = model_name
        self.memory_source = memory_source
        self.clock = clock
        self.update_interval = update_interval
        self.save_dir = save_dir
        self.settings: tuple[str, int] = (getattr(session, "policy", "default"), getattr(session, "budget", 0))
        # The settings as asked for (a budget in memory, a storage), which the dialog and palette start from.
        asked = getattr(session, "page_budget", None) or str(self.settings[1])  # a paged cache's budget in memory
        self.choice = Choice(self.settings[0], asked, getattr(session, "storage_request", None))
        self.storage_label = storage_label(session)
        self.pending_settings: Choice | None = None
        self.turns: list[TurnRecord] = []
        self.turn: ModelTurn | None = None
        self.worker: Worker | None = None
        self.stop_requested = threading.Event()

    # -- layout ------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            with Vertical(id="chat"):
                yield Conversation(welcome_text(self.model_name), id="conversation")
                yield Static("", id="summary")
                yield Input(placeholder="Ask something, then Enter", id="prompt")
            yield StatsPanel(self.memory_source, id="panel")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.model_name
        self.show_settings()
        self.set_interval(1.0, self.refresh_summary)
        self.query_one("#prompt", Input).focus()

    @property
    def panel(self) -> StatsPanel:
        return self.query_one("#panel", StatsPanel)

    @property
    def conversation(self) -> Conversation:
        return self.query_one("#conversation", Conversation)

    @property
    def generating(self) -> bool:
        return self.turn is not None

    @property
    def next_settings(self) -> tuple[str, int]:
        """The policy and budget (tokens) the next turn will use."""
        pending = self.pending_settings
        return (pending.policy, pending.budget) if pending else self.settings

    @property
    def next_choice(self) -> Choice:
        """The settings, as asked for, that the next turn will use."""
        return self.pending_settings or self.choice

    def show_settings(self) -> None:
        """The panel's settings line, at once after any change."""
        asked = self.choice.budget if self.choice.budget != str(self.settings[1]) else ""
        self.panel.show_settings(*self.settings, self.pending_settings, asked=asked, storage=self.storage_label)

    def refresh_summary(self) -> None:
        self.query_one("#summary", Static).update(self.panel.summary())

    # -- a turn ------------------------------------------------------------------

    @on(Input.Submitted, "#prompt")
    async def submit(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.generating:
            self.notify("Still answering: wait, or press Esc to stop it.", severity="warning")
            return
        event.input.value = ""
        await self.start_turn(text)

    async def start_turn(self, text: str) -> None:
        """Show the user's turn and an empty model turn, then generate in a worker thread."""
        self.stop_requested.clear()
        await self.conversation.add_user(text)
        self.turn = await self.conversation.add_model(self.clock())
        self.turns.append(TurnRecord(user=text))
        self.panel.generating = True
        self.query_one("#prompt", Input).placeholder = "Generating… Esc stops"
        self.worker = self.generate(text)

    @work(thread=True, exclusive=True, group="turn", exit_on_error=False)
    def generate(self, text: str) -> None:
        """Runs in a worker thread: consume the session's events, hand over batched updates."""
        worker = get_current_worker()
        batcher = Batcher(self.update_interval)
        ended = TurnEnded()
        events = None
        try:
            events = self.session.send(text)
            for event in events:
                if isinstance(event, Finished):
                    ended.finished = event
                    break
                batcher.add(event)
                if self.stop_requested.is_set() or worker.is_cancelled:
                    ended.stopped = True
                    if not hasattr(self.session, "stop"):
                        break  # no cooperative stop: closing the generator ends the turn
                if batcher.due() and not self._hand_over(self.apply_update, batcher.take()):
                    return
        except Exception as err:  # a model or memory fault ends the turn, not the app
            ended.error = err
        finally:
            if events is not None and hasattr(events, "close"):
                events.close()
        ended.stopped = ended.stopped or self.stop_requested.is_set()
        if batcher.pending:
            try:
                self._hand_over(self.apply_update, batcher.take())
            except Exception as err:  # whatever happens, the turn must end
                ended.error = ended.error or err
        self._hand_over(self.end_turn, ended)

    def _hand_over(self, callback: Callable, value: object) -> bool:
        """``call_from_thread``, except that a closing app is not an error."""
        if not self.is_running:
            return False
        try:
            self.call_from_thread(callback, value)
        except RuntimeError:
            return False
        return True

    async def apply_update(self, update: Update) -> None:
        """Runs on the UI thread: new text into the turn, numbers into the panel."""
        if self.turn is None or not self.is_running:
            return
        record = self.turns[-1]
        record.reasoning += update.reasoning
        record.answer += update.answer
        await self.turn.add(update.reasoning, update.answer, update.reasoning_tokens, self.clock())
        if update.progress is not None:
            self.panel.show_progress(update.progress)
        self.panel.add_entropies(update.entropies)
        self.refresh_summary()

    async def end_turn(self, ended: TurnEnded) -> None:
        """Runs on the UI thread: settle the turn, show errors, apply a pending policy change."""
        if not self.is_running:
            return
        turn, self.turn = self.turn, None
        self.panel.generating = False
        record = self.turns[-1]
        record.finished, record.stopped = ended.finished, ended.stopped
        if turn is not None:
            await turn.finish(ended.finished, stopped=ended.stopped, now=self.clock())
        if ended.finished is not None:
            record.reasoning = ended.finished.reasoning or record.reasoning
            record.answer = ended.finished.answer or record.answer
            self.panel.show_progress(ended.finished.progress)
            reason, message = ended.finished.reason, ended.finished.message
            if reason == "memory":
                await self.conversation.add_notice(message or "stopped: memory is nearly full")
            elif message and reason != "interrupted":  # e.g. the model's context limit
                await self.conversation.add_notice(message, severity="warning")
        if ended.error is not None:
            record.error = describe_error(ended.error)
            await self.conversation.add_notice(record.error)
        if self.pending_settings is not None:
            pending, self.pending_settings = self.pending_settings, None
            await self.apply_settings(pending)
        self.refresh_summary()
        self.query_one("#prompt", Input).placeholder = "Ask something, then Enter"

    async def stop_generation(self, *, wait: bool = False) -> None:
        """Ask the running turn to stop (it keeps what was written); optionally wait for it."""
        if not self.generating:
            return
        self.stop_requested.set()
        stop = getattr(self.session, "stop", None)
        if stop is not None:
            stop()
        if wait and self.worker is not None:
            try:
                await asyncio.wait_for(self.worker.wait(), STOP_WAIT_S)
            except (asyncio.TimeoutError, WorkerFailed):
                self.notify("The model has not stopped yet; it will after its current step.", severity="warning")

    # -- settings ----------------------------------------------------------------

    async def choose_settings(
        self, policy: str, budget: "int | str", storage: "KVStorage | None | str" = KEEP_STORAGE
    ) -> None:
        """Use ``policy``, ``budget`` (tokens, ``1.5GB``, ``auto``) and ``storage`` from the next turn (now, if no
        turn runs); ``storage`` by default stays what was asked for, ``None`` is the planner's rule."""
        storage = self.next_choice.storage if storage == KEEP_STORAGE else storage
        await self.choose(Choice(policy, str(budget), storage))

    async def choose(self, choice: Choice) -> None:
        """Use ``choice`` from the next turn (now, if no turn runs)."""
        if self.generating:
            self.pending_settings = choice
            self.show_settings()
            self.notify(f"From the next turn: {choice.policy}, budget {choice.budget}")
            return
        await self.apply_settings(choice)

    async def apply_settings(self, choice: Choice) -> None:
        try:
            applied = configure(self.session, choice)
        except ValueError as err:
            self.notify(str(err), title="Settings not changed", severity="error")
        else:
            self.settings, self.choice, self.storage_label = (choice.policy, applied.tokens), choice, applied.storage
            stored = f", KV in {applied.storage}" if applied.storage else ""
            self.notify(f"Policy {choice.policy}, budget {applied.tokens:,} tokens{stored}")
            for note in applied.notes:
                self.notify(note, severity="warning")
        self.show_settings()

    # -- actions -----------------------------------------------------------------

    async def action_stop(self) -> None:
        """Esc / Ctrl-C: stop the turn, keeping its text. Idle Ctrl-C says how to quit."""
        if self.generating:
            await self.stop_generation()
        elif isinstance(self.screen, SettingsScreen):
            self.screen.dismiss(None)
        else:
            self.action_help_quit()

    def action_settings(self) -> None:
        def chosen(result: Choice | None) -> None:
            if result is not None:
                self.run_worker(self.choose(result), group="settings")

        choice = self.next_choice
        self.push_screen(SettingsScreen(choice.policy, choice.budget, choice.storage), chosen)

    async def action_clear(self) -> None:
        """Forget the conversation and free the KV cache."""
        await self.stop_generation(wait=True)
        try:
            self.session.reset()
        except (ValueError, RuntimeError) as err:
            await self.conversation.add_notice(describe_error(err))
            return
        self.turns.clear()
        await self.conversation.clear()
        self.panel.clear_turn_numbers()
        self.refresh_summary()
        self.notify("Conversation cleared, KV cache freed")

    def action_toggle_reasoning(self) -> None:
        hidden = self.conversation.toggle_class("-hide-reasoning").has_class("-hide-reasoning")
        self.notify("Reasoning hidden" if hidden else "Reasoning shown")

    def action_save(self) -> Optional[Path]:
        """Write the transcript as Markdown; returns its path."""
        if not self.turns:
            self.notify("Nothing to save yet", severity="warning")
            return None
        now = datetime.now()
        text = render_transcript(
            self.turns, model_name=self.model_name, policy=self.settings[0], budget=self.settings[1], saved_at=now
        )
        try:
            path = save_transcript(text, self.save_dir or Path.cwd(), now)
        except OSError as err:
            self.notify(str(err), title="Transcript not saved", severity="error")
            return None
        self.notify(str(path), title="Transcript saved")
        return path

    def on_unmount(self) -> None:
        # However the app ends, a turn still running must end too: its thread
        # would otherwise keep the interpreter from exiting.
        self.stop_requested.set()
        if self.generating and hasattr(self.session, "stop"):
            self.session.stop()

    async def action_quit(self) -> None:
        """Ctrl-Q: stop a running turn, let its thread finish, then exit."""
        await self.stop_generation(wait=True)
        self.exit(0)


def make_app(
    session: ChatSessionLike,
    *,
    model_name: str,
    memory_source: MemorySource | None = memory_snapshot,
    **options,
) -> ChatApp:
    """Build the chat app without running it (tests drive it with ``run_test()``).

    Args:
        session: a chat session.
        model_name: shown in the header.
        memory_source: returns a ``MemorySnapshot`` for the idle panel. Default:
            ``mlxevict.memory.memory_snapshot``; None: no idle readings.
        options: ``clock``, ``update_interval``, ``save_dir`` (see :class:`ChatApp`).

    Returns:
        A :class:`ChatApp`, not yet running.
    """
    return ChatApp(session, model_name=model_name, memory_source=memory_source, **options)


def run_chat_app(session: ChatSessionLike, *, model_name: str) -> int:
    """Run the chat app in this terminal until the user quits.

    Args:
        session: a chat session, e.g. ``mlxevict.generate.ChatSession``.
        model_name: shown in the header and the saved transcripts.

    Returns:
        The exit code: 0 after Ctrl-Q.
    """
    app = make_app(session, model_name=model_name)
    app.run()
    return app.return_code or 0
