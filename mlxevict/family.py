"""The DeepSeek-R1-Distill family: which 4-bit distill fits a machine, planned from numbers known offline.

Sizing needs no download: each member's weights size and KV geometry are
written here (from the repos' ``config.json``), so ``mlxevict info
mlx-community/DeepSeek-R1-Distill`` prints the family's plan on a machine that has
never reached the hub.

How a member is judged to fit (:func:`fits`): its weights, its KV cache at the
budget the CLI will use (``--budget``, default 2048 tokens in the model's dtype)
and an overhead (1 GB + 10% of the weights: tokenizer, Python, activations,
MLX's buffer cache) must leave :data:`HEADROOM` (2 GiB) free within the smaller of

- the share of memory macOS lets the GPU wire (about 2/3 up to 36 GB, 3/4 above), and
- the memory free for it: on this machine what the system reports available now
  (so an open browser is already counted); for a machine of a given size,
  its total less :data:`IN_USE` (3.5 GiB).

Why these margins: the memory guard (:class:`~mlxevict.memory.MemoryGuard`) stops a
run when less than 1 GiB is available, so a pick must leave at least that much, and
another 1 GiB lets a browser's tabs grow during a long answer without the guard
stopping it. ``IN_USE`` stands for macOS with a browser and a few tabs open. Both are
assumptions, not measurements (this project's test machine is a Linux box without a
browser): on a Mac, Activity Monitor's "Memory Used" with your usual apps open is the
number to compare with ``IN_USE``. The earlier rule (the GPU share alone, a
4096-token budget) chose 14B on 16 GB and 32B on 32 GB with about 0.5 GiB to spare;
this one chooses 8B and 14B there (``tests/test_resolve.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .budget import BudgetRequest, parse_budget
from .defaults import FAMILY_NAME
from .errors import MlxEvictError
from .geometry import KVShape
from .kvstorage import DTYPE, SPLIT_BITS, KVStorage
from .memory import format_bytes

OVERHEAD_BYTES = 1 * 1000**3  # tokenizer, the Python process, prefill buffers
OVERHEAD_SHARE = 0.10  # activations and MLX's buffer cache grow with the model
HEADROOM = 2 * 1024**3  # left free after the model: the guard's 1 GiB margin + 1 GiB for other apps to grow
IN_USE = int(3.5 * 1024**3)  # taken by macOS and a browser on a machine of a given size (an assumption)
PLAN_MEMORIES = (8, 16, 32, 64)  # GiB: the machines ``info`` plans the family for
PLAN_STORAGES = (DTYPE, KVStorage.of(8), KVStorage.of(4), KVStorage.of(SPLIT_BITS))
GiB = 1024**3


@dataclass(frozen=True)
class FamilyMember:
    """One 4-bit mlx-community DeepSeek-R1-Distill repo, with what sizing needs to know."""

    repo: str
    params: str  # "7B"
    base: str  # "Qwen" or "Llama"
    weights_gb: float  # approximate download size, 10^9 bytes
    layers: int
    kv_heads: int
    head_dim: int = 128
    dtype_size: int = 2  # bfloat16 activations
    context: int = 131072

    @property
    def weights_nbytes(self) -> int:
        return int(self.weights_gb * 1000**3)

    @property
    def shape(self) -> KVShape:
        return KVShape(self.layers, self.kv_heads, self.head_dim, self.dtype_size)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.shape.bytes_per_token

    @property
    def overhead_nbytes(self) -> int:
        return OVERHEAD_BYTES + int(OVERHEAD_SHARE * self.weights_nbytes)

    def kv_nbytes(self, budget: Optional[BudgetRequest] = None) -> int:
        """KV bytes at ``budget`` as the CLI runs it: tokens in the dtype (at most the context), or the
        memory given; ``auto`` sizes itself to what is left, so the default budget is counted."""
        request = parse_budget(budget)
        if request.nbytes is not None:
            return request.nbytes
        tokens = request.tokens if request.tokens is not None else parse_budget(None).tokens
        return min(tokens, self.context) * self.kv_bytes_per_token

    def need_at(self, budget: "BudgetRequest | str | int | None" = None) -> int:
        """Weights + the KV cache at ``budget`` (default 2048 tokens) + overhead."""
        return self.weights_nbytes + self.kv_nbytes(budget) + self.overhead_nbytes

    @property
    def need_nbytes(self) -> int:
        """:meth:`need_at` the default budget."""
        return self.need_at()


# Smallest first. Layer counts and kv-heads are the models' config.json values.
DEEPSEEK_R1_DISTILL: tuple[FamilyMember, ...] = (
    FamilyMember("mlx-community/DeepSeek-R1-Distill-Qwen-1.5B-4bit", "1.5B", "Qwen", 1.0, layers=28, kv_heads=2),
    FamilyMember("mlx-community/DeepSeek-R1-Distill-Qwen-7B-4bit", "7B", "Qwen", 4.3, layers=28, kv_heads=4),
    FamilyMember("mlx-community/DeepSeek-R1-Distill-Llama-8B-4bit", "8B", "Llama", 4.5, layers=32, kv_heads=8),
    FamilyMember("mlx-community/DeepSeek-R1-Distill-Qwen-14B-4bit", "14B", "Qwen", 8.3, layers=48, kv_heads=8),
    FamilyMember("mlx-community/DeepSeek-R1-Distill-Qwen-32B-4bit", "32B", "Qwen", 18.4, layers=64, kv_heads=8),
)


def is_family_name(name: str) -> bool:
    return name.strip().rstrip("/").lower() in {FAMILY_NAME.lower(), FAMILY_NAME.split("/")[1].lower()}


def room(memory: int, available: Optional[int] = None) -> int:
    """Bytes a model may take on a machine of ``memory`` bytes with ``available`` free (see the module)."""
    gpu_share = memory * (2 / 3 if memory <= 36 * GiB else 3 / 4)
    free = memory - IN_USE if available is None else available
    return int(min(gpu_share, free)) - HEADROOM


def fits(member: FamilyMember, memory: int, available: Optional[int] = None, budget=None) -> bool:
    return member.need_at(budget) <= room(memory, available)


def choose_family_member(
    memory: int,
    *,
    cached: Sequence[str] = (),
    available: Optional[int] = None,
    budget: "BudgetRequest | str | int | None" = None,
) -> tuple[FamilyMember, str]:
    """The largest DeepSeek-R1-Distill 4-bit repo that fits (see the module for the rule).

    When ``cached`` is given (offline), the largest fitting repo among those is chosen and
    the reason says which larger one was skipped.

    Args:
        memory: the machine's total memory in bytes.
        cached: repo ids available locally; empty means any may be downloaded.
        available: free bytes now; ``None``: a machine of ``memory`` bytes with :data:`IN_USE` taken.
        budget: the ``--budget`` the model will run with (default 2048 tokens).

    Returns:
        ``(member, reason)``.

    Raises:
        MlxEvictError: not even the smallest fits (or none that fits is cached).
    """
    space = room(memory, available)
    fitting = [m for m in DEEPSEEK_R1_DISTILL if m.need_at(budget) <= space]
    free = f"{format_bytes(available)} available of {format_bytes(memory)}" if available is not None else (
        f"{format_bytes(memory)} of memory"
    )
    if not fitting:
        smallest = DEEPSEEK_R1_DISTILL[0]
        raise MlxEvictError(
            f"no DeepSeek-R1-Distill model fits {free}: the smallest, {smallest.repo}, needs about "
            f"{format_bytes(smallest.need_at(budget))} and {format_bytes(HEADROOM)} to spare, and a model may use "
            f"{format_bytes(max(0, space + HEADROOM))} here; try the demo model (no MODEL)"
        )
    best = choice = fitting[-1]
    skipped = ""
    if cached:
        have = [m for m in fitting if m.repo in cached]
        if not have:
            raise MlxEvictError(
                f"{best.repo} fits this machine but is not in the local hub cache and HF_HUB_OFFLINE is set; "
                f"fetch it with `hf download {best.repo}` (or unset HF_HUB_OFFLINE)"
            )
        choice = have[-1]
        if choice is not best:
            skipped = f"; {best.params} would fit but is not cached and HF_HUB_OFFLINE is set"
    tokens = parse_budget(budget)
    reason = (
        f"chose {choice.repo}: {format_bytes(choice.weights_nbytes)} of weights + "
        f"{format_bytes(choice.kv_nbytes(budget))} KV for --budget {tokens.text} + "
        f"{format_bytes(choice.overhead_nbytes)} overhead = {format_bytes(choice.need_at(budget))}, leaving "
        f"{format_bytes(HEADROOM)} free within the {format_bytes(space + HEADROOM)} a model may use of {free}{skipped}"
    )
    larger = DEEPSEEK_R1_DISTILL.index(choice) + 1
    if not skipped and larger < len(DEEPSEEK_R1_DISTILL):
        nxt = DEEPSEEK_R1_DISTILL[larger]
        reason += f"; {nxt.params} needs {format_bytes(nxt.need_at(budget) + HEADROOM)} with its headroom"
    return choice, reason


def family_plan(memory: int, available: int, budget=None) -> dict:
    """The family's memory plan, as data: each member's weights and KV bytes per token by storage, and
    which member fits machines of 8, 16, 32 and 64 GiB and this one."""
    members = [
        {
            "repo": m.repo,
            "params": m.params,
            "weights_nbytes": m.weights_nbytes,
            "need_nbytes": m.need_at(budget),
            "kv_bytes_per_token": {
                s.label if s.quantized else f"{8 * m.dtype_size}-bit": m.shape.storage_bytes(s) for s in PLAN_STORAGES
            },
        }
        for m in DEEPSEEK_R1_DISTILL
    ]

    def pick(total: int, free: Optional[int]) -> Optional[str]:
        fitting = [m.params for m in DEEPSEEK_R1_DISTILL if fits(m, total, free, budget)]
        return fitting[-1] if fitting else None

    return {
        "family": FAMILY_NAME,
        "budget": parse_budget(budget).text,
        "headroom_nbytes": HEADROOM,
        "in_use_nbytes": IN_USE,
        "members": members,
        "fits": {f"{gib} GiB": pick(gib * GiB, None) for gib in PLAN_MEMORIES},
        "fits_this_machine": pick(memory, available),
    }
