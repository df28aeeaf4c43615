"""What the generation loop yields: frozen dataclasses a CLI or a TUI can show."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Tuple

from .stats import CacheStats
from .memory import MemorySnapshot

TextKind = Literal["reasoning", "answer"]
FinishReason = Literal["stop", "length", "memory", "interrupted"]


@dataclass(frozen=True)
class TextChunk:
    """Newly decoded text, and whether it belongs to the reasoning or the answer."""

    text: str
    kind: TextKind
    token: int
    prediction_entropy: float  # H(p_t) in nats of the distribution this token came from


@dataclass(frozen=True)
class Progress:
    """Live numbers, yielded every few tokens (and once after the prompt)."""

    prompt_tokens: int
    generated_tokens: int
    prompt_tokens_per_s: float
    tokens_per_s: float
    cache: Optional[CacheStats]  # None for mlx-lm's own caches
    memory: MemorySnapshot


@dataclass(frozen=True)
class Finished:
    """The last event of a turn: why it stopped, the text, the final numbers."""

    reason: FinishReason
    reasoning: str
    answer: str
    progress: Progress
    message: str = ""  # e.g. what the memory guard saw
    tokens: Tuple[int, ...] = ()  # the generated token ids, end-of-sequence included
