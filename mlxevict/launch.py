"""Running the commands under ``mlx.launch``: a sharded load, one rank that talks, every rank's numbers.

``mlx.launch -n N --backend ring mlxevict generate MODEL -p ...`` starts the same
command on ``N`` ranks. :func:`join_ranks` (called once by the CLI) makes them
one program: every rank samples with one seed, only rank 0 prints (the others
keep their error lines, prefixed by their rank), and rank 0 reads the input
lines and hands them to the others. :func:`load_sharded` loads the model with mlx-lm's
``sharded_load`` (tensor parallelism: each rank holds ``1/N`` of every layer's
heads and MLP), so ``make_cache`` builds each rank's caches for its own heads.
:func:`rank_stats` gathers every rank's KV bytes and peak for the stats line
and ``--json``. Nothing here acts when the process runs alone.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional, TextIO

import mlx.core as mx

from .distributed import broadcast_text, check_shardable, gather_values, shared_seed, world
from .errors import ERROR_PREFIX, MlxEvictError, Stopped, say_error
from .events import Finished
from .resolve import Resolved, check_architecture
from .memory import format_bytes

STOP_GRACE_S = 3.0  # how long mlx.launch's SIGTERM waits for the main thread before the rank ends itself
ENDING_S = 6.0  # how long a rank already ending on its own (its line said or on its way) has to finish
launched = world  # the group of ranks under mlx.launch, None when this process runs alone


def rank_name(group: mx.distributed.Group) -> str:
    return f"rank {group.rank()} of {group.size()}"


def this_rank() -> str:
    """``rank 0 of 2`` under mlx.launch, ``this rank`` alone."""
    group = world()
    return rank_name(group) if group is not None else "this rank"


def join_ranks(args: argparse.Namespace) -> Optional[mx.distributed.Group]:
    """Make the ranks one program (see the module docstring); ``None`` when running alone."""
    group = launched()
    if group is None:
        return None
    if getattr(args, "seed", 0) is None:
        args.seed = shared_seed(group)  # sampling draws the same token on every rank
    sys.stdin = SharedInput(sys.stdin, group)
    watch_stops()
    if group.rank() != 0:
        sys.stdout = open(os.devnull, "w")
        sys.stderr = RankErrors(sys.stderr, group, everything=bool(getattr(args, "debug", False)))
    return group


def lost_peer_message(err: BaseException) -> str:
    """One line for the ring backend's error when another rank went away."""
    who = this_rank()
    return (
        f"{who} lost the connection to another rank ({err}): another rank failed or was killed "
        "(its error, or mlx.launch's warning, names it)"
    )


def _stop_message() -> str:
    return f"{this_rank()} was stopped by mlx.launch because another rank exited (its error, or mlx.launch's warning, names it)"


_stopping = threading.Event()  # the rank is ending on its own: its main thread met a lost peer or ran the handler


def stopping() -> None:
    """Mark this rank as ending (it met a lost peer): mlx.launch's SIGTERM then waits for its line.

    A SIGTERM that killed the rank between the lost peer and its error line ended it without a word
    (a CI run: rank 0 exited with -15 and no line).
    """
    _stopping.set()


def _stopped_by_launcher(signum: int, frame: Any) -> None:
    # mlx.launch terminates the other ranks once one exits with an error; without this the
    # ranks it stops die of SIGTERM without a word when the ring has not yet failed them.
    if _stopping.is_set():
        return  # already ending: its line is said or on its way, and the watcher bounds the rest
    _stopping.set()
    raise Stopped(_stop_message())


def watch_stops(grace: float = STOP_GRACE_S) -> None:
    """Handle mlx.launch's SIGTERM with one error line, even while the main thread is inside MLX.

    Call from the main thread, once. Python runs :func:`_stopped_by_launcher` on the main thread
    between bytecodes: a rank blocked in a collective whose peer is gone, or in one long ``mx.eval``,
    never runs it, and mlx.launch, which waits for the rank it terminated, never ends (a CI run hung
    so). Python's own C-level handler writes the signal's number to the wakeup fd at once; a thread
    reading it gives the main thread ``grace`` seconds to start ending, and one that has started
    ``ENDING_S`` more; then it says the stop line, unless the rank said its own, and exits.
    """
    signal.signal(signal.SIGTERM, _stopped_by_launcher)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read, grace), daemon=True, name="mlxevict-stop-watch").start()


def _watch(fd: int, grace: float) -> None:
    while signal.SIGTERM not in os.read(fd, 64):  # other signals (Ctrl-C) are the main thread's
        pass
    if _stopping.wait(grace):
        time.sleep(ENDING_S)  # the main thread is ending and says its own line; a rank still here is stuck
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    say_error(_stop_message())  # nothing when the main thread said its line
    os._exit(1)


class RankErrors:
    """stderr of a rank other than 0: only error lines pass, naming the rank (all lines with ``--debug``)."""

    def __init__(self, stream: TextIO, group: mx.distributed.Group, *, everything: bool = False):
        self.stream, self.group, self.everything = stream, group, everything
        self._line = ""

    def write(self, text: str) -> int:
        self._line += text
        *lines, self._line = self._line.split("\n")
        for line in lines:
            if line.startswith(ERROR_PREFIX):
                said = line[len(ERROR_PREFIX):]
                name = rank_name(self.group)
                line = ERROR_PREFIX + (said if said.startswith(name) else f"{name}: {said}")
            elif not self.everything:
                continue
            self.stream.write(line + "\n")
        self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()


class SharedInput:
    """stdin as rank 0 reads it, line by line, on every rank (``mpirun`` feeds only rank 0).

    ``mlx.launch`` never closes the ranks' stdin, so reading it to the end
    would wait forever: :meth:`read` refuses and says to give ``-p``.
    """

    def __init__(self, stream: TextIO, group: mx.distributed.Group):
        self.stream, self.group = stream, group

    def readline(self) -> str:
        line = self.stream.readline() if self.group.rank() == 0 else ""
        return broadcast_text(line, 0, self.group)

    def read(self, *_: Any) -> str:
        raise MlxEvictError("under mlx.launch give the prompt with -p: mlx.launch keeps stdin open, so it never ends")

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()


def load_sharded(resolved: Resolved, group: mx.distributed.Group, *, pipeline: bool = False) -> tuple[Any, Any]:
    """Load ``resolved`` with each rank holding its ``1/N`` of every layer (mlx-lm's ``sharded_load``).

    With ``pipeline``, each rank holds a block of whole layers instead (:func:`load_pipeline`).

    Raises:
        MlxEvictError: the heads or MLP do not split over the ranks, or the folder does not load.
    """
    if pipeline:
        return load_pipeline(resolved, group)
    config = check_architecture(resolved.path)
    try:
        check_shardable(config, group.size())
    except ValueError as err:
        raise MlxEvictError(f"{resolved.name}: {err}") from None
    from mlx_lm.utils import sharded_load

    try:
        return sharded_load(str(resolved.path), tensor_group=group)
    except (ValueError, FileNotFoundError, OSError) as err:
        raise MlxEvictError(f"cannot load {resolved.name} sharded from {resolved.path}: {err}") from None


def has_pipeline(model_type: str) -> bool:
    """Whether mlx-lm's model for ``model_type`` can be pipelined (its inner model has ``pipeline``)."""
    import importlib

    from mlx_lm.models.pipeline import PipelineMixin

    try:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError:
        return False
    return any(isinstance(v, type) and issubclass(v, PipelineMixin) for v in vars(module).values())


def load_pipeline(resolved: Resolved, group: mx.distributed.Group) -> tuple[Any, Any]:
    """Load ``resolved`` with each rank holding a block of whole layers (mlx-lm's ``model.model.pipeline``).

    The last rank runs the first layers and hands the hidden state on; every rank
    gets the final hidden state (an ``all_gather``), so all compute the full logits.
    ``make_cache`` then builds caches for the rank's own layers only (``model.layers``
    is the rank's block). Weights load lazily: a rank reads only its layers'.
    mlx-lm's ``sharded_load(pipeline_group=...)`` needs a ``model.safetensors.index.json``,
    which single-file models lack, so the folder is loaded here.

    Raises:
        MlxEvictError: mlx-lm has no pipeline for this architecture, fewer layers than ranks,
            or the folder does not load.
    """
    config = check_architecture(resolved.path)
    layers, ranks = int(config["num_hidden_layers"]), group.size()
    if layers < ranks:
        raise MlxEvictError(f"{resolved.name} has {layers} layers, fewer than the {ranks} ranks; "
                            f"run mlx.launch with -n {layers} or fewer")
    from mlx_lm.utils import load_model, load_tokenizer

    try:
        model, config = load_model(resolved.path, lazy=True)
        tokenizer = load_tokenizer(resolved.path, eos_token_ids=config.get("eos_token_id"))
    except (ValueError, FileNotFoundError, OSError) as err:
        raise MlxEvictError(f"cannot load {resolved.name} from {resolved.path}: {err}") from None
    if not hasattr(getattr(model, "model", None), "pipeline"):
        raise MlxEvictError(
            f"mlx-lm has no pipeline parallelism for {resolved.name} ({config.get('model_type')}); "
            "drop --pipeline to split every layer's heads instead"
        )
    model.model.pipeline(group)
    mx.eval(model.parameters())
    return model, tokenizer


@dataclass(frozen=True)
class RankStats:
    """One rank's share of a run: its KV bytes (its heads, all layers), MLX peak and cache entries."""

    rank: int
    kv_nbytes: int
    kv_full_nbytes: int
    mlx_peak: int
    kept: int
    capacity: int
    evicted: int
    tokens_seen: int
    generated_tokens: int


def rank_stats(finished: Finished) -> Optional[list[RankStats]]:
    """Every rank's :class:`RankStats` for this turn (one collective; every rank must call it), or ``None`` alone."""
    group = launched()
    if group is None:
        return None
    p = finished.progress
    c = p.cache
    mine = [
        p.memory.kv_nbytes,
        p.memory.kv_full_nbytes,
        p.memory.mlx_peak,
        c.kept if c else 0,
        c.capacity if c else 0,
        c.evicted if c else 0,
        c.tokens_seen if c else 0,
        p.generated_tokens,
    ]
    return [RankStats(rank, *values) for rank, values in enumerate(gather_values(mine, group))]


def rank_line(ranks: Optional[list[RankStats]]) -> str:
    """``2 ranks: KV 1.1 MiB / 1.1 MiB, peak 40.0 MiB / 40.2 MiB, kept 96/96`` (empty alone)."""
    if not ranks:
        return ""
    kv = " / ".join(format_bytes(r.kv_nbytes) for r in ranks)
    peak = " / ".join(format_bytes(r.mlx_peak) for r in ranks)
    kept = "/".join(str(r.kept) for r in ranks)
    return f"{len(ranks)} ranks: KV {kv}, peak {peak}, kept {kept}"


def ranks_json(ranks: Optional[list[RankStats]]) -> dict[str, Any]:
    """``{"ranks": [...]}`` for ``--json`` (empty alone)."""
    return {"ranks": [asdict(r) for r in ranks]} if ranks else {}
