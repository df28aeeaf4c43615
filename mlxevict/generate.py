"""The generation loop: mlx-lm's ``generate_step`` turned into events a CLI or a TUI shows.

:func:`stream_events` runs one turn: it prefills the prompt in chunks of
``prefill_step_size``, samples with mlx-lm's sampler, splits the decoded text
into reasoning and answer at ``<think>``/``</think>``, and yields
:class:`~mlxevict.events.TextChunk`, :class:`~mlxevict.events.Progress` and one
closing :class:`~mlxevict.events.Finished`. The patched model feeds the
prediction entropy to the evicting caches itself; this loop only reports it.
:class:`ChatSession` keeps the caches across turns and feeds only new tokens.
"""

from __future__ import annotations

import gc
import threading
import time
from contextlib import nullcontext
from typing import Any, Iterator, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .cache import DEFAULT_BUDGET, EvictingKVCache
from .defaults import DEFAULT_MAX_TOKENS
from .errors import MlxEvictError
from .events import Finished, FinishReason, Progress, TextChunk, TextKind
from .kernels import prediction_entropy_compiled
from .make import make_cache
from .stats import CacheStats, cache_stats
from .telemetry import MemoryGuard, memory_snapshot

DEFAULT_TEMP = 0.6  # DeepSeek-R1's recommended sampling for its distills
DEFAULT_TOP_P = 0.95
PREFILL_STEP_SIZE = 256
PROGRESS_EVERY = 8  # tokens between two Progress events
THINK_START, THINK_END = "<think>", "</think>"
_TAIL_TOKENS = 64  # prompt tokens decoded to see whether the template opened a think block

Event = Union[TextChunk, Progress, Finished]
Messages = Sequence[dict]
Prompt = Union[str, Messages, Sequence[int], mx.array]


class ThinkSplitter:
    """Splits streamed text into reasoning and answer at the think tags.

    Text arrives in arbitrary pieces, so a tag split across pieces (``"</thi"``
    + ``"nk>"``) is held back until it is complete. Tags are dropped, and so is
    the whitespace right after a tag.

    Args:
        in_reasoning: the prompt ended inside an open think block.
        start, end: the tags. Default ``<think>`` and ``</think>``.
    """

    def __init__(self, in_reasoning: bool = False, start: str = THINK_START, end: str = THINK_END):
        self.kind: TextKind = "reasoning" if in_reasoning else "answer"
        self.start, self.end = start, end
        self._pending = ""
        self._strip = in_reasoning

    def feed(self, text: str) -> list[tuple[TextKind, str]]:
        """Pieces ``(kind, text)`` ready to show; part of a tag may stay pending."""
        out: list[tuple[TextKind, str]] = []
        buffer = self._pending + text
        while True:
            tag = self.end if self.kind == "reasoning" else self.start
            at = buffer.find(tag)
            if at < 0:
                break
            self._emit(out, buffer[:at])
            self.kind = "answer" if self.kind == "reasoning" else "reasoning"
            self._strip = True
            buffer = buffer[at + len(tag) :]
        keep = next((k for k in range(min(len(tag) - 1, len(buffer)), 0, -1) if tag.startswith(buffer[-k:])), 0)
        self._emit(out, buffer[: len(buffer) - keep])
        self._pending = buffer[len(buffer) - keep :]
        return out

    def flush(self) -> list[tuple[TextKind, str]]:
        """Whatever is pending (a partial tag that never completed is text)."""
        out: list[tuple[TextKind, str]] = []
        self._emit(out, self._pending)
        self._pending = ""
        return out

    def _emit(self, out: list, text: str) -> None:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        if text:
            out.append((self.kind, text))


def opens_think(text: str, start: str = THINK_START, end: str = THINK_END) -> bool:
    """Whether ``text`` (a rendered prompt) ends inside an open think block."""
    return text.rfind(start) > text.rfind(end)


def as_wrapper(tokenizer: Any) -> TokenizerWrapper:
    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def encode_text(tokenizer: TokenizerWrapper, text: str) -> list[int]:
    """Tokens of a rendered prompt; BOS is added only when the text does not start with it."""
    bos = tokenizer.bos_token
    return tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos))


def render(tokenizer: TokenizerWrapper, messages: Messages, *, add_generation_prompt: bool = True) -> str:
    """The chat template applied to ``messages``, as text."""
    if not tokenizer.has_chat_template:
        raise MlxEvictError("this model has no chat template; pass the prompt as plain text instead of messages")
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False)


def prompt_tokens(tokenizer: TokenizerWrapper, prompt: Prompt, *, chat_template: bool = True) -> tuple[list[int], str]:
    """``(tokens, text)`` of a prompt: a user message, a message list, or token ids.

    A string becomes one user message under the chat template (when the model
    has one and ``chat_template``); ``text`` is the rendered prompt (for token
    ids, the decoded tail), used to see whether the template opened ``<think>``.

    Raises:
        MlxEvictError: the prompt is empty.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise MlxEvictError("empty prompt: give some text with -p or on stdin")
        text = prompt
        if chat_template and tokenizer.has_chat_template:
            text = render(tokenizer, [{"role": "user", "content": prompt}])
        return encode_text(tokenizer, text), text
    if isinstance(prompt, mx.array):
        prompt = prompt.tolist()
    prompt = list(prompt)
    if prompt and isinstance(prompt[0], dict):
        if not any(str(m.get("content", "")).strip() for m in prompt):
            raise MlxEvictError("empty prompt: every message is empty")
        text = render(tokenizer, prompt)
        return encode_text(tokenizer, text), text
    if not prompt:
        raise MlxEvictError("empty prompt: no tokens")
    tokens = [int(t) for t in prompt]
    return tokens, tokenizer.decode(tokens[-_TAIL_TOKENS:])


def _evicting(caches: Optional[Sequence[Any]]) -> bool:
    return bool(caches) and any(isinstance(c, EvictingKVCache) for c in caches)


def _context_limit(model: Any) -> Optional[int]:
    return getattr(getattr(model, "args", None), "max_position_embeddings", None)


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
    limit = _context_limit(model)
    note = ""
    if limit:
        if start + len(tokens) >= limit:
            raise MlxEvictError(
                f"the prompt{' and the conversation so far' if start else ''} take {start + len(tokens)} tokens, "
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


def _cache_error(err: ValueError) -> MlxEvictError:
    return err if isinstance(err, MlxEvictError) else MlxEvictError(str(err))


class ChatSession:
    """A multi-turn chat that keeps the KV caches across turns.

    Each :meth:`send` feeds only the tokens the caches have not seen: the end of
    the previous assistant turn and the new user message, as the chat template
    writes them. :meth:`configure` changes policy or budget for the next turn
    (the conversation is fed again into fresh caches); :meth:`reset` clears the
    conversation and frees the caches.

    Args:
        model, tokenizer: from ``mlx_lm.load`` (or :func:`mlxevict.resolve.load_model`).
        policy, budget: the evicting cache's; see ``make_cache``. Default policy
            ``"default"``, budget 2048.
        system: an optional system message.
        max_tokens, temp, top_p, top_k, min_p, seed, guard: per turn, see :func:`stream_events`.
        cache_options: ``sinks``, ``window``, ``slack``, ``prompt_mode`` for ``make_cache``.

    Raises:
        MlxEvictError: a policy or budget that cannot work.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        policy: str = "default",
        budget: int = DEFAULT_BUDGET,
        system: Optional[str] = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        temp: float = DEFAULT_TEMP,
        top_p: float = DEFAULT_TOP_P,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: Optional[int] = None,
        guard: Optional[MemoryGuard] = None,
        **cache_options: Any,
    ):
        self.model, self.tokenizer = model, as_wrapper(tokenizer)
        self.system = system
        self.max_tokens, self.temp, self.top_p, self.guard = max_tokens, temp, top_p, guard
        self.top_k, self.min_p = top_k, min_p
        self.messages: list[dict] = []
        self.caches: Optional[list[Any]] = None
        self._seed = seed
        self._last_tokens: tuple[int, ...] = ()
        self._refeed = False
        self._stop = threading.Event()
        self.policy, self.budget, self.cache_options = policy, budget, dict(cache_options)
        self._new_caches()

    def _new_caches(self) -> None:
        try:
            self.caches = make_cache(self.model, self.policy, self.budget, **self.cache_options)
        except ValueError as err:
            raise _cache_error(err) from None

    def configure(self, *, policy: Optional[str] = None, budget: Optional[int] = None, **cache_options: Any) -> None:
        """Use another policy, budget or cache option from the next turn on.

        The conversation so far is fed again into the new caches at the next
        :meth:`send`, so the model keeps its context.

        Raises:
            MlxEvictError: the new settings cannot work (the old ones stay).
        """
        old = (self.policy, self.budget, dict(self.cache_options), self.caches)
        self.policy = policy or self.policy
        self.budget = budget or self.budget
        self.cache_options.update(cache_options)
        try:
            self._new_caches()
        except MlxEvictError:
            self.policy, self.budget, self.cache_options, self.caches = old
            raise
        self._refeed = bool(self.messages)
        self._free()

    def set_policy(self, policy: str, budget: int) -> None:
        """Policy and budget for the next turn (the TUI's name for :meth:`configure`)."""
        self.configure(policy=policy, budget=budget)

    def stop(self) -> None:
        """End the running turn soon with ``Finished("interrupted")``; safe from another thread."""
        self._stop.set()

    def reset(self) -> None:
        """Forget the conversation and free the caches' memory."""
        self.messages = []
        self._last_tokens = ()
        self._refeed = False
        self._new_caches()
        self._free()

    @staticmethod
    def _free() -> None:
        gc.collect()
        mx.clear_cache()

    @property
    def stats(self) -> Optional[CacheStats]:
        return cache_stats(self.caches) if _evicting(self.caches) and self.caches[0].keys is not None else None

    def _history(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def _turn_tokens(self, text: str) -> list[int]:
        """The tokens to feed for a new user message, given what the caches hold."""
        tok = self.tokenizer
        if not tok.has_chat_template:
            return tok.encode(text, add_special_tokens=not self.messages)
        if not self.messages or self._refeed:
            return encode_text(tok, render(tok, [*self._history(), {"role": "user", "content": text}]))
        # Render a probe turn with and without the new message: the difference is the new
        # turn, and what follows the probe reply is how the template closes an assistant turn.
        head = [{"role": "system", "content": self.system}] if self.system else []
        probe = [*head, {"role": "user", "content": "U"}, {"role": "assistant", "content": "\x00reply\x00"}]
        base = render(tok, probe, add_generation_prompt=False)
        full = render(tok, [*probe, {"role": "user", "content": text}])
        if not full.startswith(base) or "\x00reply\x00" not in base:
            # A template that rewrites history: render the new message alone, as mlx_lm.chat does.
            return encode_text(tok, render(tok, [{"role": "user", "content": text}]))
        close = base[base.index("\x00reply\x00") + len("\x00reply\x00") :]
        if self._last_tokens and self._last_tokens[-1] in tok.eos_token_ids:
            eos_text = tok.decode([self._last_tokens[-1]])
            close = close[len(eos_text) :] if close.startswith(eos_text) else close
        return tok.encode(close + full[len(base) :], add_special_tokens=False)

    def send(self, text: str, **overrides: Any) -> Iterator[Event]:
        """Stream one turn for the user message ``text``; see :func:`stream_events`.

        Args:
            text: the user message.
            overrides: per-turn ``max_tokens``, ``temp``, ``top_p``, ``seed``.

        Raises:
            MlxEvictError: empty message, or the conversation outgrew the model's context.
        """
        if not text.strip():
            raise MlxEvictError("empty message")
        tokens = self._turn_tokens(text)
        options = dict(max_tokens=self.max_tokens, temp=self.temp, top_p=self.top_p, seed=self._seed)
        options.update(top_k=self.top_k, min_p=self.min_p)
        options.update(overrides)
        self._stop.clear()
        events = stream_events(
            self.model, self.tokenizer, tokens, caches=self.caches, guard=self.guard, stop=self._stop, **options
        )
        first = next(events)  # raises here (context limit) before the turn counts
        self._seed = None  # seed once per session, so later turns differ
        self._refeed = False
        answer: list[str] = []
        finished: Optional[Finished] = None
        try:
            for event in _chain(first, events):
                if isinstance(event, TextChunk) and event.kind == "answer":
                    answer.append(event.text)
                elif isinstance(event, Finished):
                    finished = event
                yield event
        finally:
            # Also when the caller stops iterating: the caches hold the turn, so the history must too.
            events.close()
            self._last_tokens = finished.tokens if finished else ()
            reply = finished.answer if finished else "".join(answer)
            self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]


def _chain(first: Event, rest: Iterator[Event]) -> Iterator[Event]:
    yield first
    yield from rest
