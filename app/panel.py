"""The live panel: unified memory, the KV cache, speed, prediction entropy, policy and budget.

The panel only shows numbers it is given (``Progress`` events from the worker,
and at idle a ``memory_source`` it polls), so tests and snapshots can fix them.
"""

from __future__ import annotations

from collections import deque
from statistics import fmean
from typing import Any, Callable, Optional

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Sparkline, Static

from mlxevict.events import Progress
from mlxevict.policies import DEFAULT_POLICY
from mlxevict.kvstorage import bits_label
from mlxevict.stats import CacheStats
from mlxevict.memory import MemorySnapshot

from .gauges import GiB, Gauge, Segment, format_bytes, format_count, scale_line

MemorySource = Callable[[], Optional[MemorySnapshot]]

IDLE_POLL_S = 1.0  # how often the idle panel re-reads memory
ENTROPY_HISTORY = 512  # entropies kept for the sparkline


class Section(Vertical):
    """A bordered group of panel lines with a title."""

    def __init__(self, title: str, *children, id: str | None = None) -> None:
        super().__init__(*children, id=id, classes="section")
        self.border_title = title


class StatsPanel(VerticalScroll):
    """The right-hand panel. Call :meth:`show_progress`, :meth:`add_entropies`, :meth:`show_settings`.

    Args:
        memory_source: returns a fresh ``MemorySnapshot`` (or None); polled every
            ``IDLE_POLL_S`` seconds while no turn runs. None: show only what turns report.
    """

    def __init__(self, memory_source: MemorySource | None = None, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.memory_source = memory_source
        self.entropies: deque[float] = deque(maxlen=ENTROPY_HISTORY)
        self.generating = False
        self.last_progress: Progress | None = None
        self.memory: MemorySnapshot | None = None

    def compose(self) -> ComposeResult:
        yield Section(
            "Unified memory",
            Gauge(id="mem-gauge"),
            Static(id="mem-scale", classes="scale"),
            Static("waiting for the first reading", id="mem-text"),
            id="memory",
        )
        yield Section(
            "KV cache",
            Static(id="kv-policy"),
            Gauge(alarm=False, id="kv-gauge"),
            Static("empty", id="kv-text"),
            id="kv",
        )
        yield Section("Speed", Static("idle", id="speed-text"), id="speed")
        yield Section(
            "Prediction entropy",
            Sparkline([], id="entropy-spark", summary_function=fmean),
            Static("no tokens yet", id="entropy-text"),
            id="entropy",
        )

    def on_mount(self) -> None:
        if self.memory_source is not None:
            self.poll_memory()
            self.set_interval(IDLE_POLL_S, self.poll_memory)

    def on_resize(self) -> None:
        if self.memory is not None:
            self.show_memory(self.memory)

    def poll_memory(self) -> None:
        """Read the memory source while idle (during a turn, ``Progress`` brings memory)."""
        if self.generating or self.memory_source is None:
            return
        snapshot = self.memory_source()
        if snapshot is not None:
            self.show_memory(snapshot)

    # -- updates -----------------------------------------------------------------

    def show_settings(
        self, policy: str, budget: int, pending: Any = None, *, asked: str = "", storage: str = ""
    ) -> None:
        """The policy and budget in use (``asked``: the budget as written, such as ``1.5GB``; ``storage``:
        ``"5/3-bit"``), and a change waiting for the next turn (a ``Choice`` or ``(policy, budget)``)."""
        shown = f"default ({DEFAULT_POLICY})" if policy == "default" else policy
        text = f"[b]{shown}[/b] · budget {format_count(budget)}" + (f" ({asked})" if asked else "")
        text += f" · {storage}" if storage else ""
        if pending is not None:
            next_policy, next_budget = (pending.policy, pending.budget) if hasattr(pending, "policy") else pending
            next_storage = getattr(pending, "storage", None)
            stored = f" · {next_storage.label}" if next_storage is not None and next_storage.quantized else ""
            if (next_policy, str(next_budget), stored) != (policy, str(budget), f" · {storage}" if storage else ""):
                text += f"\n[i]next turn:[/i] [b]{next_policy}[/b] · {next_budget}{stored}"
        self.query_one("#kv-policy", Static).update(text)

    def show_progress(self, progress: Progress) -> None:
        """Memory, KV cache and speed from one ``Progress`` event."""
        self.last_progress = progress
        self.show_memory(progress.memory)
        self.show_cache(progress.cache)
        self.show_speed(progress)

    def show_memory(self, m: MemorySnapshot) -> None:
        self.memory = m
        used = max(0, m.system_used)
        others = max(0, used - m.mlx_active)
        gauge = self.query_one("#mem-gauge", Gauge)
        gauge.set(
            (Segment(m.mlx_active, "gauge--primary"), Segment(others, "gauge--secondary")),
            total=m.system_total,
            marker=m.mlx_peak or None,
        )
        width = gauge.size.width or 30
        self.query_one("#mem-scale", Static).update(scale_line(m.system_total, width))
        self.query_one("#mem-text", Static).update(
            f"system [b]{format_bytes(used)}[/b] of {format_bytes(m.system_total)}\n"
            f"MLX active [b]{format_bytes(m.mlx_active)}[/b] · peak {format_bytes(m.mlx_peak)}\n"
            f"MLX cache {format_bytes(m.mlx_cache)} · RSS {format_bytes(m.process_rss)}"
        )

    def show_cache(self, c: CacheStats | None) -> None:
        gauge = self.query_one("#kv-gauge", Gauge)
        text = self.query_one("#kv-text", Static)
        if c is None:
            gauge.set((), 0)
            text.update("mlx-lm's own cache (no eviction)")
            return
        gauge.set((Segment(c.kept, "gauge--primary"),), total=max(c.capacity, 1), marker=c.effective_budget)
        saved = c.saved_nbytes
        share = f" ({saved / c.full_nbytes:.0%})" if c.full_nbytes else ""
        # Quantized storage saves bytes too: say so, or the saving reads as eviction alone.
        storage = f" ({bits_label(c.kv_bits)})" if c.kv_bits else ""
        disk = f"\non disk {format_bytes(c.disk_nbytes)} · read {format_bytes(c.read_nbytes)}" if c.disk_nbytes else ""
        text.update(
            f"kept [b]{format_count(c.kept)}[/b] / {format_count(c.capacity)} slots\n"
            f"evicted [b]{format_count(c.evicted)}[/b] of {format_count(c.tokens_seen)} seen\n"
            f"KV {format_bytes(c.nbytes)}{storage} · full {format_bytes(c.full_nbytes)}\n"
            f"saved [b]{format_bytes(saved)}[/b]{share}{disk}"
        )

    def show_speed(self, p: Progress) -> None:
        self.query_one("#speed-text", Static).update(
            f"prompt {format_count(p.prompt_tokens)} tok · {p.prompt_tokens_per_s:,.0f} tok/s\n"
            f"output {format_count(p.generated_tokens)} tok · [b]{p.tokens_per_s:,.1f}[/b] tok/s"
        )

    def add_entropies(self, values: list[float]) -> None:
        """Append prediction entropies (nats) to the sparkline."""
        if not values:
            return
        self.entropies.extend(values)
        spark = self.query_one("#entropy-spark", Sparkline)
        width = max(1, spark.size.width or 30)
        # Two tokens per cell, averaged: recent history, not the whole turn squeezed.
        spark.data = list(self.entropies)[-2 * width :]
        recent = list(self.entropies)[-32:]
        self.query_one("#entropy-text", Static).update(
            f"now [b]{values[-1]:.2f}[/b] nats · mean {fmean(recent):.2f} (last {len(recent)})"
        )

    def clear_turn_numbers(self) -> None:
        """After the conversation is cleared: no entropies, an empty cache."""
        self.entropies.clear()
        self.last_progress = None
        self.query_one("#entropy-spark", Sparkline).data = []
        self.query_one("#entropy-text", Static).update("no tokens yet")
        self.query_one("#kv-gauge", Gauge).set((), 0)
        self.query_one("#kv-text", Static).update("empty")
        self.query_one("#speed-text", Static).update("idle")

    def summary(self) -> str:
        """One line for a narrow terminal, where the panel is hidden."""
        parts = []
        if self.memory is not None:
            m = self.memory
            used = max(0, m.system_used)
            parts.append(f"mem {used / GiB:.1f}/{format_bytes(m.system_total)}")
        p = self.last_progress
        if p is not None:
            if p.cache is not None:
                parts.append(f"KV {p.cache.kept}/{p.cache.capacity} ({p.cache.evicted} evicted)")
            parts.append(f"{p.tokens_per_s:.1f} tok/s")
        if self.entropies:
            parts.append(f"H {self.entropies[-1]:.2f}")
        return " · ".join(parts)
