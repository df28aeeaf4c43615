"""The server's generation worker: one thread runs the requests in order, each within its KV budget.

HTTP threads :meth:`Engine.submit` a checked request and read its :class:`Job`'s
queue: first ``STARTED`` (or an :class:`ApiError`, before anything was sent),
then :class:`Piece` s of reasoning and answer, then one :class:`Done`. All MLX
work happens on the worker thread (mlx-lm's generation stream is per thread).

A chat request whose messages continue a kept conversation takes that
conversation's :class:`~mlxevict.generate.ChatSession` from the
:class:`~mlxevict.server.store.ConversationStore` and feeds only the new turn;
otherwise a new session reads the whole conversation. A cancelled job (the
client went away) stops within a token and its caches are freed.
"""

from __future__ import annotations

import gc
import queue
import threading
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Iterator, Optional, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k

from ..errors import MlxEvictError
from ..events import Finished, TextChunk
from ..chat_session import ChatSession
from ..generate import stream_events
from ..make import make_cache
from ..policies import policy_names
from ..memory import MemoryGuard
from .protocol import ApiError, CompletionRequest, Defaults, Usage
from .stops import StopMatcher
from .store import ConversationStore, conversation_key, session_key

STARTED = "started"


@dataclass(frozen=True)
class Piece:
    """Text to send: ``kind`` is ``"reasoning"`` or ``"answer"``."""

    kind: str
    text: str


@dataclass(frozen=True)
class Done:
    """The end of an answer: OpenAI's ``finish_reason`` and the numbers."""

    finish_reason: str  # "stop" or "length" (max_tokens, the context, or the memory guard)
    usage: Usage


class Job:
    """One request on its way through the worker; :meth:`cancel` is safe from any thread."""

    def __init__(self, request: CompletionRequest):
        self.request = request
        self.events: "queue.Queue[Any]" = queue.Queue()
        self.cancelled = threading.Event()
        self._stop: Callable[[], None] = lambda: None
        self._lock = threading.Lock()

    def cancel(self) -> None:
        """Stop generating (within a token) and free the caches; nothing more is sent."""
        with self._lock:
            self.cancelled.set()
            self._stop()

    def _stopper(self, stop: Callable[[], None]) -> None:
        with self._lock:
            self._stop = stop
            if self.cancelled.is_set():
                stop()


def _free() -> None:
    gc.collect()
    mx.clear_cache()


class Engine:
    """Runs completion requests one at a time on a worker thread.

    Args:
        model, tokenizer: from ``mlx_lm.load`` (or :func:`mlxevict.resolve.load_model`).
        defaults: the server's sampling defaults and budget limit.
        budget_tokens: turns a request's ``budget`` text (``"512"``, ``"64MB"``) into tokens.
        cache_options: ``make_cache``'s options besides policy and budget (sinks, window, storage).
        store: where finished conversations wait for their next turn.
        guard: stops a request before the machine swaps (and then frees the kept conversations).
        logits_processors: makes the logits processors every request starts with (called once per
            request, so a processor may keep state for one answer); the request's own options follow.
        log: called with one line per request.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        defaults: Defaults,
        budget_tokens: Callable[[str], int],
        cache_options: dict,
        store: ConversationStore,
        guard: Optional[MemoryGuard] = None,
        logits_processors: Callable[[], Sequence[Callable]] = tuple,
        log: Callable[[str], None] = lambda line: None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.defaults, self.budget_tokens = defaults, budget_tokens
        self.cache_options, self.store, self.guard = dict(cache_options), store, guard
        self.logits_processors, self.log = logits_processors, log
        self.vocab_size = getattr(getattr(model, "args", None), "vocab_size", None)
        self.counts = {"served": 0, "cancelled": 0, "failed": 0}
        self.last: dict = {}
        self.busy = False
        self._jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._current: Optional[Job] = None
        self._turn_stop: Any = None  # the running turn's stop (``_new_stop``)
        self._closing = False
        self._thread = threading.Thread(target=self._work, name="mlxevict-generate", daemon=True)
        self._thread.start()

    # -- what HTTP threads call

    def submit(self, request: CompletionRequest) -> Job:
        """Queue ``request``; read the returned job's ``events``."""
        if self._closing:
            raise ApiError("the server is shutting down", status=503)
        job = Job(request)
        self._jobs.put(job)
        return job

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing

    def close(self, timeout: float = 10.0) -> None:
        """Cancel the running and queued requests and stop the worker."""
        self._closing = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.events.put(ApiError("the server is shutting down", status=503))
        if self._current is not None:
            self._current.cancel()
        self._jobs.put(None)
        self._thread.join(timeout)

    # -- the worker thread

    def _work(self) -> None:
        while True:
            job = self._take()
            if job is None:
                return
            self._current, self.busy = job, True
            try:
                self._run(job)
            except ApiError as err:
                self.counts["failed"] += 1
                job.events.put(err)
            except Exception as err:  # a bug or MLX failure must not kill the worker for later requests
                self.counts["failed"] += 1
                job.events.put(ApiError(f"generation failed: {type(err).__name__}: {err}", status=500))
                if self._fatal(err):
                    return
                self.log(f"error: {type(err).__name__}: {err}")
            finally:
                self._current, self.busy = None, False

    # -- what a sharded engine (server/ranks.py) replaces

    def _take(self) -> Optional[Job]:
        """The next job to run, ``None`` to stop; queued jobs whose client left are skipped."""
        while (job := self._jobs.get()) is not None and job.cancelled.is_set():
            self.counts["cancelled"] += 1
        return job

    def _fatal(self, err: Exception) -> bool:
        """Whether ``err`` ends the worker (alone: never; the request fails with a 500)."""
        return False

    def _new_stop(self) -> Any:
        """What stops a turn: ``set()`` from any thread, ``is_set()`` read by the generation loop."""
        return threading.Event()

    def _stop_sequence(self, job: Job) -> None:
        """End the turn: a stop sequence was found (at the same token on every rank)."""
        job._stop()

    def _cancelled(self, job: Job, finished: Optional[Finished], stopped: bool) -> bool:
        """Whether the turn ended because its client left (its caches are then freed, not kept)."""
        return job.cancelled.is_set() or finished is None

    def _rank_numbers(self, finished: Finished) -> dict:
        """Extra ``usage.mlxevict`` numbers (a sharded engine: every rank's KV bytes)."""
        return {}

    def _settings(self, r: CompletionRequest) -> tuple[str, int]:
        if r.policy not in policy_names():
            raise ApiError(f"unknown policy {r.policy!r}; use one of: {', '.join(policy_names())}", param="policy")
        if r.budget is None:
            return r.policy, self.defaults.budget
        try:
            budget = self.budget_tokens(r.budget)
        except MlxEvictError as err:
            raise ApiError(str(err).replace("--budget", "budget"), param="budget") from None
        if budget > self.defaults.budget:
            raise ApiError(
                f"budget {r.budget} ({budget} tokens) is over this server's limit of {self.defaults.budget} "
                "tokens; ask for less or restart the server with a larger --budget", param="budget",
            )
        return r.policy, budget

    def _processors(self, r: CompletionRequest) -> list[Callable]:
        processors = list(self.logits_processors())
        vocab = self.vocab_size
        if r.logit_bias:
            if vocab is not None and any(not 0 <= t < vocab for t in r.logit_bias):
                raise ApiError(f"logit_bias has token ids outside this model's vocabulary [0, {vocab})",
                               param="logit_bias")
            ids, values = mx.array(list(r.logit_bias)), mx.array(list(r.logit_bias.values()))
            processors.append(lambda tokens, logits: logits.at[:, ids].add(values.astype(logits.dtype)))
        if r.top_k and (vocab is None or r.top_k < vocab):
            processors.append(lambda tokens, logits: apply_top_k(logits, r.top_k))
        if r.min_p > 0:
            processors.append(lambda tokens, logits: apply_min_p(logits, r.min_p))
        return processors

    def _run(self, job: Job) -> None:
        if self.guard is not None and self.guard.check():
            self.store.clear()  # the kept conversations go before a request is refused for memory
            _free()
        r = job.request
        policy, budget = self._settings(r)
        sampling = dict(max_tokens=r.max_tokens, temp=r.temperature, top_p=r.top_p, seed=r.seed,
                        logits_processors=self._processors(r))
        session, cached, caches = None, 0, None
        try:
            if r.kind == "chat":
                session, cached = self._session(r, (policy, budget))
                session._stop = self._turn_stop = self._new_stop()
                events = session.send(r.messages[-1]["content"], **sampling)
                job._stopper(session.stop)
            else:
                caches = self._caches(policy, budget)
                stop = self._turn_stop = self._new_stop()
                job._stopper(stop.set)
                events = stream_events(self.model, self.tokenizer, r.prompt, caches=caches, chat_template=False,
                                       guard=self.guard, stop=stop, **sampling)
            finished, stopped = self._stream(job, events)
        except MlxEvictError as err:  # the prompt, the budget or the context limit
            raise ApiError(str(err)) from None
        cancelled = self._cancelled(job, finished, stopped)
        keep = not cancelled and not stopped and finished.reason != "memory"
        if session is not None and keep:
            self.store.put(session_key((policy, budget), session), session)
        else:
            session = caches = None
            _free()
        self._finish(job, finished, stopped, cached, policy, budget, cancelled)

    def _caches(self, policy: str, budget: int) -> list:
        try:
            return make_cache(self.model, policy, budget, **self.cache_options)
        except ValueError as err:  # a budget that cannot work with the server's window and sinks
            raise ApiError(str(err), param="budget") from None

    def _session(self, r: CompletionRequest, settings: tuple[str, int]) -> tuple[ChatSession, int]:
        """The kept session these messages continue (and its tokens), or a new one that reads them all."""
        history = r.messages[:-1]
        session = self.store.take(conversation_key(settings, history))
        if session is not None:
            return session, session.caches[0].offset
        system = history[0]["content"] if history and history[0]["role"] == "system" else None
        policy, budget = settings
        session = ChatSession(self.model, self.tokenizer, policy=policy, budget=budget, system=system,
                              guard=self.guard, **self.cache_options)
        earlier = history[1:] if system is not None else history
        if earlier:
            session.messages = [dict(m) for m in earlier]
            session.configure()  # the next send renders the whole history
        return session, 0

    def _stream(self, job: Job, events: Iterator) -> tuple[Optional[Finished], bool]:
        """Pass the text on; ``(Finished, whether a stop sequence ended it)``."""
        stops = StopMatcher(job.request.stop)
        first = next(events)  # errors about the prompt surface here, before anything is sent
        job.events.put(STARTED)
        finished = None
        for event in chain([first], events):
            if isinstance(event, TextChunk):
                text = event.text if event.kind == "reasoning" else stops.feed(event.text)
                if text and not job.cancelled.is_set():
                    job.events.put(Piece(event.kind, text))
                if stops.hit:
                    self._stop_sequence(job)  # ends the turn; the job is not cancelled, its answer is sent
            elif isinstance(event, Finished):
                finished = event
        tail = stops.flush()
        if tail:
            job.events.put(Piece("answer", tail))
        return finished, stops.hit

    def _finish(self, job: Job, finished: Optional[Finished], stopped: bool, cached: int, policy: str,
                budget: int, cancelled: bool) -> None:
        if cancelled or finished is None:
            self.counts["cancelled"] += 1
            generated = finished.progress.generated_tokens if finished else 0
            self.last = {"finish_reason": "cancelled", "completion_tokens": generated}
            self.log(f"{job.request.kind} request cancelled after {generated} tokens; its cache was freed")
            return
        p = finished.progress
        cache = {"policy": policy, "budget": budget, "kv_bytes": p.memory.kv_nbytes,
                 "kv_full_bytes": p.memory.kv_full_nbytes, "peak_memory": p.memory.mlx_peak}
        if p.cache is not None:
            cache.update(kept=p.cache.kept, evicted=p.cache.evicted, tokens_seen=p.cache.tokens_seen)
            if p.cache.disk_nbytes:  # a page store (--page-dir)
                cache.update(disk_bytes=p.cache.disk_nbytes, read_bytes=p.cache.read_nbytes)
        if finished.message and not stopped:
            cache["stopped"] = finished.message
        cache.update(self._rank_numbers(finished))
        reason = "stop" if stopped or finished.reason == "stop" else "length"
        usage = Usage(cached + p.prompt_tokens, p.generated_tokens, cached, cache)
        self.counts["served"] += 1
        self.last = {"finish_reason": reason, "completion_tokens": p.generated_tokens}
        self.log(
            f"{job.request.kind}: prompt {usage.prompt_tokens} tokens ({cached} cached), {p.generated_tokens} "
            f"generated at {p.tokens_per_s:.1f} tok/s, KV kept {cache.get('kept', '-')}/{budget}, "
            f"evicted {cache.get('evicted', 0)}, {reason}" + (f" ({finished.message})" if finished.message else "")
        )
        job.events.put(Done(reason, usage))
