"""A multi-turn chat over the generation loop: the caches are kept across turns and only new tokens fed."""

from __future__ import annotations

import gc
import threading
from typing import Any, Iterator, Optional

import mlx.core as mx

from .budget import BudgetRequest
from .cache import DEFAULT_BUDGET
from .errors import MlxEvictError
from .events import Finished, TextChunk
from .generate import DEFAULT_MAX_TOKENS, DEFAULT_TEMP, DEFAULT_TOP_P, Event, _evicting, stream_events
from .kvstorage import DTYPE, KVStorage
from .make import make_cache
from .memory import MemoryGuard
from .paged_storage import DEFAULT_PAGES
from .plan import CachePlan, page_folder, paged_plan, plan_cache
from .prompts import as_wrapper, encode_text, render
from .stats import CacheStats, cache_stats

FROM_OPTIONS = "from options"  # storage_request: what cache_options store
STORAGE_KEYS = ("kv_bits", "kv_group_size", "full_precision_window", "window_bits", "kv_rotate", "key_group", "low_bits",
                "eight_bit_layers")


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
        storage_request: the storage asked for (``--kv-bits``), which a new budget keeps
            (:meth:`replan`); ``None``: the planner's rule (the dtype for tokens, its choice for memory).
            Default: the quantized storage of ``cache_options``, if any.
        page_rule: a new budget (:meth:`replan`) lets the memory rule choose whether evicted entries go to a
            page store (:func:`~mlxevict.plan.page_folder`), as ``--budget`` does when no ``--page-dir`` is given.
        cache_options: ``sinks``, ``window``, ``slack``, ``prompt_mode`` and the storage
            arguments (``kv_bits``...) for ``make_cache``; or ``page_dir`` (and ``pages``) for a paged
            cache, whose budget in memory (``"1.5GB"``) is ``budget`` itself.

    Raises:
        MlxEvictError: a policy or budget that cannot work.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        policy: str = "default",
        budget: "int | str" = DEFAULT_BUDGET,
        system: Optional[str] = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        temp: float = DEFAULT_TEMP,
        top_p: float = DEFAULT_TOP_P,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: Optional[int] = None,
        guard: Optional[MemoryGuard] = None,
        storage_request: "Optional[KVStorage] | str" = FROM_OPTIONS,
        page_rule: bool = False,
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
        self.policy, self.cache_options = policy, dict(cache_options)
        self.page_rule = page_rule
        # A paged cache sizes a budget in memory itself (the sketch of the evicted keys is part of it).
        self.page_budget: Optional[str] = None
        if isinstance(budget, (str, BudgetRequest)):
            plan = self._paged_plan(budget)
            self.page_budget = None if plan.request.tokens is not None else plan.request.text
            budget = plan.tokens
        self.budget = budget
        if storage_request == FROM_OPTIONS:
            storage = KVStorage.from_options(**cache_options)
            storage_request = storage if storage.quantized else None
        self.storage_request: Optional[KVStorage] = storage_request
        self._new_caches()

    def _new_caches(self) -> None:
        try:
            self.caches = make_cache(self.model, self.policy, self.page_budget or self.budget, **self.cache_options)
        except ValueError as err:
            raise _cache_error(err) from None

    @property
    def paged(self) -> bool:
        """Whether evicted entries go to a page store (``page_dir``)."""
        return bool(self.cache_options.get("page_dir"))

    def _paged_plan(self, budget: "int | str | BudgetRequest") -> CachePlan:
        if not self.paged:
            raise ValueError(f"budget {budget!r}: a budget in memory is sized by replan() (or give page_dir)")
        return paged_plan(self.model, budget, self.cache_options.get("pages", DEFAULT_PAGES))

    @property
    def storage(self) -> KVStorage:
        """How the caches store their entries now."""
        return KVStorage.from_options(**self.cache_options)

    def replan(
        self, budget: "int | str | BudgetRequest", storage: Optional[KVStorage] = None, *, policy: Optional[str] = None
    ) -> CachePlan:
        """Use ``budget`` (tokens, ``"1.5GB"``, ``"auto"``) from the next turn, sized by the one planner.

        Args:
            budget: the new budget, as ``--budget`` takes it.
            storage: the storage asked for; ``None``: the planner's rule (the dtype for tokens, its
                choice for a budget in memory). Kept for later budgets (``storage_request``).
            policy: a new policy too (``None``: keep).

        Returns:
            The :class:`~mlxevict.plan.CachePlan` used (its ``notes`` are worth telling the user).

        Raises:
            ValueError: a budget or storage that cannot work (the old settings stay).
        """
        old = dict(self.cache_options)
        if self.page_rule:  # the memory rule chooses again: a page store in the temp folder, or none
            self.cache_options.pop("page_dir", None)
            folder = page_folder(None, self.model, budget, storage_asked=storage is not None and storage.quantized,
                                 pages=self.cache_options.get("pages", DEFAULT_PAGES))  # fmt: skip
            self.cache_options.update({"page_dir": folder} if folder else {})
        try:
            return self._replan(budget, storage, policy)
        except ValueError:
            self.cache_options = old
            raise

    def _replan(self, budget: "int | str | BudgetRequest", storage: Optional[KVStorage], policy: Optional[str]) -> CachePlan:
        if self.paged:  # entries in the model's dtype; a budget in memory counts the sketch too
            if storage is not None and storage.quantized:
                raise ValueError("a paged cache (--page-dir) holds its entries in the model's dtype: no --kv-bits")
            plan = self._paged_plan(budget)
            page_budget = None if plan.request.tokens is not None else plan.request.text
            self._apply(policy, plan.tokens, DTYPE, page_budget, {})
            return plan
        plan = plan_cache(self.model, budget, storage)
        self.configure(policy=policy, budget=plan.tokens, storage=plan.storage)
        self.storage_request = storage
        return plan

    def configure(
        self,
        *,
        policy: Optional[str] = None,
        budget: Optional[int] = None,
        storage: Optional[KVStorage] = None,
        **cache_options: Any,
    ) -> None:
        """Use another policy, budget, storage or cache option from the next turn on.

        The conversation so far is fed again into the new caches at the next
        :meth:`send`, so the model keeps its context.

        Args:
            policy, budget: the new ones (``None``: keep).
            storage: replaces every storage argument (``kv_bits``...) at once; ``None``: keep.
            cache_options: other ``make_cache`` arguments to change.

        Raises:
            MlxEvictError: the new settings cannot work (the old ones stay).
        """
        self._apply(policy, budget, storage, self.page_budget if budget is None else None, cache_options)

    def _apply(self, policy: Optional[str], budget: Optional[int], storage: Optional[KVStorage],
               page_budget: Optional[str], cache_options: dict[str, Any]) -> None:  # fmt: skip
        """:meth:`configure`, with the paged cache's budget in memory (``page_budget``) given."""
        old = (self.policy, self.budget, dict(self.cache_options), self.caches, self.page_budget)
        self.policy = policy or self.policy
        self.budget = budget or self.budget
        self.page_budget = page_budget
        if storage is not None:
            kept = {k: v for k, v in self.cache_options.items() if k not in STORAGE_KEYS}
            self.cache_options = {**kept, **storage.options()}
        self.cache_options.update(cache_options)
        try:
            self._new_caches()
        except MlxEvictError:
            self.policy, self.budget, self.cache_options, self.caches, self.page_budget = old
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
