"""The chat TUI, driven with Textual's pilot.

Fast tests drive the app with ``ScriptedSession``: a plain class implementing
the session interface that yields real event dataclasses from a script, so the
layout, the ``<think>`` split, stopping and faults are deterministic. Slow tests
drive it with the real SmolLM2 test model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import re
import threading
from pathlib import Path
from typing import Iterator

import pytest
from textual.command import CommandPalette
from textual.widgets import Collapsible, Input, OptionList, Static
from model_files import build_tiny_model

from mlxevict.app.conversation import ModelTurn, Notice, UserTurn
from mlxevict.app.main import ChatApp, make_app
from mlxevict.app.messages import Update
from mlxevict.app.panel import StatsPanel
from mlxevict.app.settings import SettingsScreen
from mlxevict.app.stream import Batcher
from mlxevict.app.transcript import cache_table
from mlxevict.events import Finished, Progress, TextChunk
from mlxevict.generate import ChatSession, ThinkSplitter
from mlxevict.kvstorage import KVStorage
from mlxevict.memory import MemorySnapshot
from mlxevict.budget import parse_budget
from mlxevict.plan import paged_tokens, plan_cache
from mlxevict.stats import CacheStats

GB = 1024**3
SIZE = (120, 36)
THINK = (
    "<think>\nThe user asks for 17 times 3. 17 times 3 is 51, because 10 times 3 is 30 "
    "and 7 times 3 is 21.\n</think>\n\nThe answer is **51**.\n\n- 10 × 3 = 30\n- 7 × 3 = 21"
)
REASONING = THINK.split("</think>")[0].removeprefix("<think>\n")  # tags and the newline after go
ANSWER = THINK.split("</think>")[1].lstrip()

FIXED_MEMORY = MemorySnapshot(
    mlx_active=int(1.3 * GB),
    mlx_peak=int(1.6 * GB),
    mlx_cache=int(0.25 * GB),
    system_total=16 * GB,
    system_available=int(6.5 * GB),
    process_rss=int(1.9 * GB),
)


def cache_at(tokens: int, budget: int = 24) -> CacheStats:
    kept = min(tokens, budget)
    per_token = 30 * 3 * 64 * 2 * 4  # SmolLM2-135M: layers × kv-heads × head-dim × K,V × float32
    return CacheStats("entropy", budget, budget, budget + 8, kept, tokens - kept, tokens, kept * per_token, tokens * per_token)


def progress_at(generated: int, prompt: int = 20) -> Progress:
    return Progress(prompt, generated, 480.0, 31.5, cache_at(prompt + generated), FIXED_MEMORY)


def think_script(text: str = THINK, progress_every: int = 3) -> list:
    """Events for a raw ``<think>`` stream, split as the generation loop splits it.

    The text is cut into word-sized tokens, with the closing tag torn across two
    of them, and fed through the generation loop's ``ThinkSplitter``.
    """
    pieces = re.findall(r"<think>|</thi|nk>|\S+\s*|\s+", text)
    splitter = ThinkSplitter()
    events: list = []
    text_of = {"reasoning": "", "answer": ""}
    for n, piece in enumerate(pieces, 1):
        for kind, part in splitter.feed(piece):
            events.append(TextChunk(part, kind, 1000 + n, round(0.4 + (n * 0.61) % 2.3, 3)))
            text_of[kind] += part
        if n % progress_every == 0:
            events.append(progress_at(n))
    for kind, part in splitter.flush():
        events.append(TextChunk(part, kind, 1000 + len(pieces), 0.5))
        text_of[kind] += part
    events.append(Finished("stop", text_of["reasoning"], text_of["answer"], progress_at(len(pieces))))
    return events


class ScriptedSession:
    """The chat-session interface, playing a fixed script of events.

    Args:
        script: the events of every turn.
        hold_at: index of the event before which ``send`` waits until ``release``
            is set or ``stop`` is called (to look at the app mid-turn).
        fail_at: index at which ``send`` raises ``fail_with``.
    """

    def __init__(self, script: list, *, hold_at: int | None = None, fail_at: int | None = None, fail_with=None):
        self.script = script
        self.hold_at = hold_at
        self.fail_at = fail_at
        self.fail_with = fail_with or RuntimeError("[metal] out of memory while allocating 4 GB")
        self.policy, self.budget = "entropy", 24
        self.sent: list[str] = []
        self.resets = 0
        self.stops = 0
        self.holding = threading.Event()
        self.release = threading.Event()
        self._stop = threading.Event()

    def send(self, text: str) -> Iterator:
        self.sent.append(text)
        self._stop.clear()
        for i, event in enumerate(self.script):
            if i == self.hold_at:
                self.holding.set()
                self.release.wait(timeout=30)
            if i == self.fail_at:
                raise self.fail_with
            if self._stop.is_set() and not isinstance(event, Finished):
                yield Finished("interrupted", "", "", progress_at(i))
                return
            yield event

    def stop(self) -> None:
        self.stops += 1
        self._stop.set()
        self.release.set()

    def reset(self) -> None:
        self.resets += 1

    def set_policy(self, policy: str, budget: int) -> None:
        if budget < 16:
            raise ValueError(f"budget={budget} is smaller than sinks + window = 16; raise the budget")
        self.policy, self.budget = policy, budget


def pilot_test(test):
    """Run an ``async`` pilot test in its own event loop (no pytest async plugin needed)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))

    return run


def scripted_app(session: ScriptedSession, **options) -> ChatApp:
    options.setdefault("memory_source", lambda: FIXED_MEMORY)
    options.setdefault("clock", lambda: 100.0)
    options.setdefault("update_interval", 0)
    return make_app(session, model_name="SmolLM2-135M-Instruct", **options)


async def ask(pilot, text: str) -> None:
    """Type ``text`` and press Enter; return once the turn has started.

    Submitting mounts the turn before the worker starts, so without the wait a test
    could find the app idle *before* its turn began (a flake seen once in CI).
    """
    app = pilot.app
    turns = len(app.turns)
    app.query_one("#prompt", Input).value = text
    await pilot.press("enter")
    await wait_until(pilot, lambda: len(app.turns) > turns)


async def wait_until(pilot, condition, timeout: float = 20.0) -> None:
    steps = int(timeout / 0.05)
    for _ in range(steps):
        if condition():
            await pilot.pause()
            return
        await pilot.pause(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {condition}")


async def wait_idle(pilot, timeout: float = 20.0) -> None:
    app = pilot.app
    await wait_until(pilot, lambda: not app.generating and (app.worker is None or app.worker.is_finished), timeout)


def last_turn(app: ChatApp) -> ModelTurn:
    return app.query(ModelTurn).last()


# -- fast tests, scripted session -------------------------------------------------


@pilot_test
async def test_think_stream_splits_reasoning_from_answer():
    session = ScriptedSession(think_script())
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "What is 17 times 3?")
        await wait_idle(pilot)
        assert session.sent == ["What is 17 times 3?"]
        assert app.query_one(UserTurn).text == "What is 17 times 3?"
        turn = last_turn(app)
        assert turn.reasoning_text == REASONING
        assert turn.answer_text == ANSWER
        assert "51" in turn.answer.source and "<think>" not in turn.answer.source
        assert "17 times 3 is 51" in str(turn.reasoning_body.render())
        # The reasoning folded away once the answer began, titled with its size.
        assert turn.reasoning_block.collapsed
        assert turn.reasoning_block.title.startswith("Thought for")
        assert turn.has_class("-stop")
        record = app.turns[-1]
        assert (record.reasoning, record.answer) == (REASONING, ANSWER)
        assert app.query_one("#prompt", Input).value == ""


@pilot_test
async def test_answer_without_reasoning_has_no_thinking_block():
    session = ScriptedSession(think_script("Paris is the capital of France."))
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "Capital of France?")
        await wait_idle(pilot)
        turn = last_turn(app)
        assert turn.answer_text == "Paris is the capital of France."
        assert not turn.has_class("-has-reasoning")
        assert not turn.reasoning_block.display


@pilot_test
async def test_empty_input_is_ignored():
    session = ScriptedSession(think_script())
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("enter")
        app.query_one("#prompt", Input).value = "   "
        await pilot.press("enter")
        await pilot.pause()
        assert session.sent == []
        assert not app.query(ModelTurn) and not app.query(UserTurn)
        assert not app.generating


@pilot_test
async def test_panel_shows_memory_kv_speed_and_entropy():
    script = think_script()
    session = ScriptedSession(script)
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        panel = app.query_one(StatsPanel)
        assert "6.5 GiB" not in str(panel.query_one("#mem-text", Static).render())
        assert "9.5 GiB of 16.0 GiB" in str(panel.query_one("#mem-text", Static).render())  # used = total - available
        assert str(panel.query_one("#kv-text", Static).render()) == "empty"
        await ask(pilot, "What is 17 times 3?")
        await wait_idle(pilot)
        final = script[-1].progress.cache
        kv = str(panel.query_one("#kv-text", Static).render())
        assert f"kept {final.kept}" in kv and f"evicted {final.evicted}" in kv
        assert final.evicted > 0
        assert "31.5" in str(panel.query_one("#speed-text", Static).render())
        entropies = [e.prediction_entropy for e in script if isinstance(e, TextChunk)]
        assert list(panel.entropies) == entropies
        assert "entropy · budget 24" in str(panel.query_one("#kv-policy", Static).render())


@pilot_test
async def test_escape_stops_generation_and_keeps_the_text():
    script = think_script()
    session = ScriptedSession(script, hold_at=8)
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "What is 17 times 3?")
        await wait_until(pilot, session.holding.is_set)
        await pilot.pause(0.1)
        assert app.generating
        written = last_turn(app).reasoning_text
        assert written
        await pilot.press("escape")
        await wait_idle(pilot)
        turn = last_turn(app)
        assert session.stops == 1
        assert turn.has_class("-interrupted")
        assert turn.reasoning_text == written  # kept, not replaced by the empty final text
        assert "stopped" in str(turn.status.render())
        assert app.turns[-1].stopped and app.turns[-1].reasoning == written


@pilot_test
async def test_ctrl_c_stops_generation_and_idle_ctrl_c_does_not_quit():
    session = ScriptedSession(think_script(), hold_at=5)
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "hi")
        await wait_until(pilot, session.holding.is_set)
        await pilot.press("ctrl+c")
        await wait_idle(pilot)
        assert session.stops == 1 and last_turn(app).has_class("-interrupted")
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert app.is_running


@pilot_test
async def test_ctrl_q_during_generation_stops_the_turn_and_quits():
    session = ScriptedSession(think_script(), hold_at=5)
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "hi")
        await wait_until(pilot, session.holding.is_set)
        await pilot.press("ctrl+q")
        await pilot.pause(0.2)
        assert session.stops == 1
    assert app.return_code == 0
    assert app.worker.is_finished


@pilot_test
async def test_model_error_is_a_message_not_a_crash():
    session = ScriptedSession(think_script(), fail_at=6)
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "hi")
        await wait_idle(pilot)
        notice = app.query_one(Notice)
        assert "RuntimeError: [metal] out of memory" in notice.text
        assert app.turns[-1].error
        # The app goes on: the next turn works.
        session.fail_at = None
        await ask(pilot, "again")
        await wait_idle(pilot)
        assert last_turn(app).answer_text == ANSWER


@pilot_test
async def test_memory_guard_stop_is_shown_in_the_conversation():
    message = "stopped before the machine would swap: 900.0 MB available, below the 1.1 GB margin"
    script = think_script()
    script[-1] = Finished("memory", REASONING, "", progress_at(20))
    script = [e for e in script if not (isinstance(e, TextChunk) and e.kind == "answer")]
    script[-1] = Finished("memory", REASONING, "", progress_at(20), message)
    app = scripted_app(ScriptedSession(script))
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "hi")
        await wait_idle(pilot)
        assert app.query_one(Notice).text == message
        assert last_turn(app).has_class("-memory")
        assert last_turn(app).reasoning_text == REASONING


async def apply_settings(pilot, app, session, policy: str, budget: int) -> None:
    """Open the settings dialog (Ctrl-O), set policy and budget, confirm, wait for the session."""
    await pilot.press("ctrl+o")
    await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen), timeout=5)
    app.screen.query_one("#policy").value = policy
    field = app.screen.query_one("#budget", Input)
    field.value = str(budget)
    field.focus()
    await pilot.press("enter")
    await wait_until(pilot, lambda: session.budget == budget)


@pilot_test
async def test_settings_dialog_changes_policy_and_budget():
    session = ScriptedSession(think_script())
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await apply_settings(pilot, app, session, "window", 512)
        assert (session.policy, session.budget) == ("window", 512)
        assert app.settings == ("window", 512)
        assert "window · budget 512" in str(app.query_one("#kv-policy", Static).render())


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):
    """A random-weight model on disk with head_dim 32, loaded (8-bit storage groups by 32)."""
    from mlx_lm import load

    return load(str(build_tiny_model(tmp_path_factory.mktemp("app") / "tiny32", hidden=128)))


@pilot_test
async def test_settings_dialog_keeps_quantized_storage_and_the_panel_says_so(tiny32):
    model, tokenizer = tiny32
    storage = dict(kv_bits=8, kv_group_size=32, full_precision_window=12)
    session = ChatSession(model, tokenizer, policy="window", budget=64, max_tokens=8, temp=0.0, **storage)
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await apply_settings(pilot, app, session, "h2o", 96)
        cache = session.caches[0]
        assert (session.policy, cache.kv_bits, cache.kv_group_size, cache.full_precision_window) == ("h2o", 8, 32, 12)
        await ask(pilot, "hi")
        await wait_idle(pilot)
        stats = app.turns[-1].finished.progress.cache
        assert (stats.kv_bits, stats.full_precision_window, stats.budget) == (8, 12, 96)
        assert stats.capacity <= 96  # grown to what the turn needs (steps of 64), never past the budget
        kv = str(app.query_one(StatsPanel).query_one("#kv-text", Static).render())
        assert "(8-bit) · full" in kv
    assert "| KV storage | 8-bit, newest 12 tokens in full precision |" in cache_table(stats)
    eight_bit_window = dataclasses.replace(stats, kv_bits=4, window_bits=8)
    assert "| KV storage | 4-bit, newest 12 tokens in 8-bit |" in cache_table(eight_bit_window)


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """A random-weight model with head_dim 64 (mx.quantize's default group size divides it), loaded."""
    from mlx_lm import load

    return load(str(build_tiny_model(tmp_path_factory.mktemp("app") / "tiny64", hidden=128, heads=2, kv_heads=1)))


async def set_in_dialog(pilot, app, budget: str, kv_bits: str) -> None:
    await pilot.press("ctrl+o")
    await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen), timeout=5)
    app.screen.query_one("#budget", Input).value = budget
    field = app.screen.query_one("#kv-bits", Input)
    field.value = kv_bits
    field.focus()
    await pilot.press("enter")


@pilot_test
async def test_settings_take_a_memory_budget_and_kv_bits_as_the_cli_does(tiny64):
    model, tokenizer = tiny64
    session = ChatSession(model, tokenizer, policy="window", budget=64, max_tokens=4, temp=0.0)
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        shown = lambda: str(app.query_one("#kv-policy", Static).render())  # noqa: E731
        await set_in_dialog(pilot, app, "1.5GB", "5,3")
        plan = plan_cache(model, "1.5GB", KVStorage.parse("5,3"))  # more than the context: capped, and said
        await wait_until(pilot, lambda: session.budget == plan.tokens)
        assert session.caches[0].kv_bits == (5, 3) and plan.tokens == plan.context_limit
        assert f"window · budget {plan.tokens:,} (1.5GB) · 5/3-bit" in shown()  # at once, before any turn
        # "100KB" is KV memory, not 100 tokens; an empty KV-bits field lets the planner choose, as --budget does
        await set_in_dialog(pilot, app, "100KB", "")
        plan = plan_cache(model, "100KB")
        await wait_until(pilot, lambda: session.budget == plan.tokens)
        assert plan.storage.label == "5/3-bit KIVI-64, 4/3-bit below" and plan.tokens < 1000  # 100 KB evicts most
        assert f"budget {plan.tokens:,} (100KB) · 5/3-bit" in shown()
        # a bad budget is the CLI's line, in the dialog, and nothing changes
        await set_in_dialog(pilot, app, "20XB", "")
        await wait_until(pilot, lambda: "bad --budget '20XB'" in str(app.screen.query_one("#settings-error").render()))
        await pilot.press("escape")
        # the palette takes a size too
        await pilot.press("ctrl+p")
        await wait_until(pilot, lambda: isinstance(app.screen, CommandPalette), timeout=5)
        await pilot.press(*"budget 200KB")
        await wait_until(pilot, lambda: "Budget: 200KB of KV memory" in first_hit(app), timeout=10)
        await pilot.press("enter")
        await wait_until(pilot, lambda: session.budget == plan_cache(model, "200KB").tokens)
        assert f"(200KB) · {plan_cache(model, '200KB').storage.label}" in shown()  # the tiers there: 5/4-bit


@pilot_test
async def test_a_paged_session_takes_a_memory_budget_refuses_kv_bits_and_shows_the_disk(tiny64, tmp_path):
    model, tokenizer = tiny64
    session = ChatSession(model, tokenizer, budget="200KB", page_dir=tmp_path, pages=2, max_tokens=40, temp=0.0)
    held = {b: paged_tokens(parse_budget(b), model, None, pages=2) for b in ("200KB", "150KB")}
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        shown = lambda: str(app.query_one("#kv-policy", Static).render())  # noqa: E731
        assert f"budget {held['200KB']:,} (200KB) · evicted to disk" in shown()
        await set_in_dialog(pilot, app, "150KB", "")
        await wait_until(pilot, lambda: session.page_budget == "150KB")
        assert session.budget == held["150KB"] and f"budget {held['150KB']:,} (150KB) · evicted to disk" in shown()
        await set_in_dialog(pilot, app, "150KB", "8")  # a paged cache holds the model's dtype: not changed
        await wait_until(pilot, lambda: "no --kv-bits" in " ".join(str(n.message) for n in app._notifications))
        assert session.budget == held["150KB"] and session.caches[0].kv_bits is None
        await ask(pilot, "Tell me a long story, please, about anything at all.")
        await wait_idle(pilot)
        assert app.turns[-1].finished.progress.cache.evicted > 0
        assert "on disk " in str(app.query_one(StatsPanel).query_one("#kv-text", Static).render())


@pilot_test
async def test_a_memory_budget_in_the_settings_pages_by_the_rule_and_kv_bits_keep_the_tiers(tmp_path):
    """As ``--budget`` without ``--page-dir``: a budget in memory that would evict goes to the temp folder."""
    import tempfile

    import mlx.core as mx
    from mlx_lm import load

    path = build_tiny_model(tmp_path / "tiny16", hidden=128, heads=2, kv_heads=2, max_position_embeddings=8192,
                            dtype=mx.float16)  # fmt: skip
    model, tokenizer = load(str(path))
    session = ChatSession(model, tokenizer, budget=512, page_rule=True, max_tokens=8, temp=0.0)
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        shown = lambda: str(app.query_one("#kv-policy", Static).render())  # noqa: E731
        await set_in_dialog(pilot, app, "2MB", "")  # 24% of a 16-bit cache of the 8,192-token context
        await wait_until(pilot, lambda: session.page_budget == "2MB")
        held = paged_tokens(parse_budget("2MB"), model)
        assert session.cache_options["page_dir"] == tempfile.gettempdir() and session.budget == held
        assert f"budget {held:,} (2MB) · evicted to disk" in shown()
        await set_in_dialog(pilot, app, "2MB", "5,3")  # a storage asked for: no page store
        await wait_until(pilot, lambda: not session.paged)
        assert session.caches[0].kv_bits == (5, 3) and "5/3-bit" in shown() and "disk" not in shown()


def first_hit(app) -> str:
    options = app.screen.query_one(OptionList)
    return str(options.get_option_at_index(0).prompt) if options.option_count else ""


@pilot_test
async def test_budget_the_session_rejects_is_not_applied():
    session = ScriptedSession(think_script())
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await app.choose_settings("entropy", 8)
        await pilot.pause()
        assert session.budget == 24 and app.settings == ("entropy", 24)


@pilot_test
async def test_policy_change_during_a_turn_waits_for_the_next_turn():
    session = ScriptedSession(think_script(), hold_at=5)
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "hi")
        await wait_until(pilot, session.holding.is_set)
        await app.choose_settings("h2o", 128)
        assert session.policy == "entropy"
        assert "next turn" in str(app.query_one("#kv-policy", Static).render())
        session.release.set()
        await wait_idle(pilot)
        assert (session.policy, session.budget) == ("h2o", 128)


@pilot_test
async def test_command_palette_sets_the_budget_typed():
    session = ScriptedSession(think_script())
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+p")
        await wait_until(pilot, lambda: isinstance(app.screen, CommandPalette), timeout=5)
        await pilot.press(*"budget 300")

        def first_hit() -> str:
            options = app.screen.query_one(OptionList)
            return str(options.get_option_at_index(0).prompt) if options.option_count else ""

        await wait_until(pilot, lambda: "Budget: 300 tokens" in first_hit(), timeout=10)
        await pilot.press("enter")
        await wait_until(pilot, lambda: session.budget == 300)
        assert app.settings == ("entropy", 300)


@pilot_test
async def test_clear_frees_the_cache_and_keeps_the_welcome():
    session = ScriptedSession(think_script())
    app = scripted_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "hi")
        await wait_idle(pilot)
        await pilot.press("ctrl+l")
        await wait_until(pilot, lambda: not app.query(ModelTurn), timeout=5)
        assert session.resets == 1
        assert not app.query(ModelTurn) and not app.query(UserTurn) and app.turns == []
        assert app.query(".welcome")
        assert not app.query_one(StatsPanel).entropies


@pilot_test
async def test_toggle_reasoning_hides_and_shows_thinking():
    app = scripted_app(ScriptedSession(think_script()))
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "hi")
        await wait_idle(pilot)
        block = last_turn(app).query_one(Collapsible)
        assert block.display and block.region.height > 0
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: block.region.height == 0, timeout=5)
        assert not block.display and last_turn(app).answer.region.height > 0
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: block.region.height > 0, timeout=5)
        assert block.display


@pilot_test
async def test_save_writes_markdown_with_cache_statistics(tmp_path: Path):
    script = think_script()
    app = scripted_app(ScriptedSession(script), save_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "What is 17 times 3?")
        await wait_idle(pilot)
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: any(tmp_path.glob("mlxevict-chat-*.md")), timeout=5)
    (path,) = tmp_path.glob("mlxevict-chat-*.md")
    text = path.read_text()
    final = script[-1].progress.cache
    assert text.startswith("# mlxevict chat with SmolLM2-135M-Instruct")
    assert "## You\n\nWhat is 17 times 3?" in text
    assert "<details><summary>Reasoning</summary>" in text and "17 times 3 is 51" in text
    assert "The answer is **51**." in text
    assert "## Cache statistics" in text
    assert f"| evicted | {final.evicted} |" in text and f"| kept | {final.kept} |" in text


@pilot_test
async def test_small_terminal_hides_the_panel_behind_a_summary_line():
    app = scripted_app(ScriptedSession(think_script()))
    async with app.run_test(size=(60, 16)) as pilot:
        await ask(pilot, "hi")
        await wait_idle(pilot)
        summary = app.query_one("#summary", Static)
        assert not app.query_one(StatsPanel).display
        assert summary.display and 1 <= summary.region.height <= 2
        line = str(summary.render())
        assert "mem 9.5/16.0 GiB" in line and "KV 24/32" in line and "tok/s" in line
        assert app.query_one("#prompt", Input).region.height > 0
        assert last_turn(app).answer_text == ANSWER


def test_batcher_hands_over_at_the_interval_not_per_event():
    now = [0.0]
    batcher = Batcher(interval=0.1, now=lambda: now[0])
    assert not batcher.due()  # nothing pending
    batcher.add(TextChunk("a", "reasoning", 1, 1.0))
    assert batcher.due()  # the first update goes at once
    first = batcher.take()
    assert first == Update(reasoning="a", reasoning_tokens=1, entropies=[1.0])
    for i in range(50):
        batcher.add(TextChunk("b", "answer", i, 0.5))
        now[0] += 0.001
        assert not batcher.due()
    batcher.add(progress_at(50))
    now[0] += 0.1
    assert batcher.due()
    second = batcher.take()
    assert second.answer == "b" * 50 and second.answer_tokens == 50 and second.progress == progress_at(50)


# -- snapshots -------------------------------------------------------------------


def steady_cursor(pilot) -> None:
    """A blinking cursor would make snapshots depend on timing."""
    pilot.app.query_one("#prompt", Input).cursor_blink = False


def test_snapshot_idle(snap_compare):
    app = scripted_app(ScriptedSession(think_script()))
    assert snap_compare(app, terminal_size=SIZE, run_before=steady_cursor)


def test_snapshot_generating(snap_compare):
    script = think_script()
    session = ScriptedSession(script, hold_at=16)  # mid-reasoning

    async def run_before(pilot) -> None:
        steady_cursor(pilot)
        await ask(pilot, "What is 17 times 3?")
        await wait_until(pilot, session.holding.is_set)
        await pilot.pause(0.2)

    assert snap_compare(scripted_app(session), terminal_size=SIZE, run_before=run_before)


def test_snapshot_answered_small_terminal(snap_compare):
    session = ScriptedSession(think_script())

    async def run_before(pilot) -> None:
        steady_cursor(pilot)
        await ask(pilot, "What is 17 times 3?")
        await wait_idle(pilot)

    assert snap_compare(scripted_app(session), terminal_size=(60, 18), run_before=run_before)


# -- the real test model ---------------------------------------------------------

REAL_MAX_TOKENS = 40
SCREENSHOT_ENV = "MLXEVICT_TUI_SCREENSHOT"  # set to e.g. docs/tui.svg to save the app's screen there


@pytest.fixture(scope="module")
def smollm(smollm_path):
    from mlx_lm import load

    return load(str(smollm_path))


def real_session(smollm, **options):
    from mlxevict.generate import ChatSession

    model, tokenizer = smollm
    options = {"policy": "entropy", "budget": 64, "max_tokens": REAL_MAX_TOKENS, "temp": 0.0, "seed": 0, **options}
    return ChatSession(model, tokenizer, **options)


@pytest.mark.slow
@pilot_test
async def test_real_model_answers_and_the_panel_moves(smollm):
    session = real_session(smollm)
    app = make_app(session, model_name="SmolLM2-135M-Instruct")
    async with app.run_test(size=SIZE) as pilot:
        panel = app.query_one(StatsPanel)
        await wait_until(pilot, lambda: panel.memory is not None)
        start_memory = panel.memory
        assert str(panel.query_one("#kv-text", Static).render()) == "empty"
        await ask(pilot, "Name three colours of the rainbow, briefly.")
        await wait_idle(pilot, timeout=240)
        turn = last_turn(app)
        record = app.turns[-1]
        assert record.finished is not None and record.finished.reason in ("stop", "length")
        assert turn.answer_text.strip() and turn.answer_text == record.finished.answer
        assert turn.answer.source.strip()
        assert not app.query(Notice)
        # Memory and KV numbers moved from where they started.
        final = record.finished.progress
        assert panel.last_progress == final
        assert final.memory != start_memory and start_memory.kv_nbytes == 0 < final.memory.kv_nbytes
        assert final.memory.mlx_peak >= final.memory.mlx_active > 0
        assert final.cache.tokens_seen >= final.prompt_tokens + final.generated_tokens - 1 > 64
        assert final.cache.evicted > 0  # budget 64 < tokens seen
        kv = str(panel.query_one("#kv-text", Static).render())
        assert f"kept {final.cache.kept}" in kv and kv != "empty"
        assert final.cache.kept <= final.cache.capacity
        assert final.generated_tokens <= REAL_MAX_TOKENS
        assert len(panel.entropies) > 0
        # The session's own history holds the turn: a second question continues the same cache.
        await ask(pilot, "And one more?")
        await wait_idle(pilot, timeout=240)
        assert app.turns[-1].finished.progress.cache.tokens_seen > final.cache.tokens_seen
        if os.environ.get(SCREENSHOT_ENV):  # the README's screenshot: real model, real numbers
            target = Path(os.environ[SCREENSHOT_ENV])
            steady_cursor(pilot)
            await pilot.pause()
            app.save_screenshot(target.name, path=str(target.parent))


@pytest.mark.slow
@pilot_test
async def test_real_model_escape_stops_generation(smollm):
    session = real_session(smollm, max_tokens=2000, budget=128)
    app = make_app(session, model_name="SmolLM2-135M-Instruct")
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "Write a long story about a lighthouse keeper and the sea.")
        await wait_until(pilot, lambda: app.turns and len(app.turns[-1].answer) > 20, timeout=240)
        await pilot.press("escape")
        await wait_idle(pilot, timeout=60)
        record = app.turns[-1]
        assert record.stopped and record.finished.reason == "interrupted"
        assert record.finished.progress.generated_tokens < 2000
        assert record.answer.strip() and last_turn(app).has_class("-interrupted")
