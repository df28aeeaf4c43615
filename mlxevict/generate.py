"""The generation loop: mlx-lm's ``generate_step`` turned into events a CLI or a TUI shows.

:func:`stream_events` runs one turn: it prefills the prompt in chunks of
``prefill_step_size``, samples with mlx-lm's sampler, splits the decoded text
into reasoning and answer at ``<think>``/``</think>``, and yields
:class:`~mlxevict.events.TextChunk`, :class:`~mlxevict.events.Progress` and one
closing :class:`~mlxevict.events.Finished`. The patched model feeds the
prediction entropy to the evicting caches itself; this loop only reports it.
:class:`~mlxevict.chat_session.ChatSession` keeps the caches across turns and
feeds only new tokens; prompts and think tags are in :mod:`mlxevict.prompts`.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Any, Iterator, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from .cache import EvictingKVCache
from .defaults import DEFAULT_MAX_TOKENS
from .errors import MlxEvictError
from .events import Finished, FinishReason, Progress, TextChunk
from .geometry import context_limit
from .kernels import prediction_entropy_compiled
from .memory import MemoryGuard, memory_snapshot
from .prompts import (  # noqa: F401 (also their old import path)
    THINK_END,
    THINK_START,
    Messages,
    Prompt,
    ThinkSplitter,
    as_wrapper,
    encode_text,
    opens_think,
    prompt_tokens,
    render,
)
from .stats import CacheStats, cache_stats

DEFAULT_TEMP = 0.6  # DeepSeek-R1's recommended sampling for its distills
DEFAULT_TOP_P = 0.95
PREFILL_STEP_SIZE = 256
PROGRESS_EVERY = 8  # tokens between two Progress events

Event = Union[TextChunk, Progress, Finished]


def _evicting(caches: Optional[Sequence[Any]]) -> bool:
    return bool(caches) and any(isinstance(c, EvictingKVCache) for c in caches)


class _Stopped(Exception):
    """Raised from the prefill callback to abandon a prompt when ``stop`` is set."""


def _out_of_memory(err: RuntimeError) -> bool:
    text = str(err).lower()
    return "alloc" in text or "out of memory" in text


def stream_events(
    model: Any,
    tokenizer: Any,
    prompt_or_messages: Prompt,
    *,
    caches: Optional[list[Any]] = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temp: float = DEFAULT_TEMP,
    top_p: float = DEFAULT_TOP_P,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: Optional[int] = None,
    guard: Optional[MemoryGuard] = None,
    prefill_step_size: int = PREFILL_STEP_SIZE,
    progress_every: int = PROGRESS_EVERY,
    chat_template: bool = True,
    in_reasoning: Optional[bool] = None,
    logits_processors: Optional[list] = None,
    stop: Optional[threading.Event] = None,
) -> Iterator[Event]:
    """Generate one turn and yield what a UI shows, ending with one :class:`Finished`.

    Args:
        model: an mlx-lm model (patched by ``make_cache`` when ``caches`` evict).
        tokenizer: its tokenizer (mlx-lm's ``TokenizerWrapper`` or a HF tokenizer).
        prompt_or_messages: a user message (str; the chat template is applied),
            a list of ``{"role", "content"}`` messages, or token ids fed as they are.
        caches: from ``make_cache`` (or mlx-lm's); they are extended in place,
            so a second call continues the same context. ``None``: mlx-lm's ``KVCache``.
        max_tokens: most tokens to generate. Default 4096.
        temp, top_p: sampling, as mlx-lm's ``make_sampler``. Default 0.6, 0.95.
        top_k, min_p: as mlx-lm's ``make_sampler``; 0 turns each off. Default 0, 0.
        seed: seeds MLX's random generator for reproducible sampling.
        guard: a :class:`MemoryGuard`; entered for the turn and checked every few tokens.
        prefill_step_size: prompt tokens per model call. Default 256.
        progress_every: tokens between :class:`Progress` events. Default 8.
        chat_template: apply the chat template to a plain string prompt.
        in_reasoning: whether generation starts inside ``<think>``; default: the
            rendered prompt tells (DeepSeek-R1 templates open the block).
        logits_processors: passed to mlx-lm's ``generate_step``.
        stop: set it (from any thread) to end the turn soon as ``"interrupted"``,
            also during the prompt.

    Yields:
        ``TextChunk`` per decoded piece, ``Progress`` after the prompt and every
        ``progress_every`` tokens, and a final ``Finished`` whose reason is
        ``"stop"`` (end-of-sequence), ``"length"`` (``max_tokens`` or the context
        limit), ``"memory"`` (the guard) or ``"interrupted"`` (Ctrl-C or ``stop``). The text
        produced before a stop is always kept.

    Raises:
        MlxEvictError: empty prompt, or a prompt longer than the model's context limit.
    """
    tokenizer = as_wrapper(tokenizer)
    tokens, text = prompt_tokens(tokenizer, prompt_or_messages, chat_template=chat_template)
    if max_tokens < 1:
        raise MlxEvictError(f"max_tokens={max_tokens} must be at least 1")
    start = caches[0].offset if caches else 0
    limit = context_limit(model)
    note = ""
    if limit:
        if start + len(tokens) >= limit:
            raise MlxEvictError(
                f"the prompt{' and the conversation so far take' if start else ' takes'} {start + len(tokens)} tokens, "
                f"but the model's context limit is {limit}; shorten the prompt"
                + (" or reset the conversation" if start else "")
            )
        if start + len(tokens) + max_tokens > limit:
            max_tokens = limit - start - len(tokens)
            note = f"stopped at the model's context limit of {limit} tokens"
    caches = caches if caches is not None else make_prompt_cache(model)
    tags = (tokenizer.think_start, tokenizer.think_end) if tokenizer.has_thinking else (THINK_START, THINK_END)
    if in_reasoning is None:
        in_reasoning = opens_think(text, *tags)
    splitter = ThinkSplitter(in_reasoning, *tags)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    if seed is not None:
        mx.random.seed(seed)
    mx.reset_peak_memory()

    parts: dict[str, list[str]] = {"reasoning": [], "answer": []}
    generated: list[int] = []
    clock = {"start": time.perf_counter(), "prompt_done": None}

    def on_prompt(done: int, total: int) -> None:
        if done == total:
            clock["prompt_done"] = time.perf_counter()
        elif stop is not None and stop.is_set():
            raise _Stopped

    def progress() -> Progress:
        now = time.perf_counter()
        done = clock["prompt_done"] or now
        prompt_s = max(done - clock["start"], 1e-9)
        decode_s = now - done
        stats: Optional[CacheStats] = cache_stats(caches) if _evicting(caches) else None
        return Progress(
            prompt_tokens=len(tokens),
            generated_tokens=len(generated),
            prompt_tokens_per_s=len(tokens) / prompt_s,
            tokens_per_s=(len(generated) - 1) / decode_s if len(generated) > 1 and decode_s > 0 else 0.0,
            cache=stats,
            memory=memory_snapshot(caches),
        )

    def chunks(pieces, token: int, entropy: float) -> Iterator[TextChunk]:
        for kind, piece in pieces:
            parts[kind].append(piece)
            yield TextChunk(piece, kind, token, entropy)

    steps = generate_step(
        mx.array(tokens),
        model,
        max_tokens=max_tokens,
        sampler=make_sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k),
        logits_processors=logits_processors,
        prompt_cache=caches,
        prefill_step_size=prefill_step_size,
        prompt_progress_callback=on_prompt,
    )
    reason: FinishReason = "length"
    message = note
    eos = tokenizer.eos_token_ids
    token, entropy = -1, 0.0
    try:
        with guard if guard is not None else nullcontext():
            for token, logprobs in steps:
                generated.append(token)
                if len(generated) == 1:
                    yield progress()
                if token in eos:
                    reason, message = "stop", ""
                    break
                # logprobs were evaluated with the token, so this adds one small reduction, not a stall.
                entropy = prediction_entropy_compiled(logprobs).item()
                detokenizer.add_token(token)
                yield from chunks(splitter.feed(detokenizer.last_segment), token, entropy)
                if guard is not None and len(generated) % guard.check_every == 0:
                    message = guard.check()
                    if message:
                        reason = "memory"
                        break
                if stop is not None and stop.is_set():
                    reason, message = "interrupted", "stopped"
                    break
                if len(generated) % progress_every == 0:
                    yield progress()
    except KeyboardInterrupt:
        reason, message = "interrupted", "stopped by Ctrl-C"
    except _Stopped:
        reason, message = "interrupted", "stopped"
    except RuntimeError as err:
        if not _out_of_memory(err):
            raise
        reason, message = "memory", f"MLX could not allocate memory ({err}); lower --budget or use a smaller model"
    finally:
        steps.close()
    detokenizer.finalize()
    yield from chunks(splitter.feed(detokenizer.last_segment) + splitter.flush(), token, entropy)
    yield Finished(
        reason=reason,
        reasoning="".join(parts["reasoning"]),
        answer="".join(parts["answer"]),
        progress=progress(),
        message=message,
        tokens=tuple(generated),
    )


def __getattr__(name: str) -> Any:
    # ``from mlxevict.generate import ChatSession`` keeps working; it lives in chat_session.py,
    # which imports this module, so it is looked up on first use.
    if name == "ChatSession":
        from .chat_session import ChatSession

        return ChatSession
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
