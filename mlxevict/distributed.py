"""Tensor-parallel runs over ``mlx.distributed``: which heads a rank holds, and the few collectives.

Under ``mlx.launch`` a model sharded with its ``shard()`` (mlx-lm's tensor
parallelism) splits every layer's query and KV heads into ``N`` contiguous
blocks, one per rank; each rank's evicting caches then hold only its own KV
heads, under the same budget. Every policy scores each KV head from that head's
keys and its own query group, which stays on one rank, so no score needs
another rank's heads (docs/distributed.md says policy by policy why each is
exact). What the ranks must agree on is collected here: which block of heads a
cache holds (``random`` draws all heads' numbers and keeps its block), one
sampling seed, and when to stop for memory. The arithmetic of planning a model
over ``N`` machines is here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import mlx.core as mx

from .defaults import started_by_launcher
from .geometry import head_share

# Set by mlx.launch (ring: MLX_RANK) or mpirun (Open MPI, MPICH).
PEER_LOST = ("connection to a peer was lost", "closed by the peer", "send/recv errors")


@dataclass(frozen=True)
class Shard:
    """The block of KV heads one rank holds: block ``rank`` of ``size``."""

    rank: int = 0
    size: int = 1

    def heads(self, local_heads: int) -> slice:
        """This rank's rows of an array over all ``local_heads * size`` heads."""
        return slice(self.rank * local_heads, (self.rank + 1) * local_heads)


UNSHARDED = Shard()


def world() -> Optional[mx.distributed.Group]:
    """The group ``mlx.launch`` (or ``mpirun``) started this process in, or ``None`` when it runs alone.

    A process that no launcher started never initializes MLX's distributed backend.
    """
    if not started_by_launcher() or not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def model_shard(model: Any) -> Shard:
    """The block of heads this process's copy of ``model`` holds."""
    share = head_share(model)
    if share == 1:
        return UNSHARDED
    group = world()
    if group is None or group.size() != share:
        size = 1 if group is None else group.size()
        raise ValueError(
            f"the model's heads are split {share} ways but this process runs in a group of {size}; "
            "shard it over the group mlx.launch started (model.shard())"
        )
    return Shard(group.rank(), share)


def check_shardable(config: Mapping[str, Any], ranks: int) -> None:
    """Raise a ``ValueError`` when the model's heads or MLP do not split evenly over ``ranks``."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    mlp = int(config.get("intermediate_size") or 0)
    for name, value in (("KV heads", kv_heads), ("query heads", heads), ("MLP rows", mlp)):
        if value and value % ranks:
            fits = [n for n in range(1, kv_heads + 1) if kv_heads % n == 0 and heads % n == 0 and mlp % n == 0]
            raise ValueError(
                f"the model has {value} {name}, which do not split over {ranks} ranks; "
                f"run mlx.launch with -n {' or '.join(map(str, fits))}"
            )


def _all_sum(x: mx.array, group: mx.distributed.Group) -> mx.array:
    """``all_sum`` queued on mlx-lm's generation stream, behind the model's own.

    mlx-lm computes the next token ahead, and that forward pass runs the model's
    ``all_sum``s on its generation stream; a collective from another stream could
    pair with them in another order on each rank (seen: garbage per-rank stats on
    3 ranks), and waiting for the stream instead hangs when a peer dies. On the
    same stream ours runs after them on every rank, and fails as they do.
    """
    from mlx_lm.generate import generation_stream

    return mx.distributed.all_sum(x, group=group, stream=generation_stream)


def shared_seed(group: mx.distributed.Group) -> int:
    """A random seed drawn on rank 0 and known to every rank, so sampling stays in step."""
    mine = int(mx.random.randint(0, 2**31 - 1, ()).item()) if group.rank() == 0 else 0
    return int(_all_sum(mx.array(mine, mx.int32), group).item())


def any_rank(flag: bool, group: mx.distributed.Group) -> bool:
    """Whether ``flag`` is set on any rank (one ``all_sum``; every rank must call it at the same step)."""
    return _all_sum(mx.array(int(flag), mx.int32), group).item() > 0


def gather_values(values: Sequence[int], group: Optional[mx.distributed.Group] = None) -> list[list[int]]:
    """Every rank's ``values`` (the same count on each), rank by rank; one ``all_sum``.

    Byte counts can pass 2**31, so each number travels as two 31-bit halves.
    """
    group = group or world()
    halves = [part for v in values for part in (int(v) >> 31, int(v) & (2**31 - 1))]
    table = mx.zeros((group.size(), len(halves)), mx.int32)
    table[group.rank()] = mx.array(halves, mx.int32)  # each rank fills its row; the sum is every row
    rows = _all_sum(table, group).tolist()
    return [[(row[i] << 31) + row[i + 1] for i in range(0, len(row), 2)] for row in rows]


def first_reason(reason: str, group: Optional[mx.distributed.Group] = None) -> str:
    """``reason`` agreed by every rank: the first rank's non-empty one, prefixed by its rank.

    A memory guard that stops one rank must stop all of them at the same step,
    or the others wait for it forever. Without a group, ``reason`` as it is.
    """
    group = group or world()
    if group is None:
        return reason
    flags = mx.zeros((group.size(),), mx.int32)
    flags[group.rank()] = int(bool(reason))
    stopped = [r for r, flag in enumerate(_all_sum(flags, group).tolist()) if flag]
    if not stopped:
        return ""
    text = reason if group.rank() == stopped[0] else ""
    return f"rank {stopped[0]}: {broadcast_text(text, stopped[0], group)}"


def broadcast_text(text: str, root: int = 0, group: Optional[mx.distributed.Group] = None) -> str:
    """``text`` as rank ``root`` has it, on every rank (two collectives)."""
    group = group or world()
    data = text.encode() if group.rank() == root else b""
    size = int(_all_sum(mx.array(len(data), mx.int32), group).item())
    if size == 0:
        return ""
    mine = mx.array(list(data), mx.int32) if data else mx.zeros((size,), mx.int32)
    return bytes(_all_sum(mine, group).tolist()).decode()


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is MLX's ring backend saying another rank went away."""
    return isinstance(err, RuntimeError) and any(text in str(err) for text in PEER_LOST)


@dataclass(frozen=True)
class HostPlan:
    """A model split over ``hosts`` machines of ``memory`` bytes each (tensor parallelism).

    Attributes:
        hosts, memory: as asked.
        shardable: the heads and MLP split evenly over ``hosts``; else ``reason`` says why not.
        weights_per_host: sharded weights / hosts + the embedding and output head every host keeps.
        kv_bytes_per_token: one host's KV per token (its share of the heads), model dtype.
        kv_memory: what is left per host for KV after the weights and ``margin``.
        full_tokens: tokens a full cache holds in ``kv_memory``.
        min_hosts: the fewest hosts (dividing the heads; with a pipeline, at most the layers) whose
            weights fit, or ``None``.
    """

    hosts: int
    memory: int
    shardable: bool
    reason: str
    weights_per_host: int
    kv_bytes_per_token: int
    kv_memory: int
    full_tokens: int
    min_hosts: Optional[int]


def replicated_fraction(config: Mapping[str, Any]) -> float:
    """Share of a llama-like model's parameters that every host keeps (embedding, output head, norms)."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    mlp = int(config.get("intermediate_size") or 4 * hidden)
    layers = int(config["num_hidden_layers"])
    vocab = int(config.get("vocab_size") or 0)
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * mlp
    replicated = embeddings + (2 * layers + 1) * hidden
    return replicated / (replicated + layers * per_layer)


def check_pipelined(config: Mapping[str, Any], ranks: int) -> None:
    """Raise a ``ValueError`` when the model's layers do not split over ``ranks`` (fewer layers than ranks)."""
    layers = int(config["num_hidden_layers"])
    if layers < ranks:
        raise ValueError(f"the model has {layers} layers, fewer than {ranks} ranks; use at most {layers}")


def plan_hosts(
    config: Mapping[str, Any], weights: int, kv_bytes_per_token: int, hosts: int, memory: int, margin: int,
    *, pipeline: bool = False,
) -> HostPlan:
    """How a model splits over ``hosts`` machines with ``memory`` bytes each.

    Args:
        config: the model's ``config.json``.
        weights: bytes of all weights.
        kv_bytes_per_token: the whole model's KV per token (all heads).
        hosts: machines (ranks), each with ``memory`` bytes.
        margin: bytes kept free on each host for the system.
        pipeline: each host holds a block of whole layers (``--pipeline``) instead of ``1/N`` of
            every layer; the largest block (``ceil(layers / hosts)``, as mlx-lm splits) sets the numbers.

    Returns:
        A :class:`HostPlan`; weights per host count the replicated embedding and
        head once per host (estimated from the config's shapes).
    """
    if hosts < 1:
        raise ValueError(f"--hosts {hosts} must be at least 1")
    replicated = replicated_fraction(config)
    layers = int(config["num_hidden_layers"])
    check = check_pipelined if pipeline else check_shardable

    def share(n: int) -> float:  # of the sharded part: the largest block of layers, or 1/n of each layer
        return math.ceil(layers / n) / layers if pipeline else 1 / n

    def per_host(n: int) -> int:
        return math.ceil(weights * (replicated + (1 - replicated) * share(n)))

    def fits(n: int) -> bool:
        try:
            check(config, n)
        except ValueError:
            return False
        return per_host(n) + margin < memory

    reason = ""
    try:
        check(config, hosts)
    except ValueError as err:
        reason = str(err)
    kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    candidates = [n for n in range(1, (layers if pipeline else kv_heads) + 1) if fits(n)]
    weights_per_host = per_host(hosts)
    kv_per_token = math.ceil(kv_bytes_per_token * share(hosts)) if pipeline else kv_bytes_per_token // hosts
    kv_memory = max(0, memory - weights_per_host - margin)
    return HostPlan(
        hosts=hosts,
        memory=memory,
        shardable=not reason,
        reason=reason,
        weights_per_host=weights_per_host,
        kv_bytes_per_token=kv_per_token,
        kv_memory=kv_memory,
        full_tokens=kv_memory // kv_per_token if kv_per_token else 0,
        min_hosts=candidates[0] if candidates else None,
    )
