"""The conversation as Markdown, with per-turn numbers and the cache statistics."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Optional, Sequence

from mlxevict.events import Finished
from mlxevict.kvstorage import bits_label
from mlxevict.stats import CacheStats

from .gauges import format_bytes, format_count


@dataclass
class TurnRecord:
    """One exchange as the transcript keeps it."""

    user: str
    reasoning: str = ""
    answer: str = ""
    finished: Optional[Finished] = None
    error: str = ""
    stopped: bool = False


def render_transcript(
    turns: Sequence[TurnRecord], *, model_name: str, policy: str, budget: int, saved_at: datetime
) -> str:
    """Markdown for the whole conversation.

    Each model turn has its reasoning in a ``<details>`` block, its answer, and
    one line of numbers; the end has a table of the last cache statistics.
    """
    lines = [
        f"# mlxevict chat with {model_name}",
        "",
        f"Saved {saved_at:%Y-%m-%d %H:%M} · policy `{policy}` · budget {format_count(budget)} tokens",
        "",
    ]
    last_cache: CacheStats | None = None
    for turn in turns:
        lines += ["## You", "", turn.user, "", "## Model", ""]
        if turn.reasoning.strip():
            lines += ["<details><summary>Reasoning</summary>", "", turn.reasoning.strip(), "", "</details>", ""]
        if turn.answer.strip():
            lines += [turn.answer.strip(), ""]
        if turn.error:
            lines += [f"> **Error:** {turn.error}", ""]
        if turn.finished is not None:
            lines += [f"*{turn_numbers(turn)}*", ""]
            last_cache = turn.finished.progress.cache or last_cache
    lines += ["## Cache statistics", ""]
    lines += cache_table(last_cache) if last_cache is not None else ["No evicting cache was used.", ""]
    return "\n".join(lines)


def turn_numbers(turn: TurnRecord) -> str:
    """One line: why it stopped, tokens, speed, what the KV cache held."""
    f = turn.finished
    reason = "interrupted" if turn.stopped else f.reason
    p = f.progress
    parts = [
        reason,
        f"{format_count(p.prompt_tokens)} prompt + {format_count(p.generated_tokens)} generated tokens",
        f"{p.tokens_per_s:.1f} tok/s",
    ]
    if p.cache is not None:
        c = p.cache
        parts.append(f"KV kept {format_count(c.kept)}/{format_count(c.capacity)}, evicted {format_count(c.evicted)}")
    if f.message and reason != "interrupted":
        parts.append(f.message)
    return " · ".join(parts)


def cache_table(c: CacheStats) -> list[str]:
    share = f" ({c.saved_nbytes / c.full_nbytes:.0%})" if c.full_nbytes else ""
    rows = [
        ("policy", c.policy),
        ("budget", format_count(c.budget)),
        ("effective budget", format_count(c.effective_budget)),
        ("capacity (slots per layer)", format_count(c.capacity)),
        ("kept", format_count(c.kept)),
        ("evicted", format_count(c.evicted)),
        ("tokens seen", format_count(c.tokens_seen)),
        ("KV storage", storage_text(c)),
        ("KV bytes", format_bytes(c.nbytes)),
        ("full cache would be", format_bytes(c.full_nbytes)),
        ("saved", format_bytes(c.saved_nbytes) + share),
    ]
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]


def storage_text(c: CacheStats) -> str:
    """How the kept entries are stored: the model's dtype, or quantized with a full-precision window."""
    if not c.kv_bits:
        return "model dtype"
    precision = f"{c.window_bits}-bit" if c.window_bits else "full precision"
    return f"{bits_label(c.kv_bits)}, newest {format_count(c.full_precision_window or 0)} tokens in {precision}"


def save_transcript(text: str, directory: Path, saved_at: datetime) -> Path:
    """Write ``mlxevict-chat-YYYYMMDD-HHMMSS.md`` in ``directory``; returns the path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"mlxevict-chat-{saved_at:%Y%m%d-%H%M%S}.md"
    path.write_text(text, encoding="utf-8")
    return path
