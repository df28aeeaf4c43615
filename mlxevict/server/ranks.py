"""``serve`` under ``mlx.launch``: rank 0 takes the requests, every rank decodes them in step.

Each rank runs a :class:`ShardedEngine` over its shard of the model (tensor
parallelism, ``launch.load_sharded``) and its own evicting caches. Rank 0's
engine takes the next job from its queue (filled by the HTTP server) and hands
it to every rank as a small JSON envelope (:func:`envelope`, one
``broadcast_text``); the other ranks' engines wait for the next envelope
instead of a queue, run the same request and throw their text away; while the
queue is empty rank 0 sends empty envelopes (ticks), and :data:`STOP` ends them.
So requests run one at a time on all ranks, in one order.

Everything that decides what the ranks do next is agreed, never read from one
rank's clock or socket: a client that hangs up sets a flag on rank 0 only, so
the stop is an :class:`AgreedStop` that asks every rank every few tokens (all
stop at the same token, the request counts as cancelled on all of them and no
rank keeps its conversation); the memory guard is agreed
already (``first_reason``), and the conversation store gets one memory bound,
the smallest rank's. A failure while the ranks generate (another rank died,
or an error on one rank only) ends the server: the ranks are no longer in step.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from dataclasses import asdict
from typing import Any, Callable, Optional

import mlx.core as mx

from ..distributed import any_rank, broadcast_text, gather_values, lost_peer
from ..errors import MlxEvictError
from ..events import Finished
from ..launch import rank_name, rank_stats
from .engine import Engine, Job
from .protocol import CompletionRequest

PARENT_POLL_S = 0.5  # seconds between looks at whether mlx.launch is still there
# While idle, rank 0 sends an empty envelope this often and the others sleep between them: a rank
# waiting inside a ring collective spins on its socket (measured: 33-56% of a core while idle),
# so no rank waits in one for long. A request waits at most this long for the other ranks.
IDLE_TICK_S = 0.1
# A synchronous all_sum per token made the tiny test model's sharded server 3x slower (23-31 against
# 79-96 tok/s without it, 2 ranks on this loaded 2-core machine); every 8 tokens it is amortized.
STOP_EVERY = 8
STOP = '"stop"'  # the envelope that ends the other ranks (a request's is a JSON object)


def envelope(request: CompletionRequest) -> str:
    """``request`` as the JSON text rank 0 hands to the other ranks."""
    return json.dumps(asdict(request))


def request_of(text: str) -> CompletionRequest:
    """The :class:`CompletionRequest` an :func:`envelope` carries."""
    data = json.loads(text)
    data["messages"], data["stop"] = tuple(data["messages"]), tuple(data["stop"])  # JSON has lists
    data["logit_bias"] = {int(k): v for k, v in data["logit_bias"].items()}  # and text keys
    return CompletionRequest(**data)


class AgreedStop:
    """A stop flag the ranks agree on: set on any rank, seen by all at the same ``is_set`` call.

    Every rank must call :meth:`is_set` at the same steps (the generation loop
    does: after each token and each prompt chunk). Every :data:`STOP_EVERY`-th
    call asks the other ranks (one ``all_sum``, which waits for the step in
    flight): so a client that leaves stops the ranks within that many tokens.
    :meth:`set_everywhere` is for what every rank sees at the same step (a stop
    sequence): it stops at once, without asking.
    """

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self._flag = self._everywhere = False
        self._calls = 0

    def set(self) -> None:
        self._flag = True

    def set_everywhere(self) -> None:
        self._everywhere = True

    def clear(self) -> None:
        self._flag = self._everywhere = False
        self._calls = 0

    def is_set(self) -> bool:
        self._calls += 1
        if self._everywhere:
            return True
        return self._calls % STOP_EVERY == 0 and any_rank(self._flag, self.group)


class _Discard:
    """A follower's job events: nobody reads them."""

    def put(self, item: Any) -> None:
        pass


class ShardedEngine(Engine):
    """An :class:`Engine` that runs every request on all ranks of ``group`` (see the module docstring).

    Args:
        group: the ranks; rank 0 serves HTTP, the others follow.
        on_fatal: called (from the worker thread) when a failure ends the worker.
        Engine's arguments otherwise.
    """

    def __init__(self, *args: Any, group: mx.distributed.Group, on_fatal: Callable[[], None] = lambda: None,
                 **kwargs: Any):
        self.group, self.on_fatal = group, on_fatal
        self.fatal: Optional[Exception] = None
        super().__init__(*args, **kwargs)

    @property
    def ranks(self) -> int:
        return self.group.size()

    def _take(self) -> Optional[Job]:
        try:
            return self._lead() if self.group.rank() == 0 else self._follow()
        except Exception as err:  # a rank died while the ranks were idle
            self._fatal(err)
            return None

    def _lead(self) -> Job:
        while True:
            try:
                job = self._jobs.get(timeout=IDLE_TICK_S)
            except queue.Empty:
                broadcast_text("", 0, self.group)  # a tick: nothing yet
                continue
            if job is not None and job.cancelled.is_set():
                self.counts["cancelled"] += 1
                continue
            broadcast_text(STOP if job is None else envelope(job.request), 0, self.group)
            return job

    def _follow(self) -> Optional[Job]:
        while True:
            text = broadcast_text("", 0, self.group)
            if text == STOP:
                return None
            if text:
                job = Job(request_of(text))
                job.events = _Discard()  # type: ignore[assignment]
                return job
            time.sleep(IDLE_TICK_S)  # as rank 0 waits for its queue: the ring spins while it waits

    def _fatal(self, err: Exception) -> bool:
        self.fatal = err
        self._closing = True
        self.on_fatal()
        return True

    def _new_stop(self) -> AgreedStop:
        return AgreedStop(self.group)

    def _stop_sequence(self, job: Job) -> None:
        self._turn_stop.set_everywhere()

    def _cancelled(self, job: Job, finished: Optional[Finished], stopped: bool) -> bool:
        # Not job.cancelled: only rank 0 sees the client go, and may see it after the last token.
        return finished is None or (finished.reason == "interrupted" and not stopped)

    def _rank_numbers(self, finished: Finished) -> dict:
        ranks = rank_stats(finished) or []
        return {"ranks": [{"rank": r.rank, "kv_bytes": r.kv_nbytes, "peak_memory": r.mlx_peak} for r in ranks]}

    def failure(self) -> Optional[Exception]:
        """The error to end the process with, in CLI words (``None`` when the worker ended normally)."""
        err = self.fatal
        if err is None or lost_peer(err):
            return err  # the CLI words a lost peer itself
        return MlxEvictError(
            f"{rank_name(self.group)}: generation failed ({type(err).__name__}: {err}); "
            "the ranks are no longer in step, so the server stopped"
        )


def agreed_bytes(nbytes: int, group: mx.distributed.Group) -> int:
    """The smallest rank's ``nbytes``: one bound for every rank's conversation store, so they keep alike."""
    return min(row[0] for row in gather_values([nbytes], group))


def follow(engine: ShardedEngine) -> None:
    """A rank other than 0: wait while its engine follows rank 0, until rank 0 ends the server.

    The main thread waits in Python, so mlx.launch's SIGTERM (another rank
    failed) still ends this rank while its worker waits inside a collective.
    Ctrl-C is rank 0's to act on (``serve`` ignores it here): rank 0's
    :data:`STOP` envelope ends the worker.

    Raises:
        RuntimeError, MlxEvictError: the failure that ended the worker (:meth:`ShardedEngine.failure`).
    """
    while engine._thread.is_alive():
        engine._thread.join(0.2)
    err = engine.failure()
    if err is not None:
        raise err


def watch_launcher(stop: Callable[[], None]) -> None:
    """Call ``stop`` once ``mlx.launch`` (this process's parent) is gone, e.g. killed by SIGTERM.

    mlx.launch does not pass its own SIGTERM on to the ranks; without this the
    server would outlive it, holding its port. Its output pipes are gone too, so
    stdout and stderr go to ``/dev/null`` first.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        stop()

    threading.Thread(target=watch, name="mlxevict-launcher-watch", daemon=True).start()
