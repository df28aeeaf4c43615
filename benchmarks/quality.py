"""``mlxevict eval``: how much of the full cache's behaviour each cache keeps, per budget.

Three measurements, all against mlx-lm's ``KVCache`` run on the same inputs:

- retrieval after reasoning: facts early in the prompt, reasoning-like text fed in
  decode-sized steps, then the question; an answer counts when every answer token
  is the greedy choice under teacher forcing (which is exactly when greedy decoding
  would write it). Only answers the full cache gets right are kept.
- fidelity: over natural text, the share of positions whose top-1 token matches the
  full cache's, and the mean KL divergence ``KL(p_full ‖ p_cache)`` in nats.
- generation: greedy decoding of reasoning-style prompts; how many tokens match the
  full cache's before the first difference, and how long the trace runs (to the
  end-of-turn token, capped at ``new_tokens``).

Retrieval and fidelity rows run as one batch, so each cache is driven once per
budget. Budgets are fractions of the context (prompt plus generated tokens), or
with ``memory`` fractions of a 16-bit full cache's KV bytes at that context: then
each cache keeps as many entries as its storage fits.
Note that a batch shares one eviction schedule: ``uncertainty`` adapts its budget
to the mean ``H(p_t)`` over the batch's rows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from .caches import (
    MLX_LM_CACHES,
    REFERENCE,
    CacheSettings,
    check_budget,
    entries_within,
    kv_bytes,
    kv_bytes_16bit,
    make_caches,
    release,
    takes_budget,
)
from .tasks import RetrievalTask, make_fidelity_texts, make_generation_tasks, make_retrieval_tasks

DEFAULT_FRACTIONS = (0.5, 0.25, 0.125)
DEFAULT_STEP = 16  # tokens per teacher-forced step after the prompt: a decode-sized chunk

Progress = Callable[[str], None]


@dataclass(frozen=True)
class EvalConfig:
    """What ``mlxevict eval`` runs. Defaults fit ~30 minutes on a 2-core CPU with SmolLM2-135M."""

    names: tuple[str, ...]
    context: int = 512
    fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    retrieval: int = 4
    fidelity: int = 2
    generation: int = 4
    prompt_tokens: int = 96
    new_tokens: int = 64
    step: int = DEFAULT_STEP
    seed: int = 0
    settings: CacheSettings = field(default_factory=CacheSettings)
    memory: bool = False  # budgets are fractions of a 16-bit full cache's KV bytes, not of its tokens

    @property
    def generation_context(self) -> int:
        return self.prompt_tokens + self.new_tokens

    def runs(self) -> list[tuple[str, float | None]]:
        """``(name, fraction)`` for each cache and budget; unbudgeted caches run once (``None``)."""
        out: list[tuple[str, float | None]] = []
        for name in self.names:
            out += [(name, f) for f in self.fractions] if takes_budget(name) else [(name, None)]
        return out

    def budgets(self, model: nn.Module, name: str, fraction: float | None) -> tuple[int | None, int | None]:
        """Entries per layer of ``name`` for the teacher-forced tasks and for generation at ``fraction``."""
        if fraction is None:
            return None, None
        contexts = (self.context, self.generation_context)
        if self.memory:
            return tuple(entries_within(model, name, fraction, L, self.settings) for L in contexts)
        return tuple(max(1, round(fraction * L)) for L in contexts)


@dataclass
class Workload:
    """The tasks as token arrays, built once per run."""

    teacher: mx.array  # B_t, L: retrieval rows, then fidelity rows
    prefill: int  # tokens prefilled in one call before the decode-sized steps
    retrieval: list[RetrievalTask]
    n_fidelity: int
    score_from: int  # fidelity scores positions [score_from, L)
    prompts: mx.array  # B_g, P
    eos: set[int]


@dataclass
class Reference:
    """What the full cache did: the answers it got right, its distributions and traces."""

    solved: list[list[bool]]  # per retrieval task, per answer
    logprobs: mx.array  # n_fidelity, L - score_from, V
    traces: list[list[int]]


def build_workload(tokenizer: Any, config: EvalConfig) -> Workload:
    """Generate every task of the run (deterministic for ``config.seed``)."""
    L = config.context
    retrieval = make_retrieval_tasks(tokenizer, config.retrieval, L, seed=config.seed)
    texts = make_fidelity_texts(tokenizer, config.fidelity, L, seed=config.seed)
    generation = make_generation_tasks(tokenizer, config.generation, config.prompt_tokens, seed=config.seed)
    rows = [t.tokens for t in retrieval] + texts
    # The whole prompt of every row arrives in the first call, as a real prompt does (a policy
    # that pins the prompt sees all of it); shorter prompts bring a few reasoning tokens along.
    prefill = max((len(t.prompt) for t in retrieval), default=config.step)
    return Workload(
        teacher=mx.array(rows, dtype=mx.int32),
        prefill=prefill,
        retrieval=retrieval,
        n_fidelity=len(texts),
        score_from=L // 2,
        prompts=mx.array([g.prompt for g in generation], dtype=mx.int32),
        eos=set(getattr(tokenizer, "eos_token_ids", None) or ()),
    )


def chunk_bounds(length: int, prefill: int, step: int) -> list[tuple[int, int]]:
    """``[0, prefill)`` in one call, then ``step``-token chunks up to ``length``."""
    cuts = [0, *range(min(prefill, length), length, step), length]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def kl_divergence(ref_logprobs: mx.array, logprobs: mx.array) -> mx.array:
    """``KL(p_ref ‖ p)`` in nats over the last axis: ``Σ p_ref (log p_ref − log p)``."""
    return (mx.exp(ref_logprobs) * (ref_logprobs - logprobs)).sum(axis=-1)


def answer_correct(task: RetrievalTask, predicted: list[int]) -> list[bool]:
    """Per answer: is every answer token the greedy prediction of the position before it?"""
    tokens = task.tokens
    return [all(predicted[p - 1] == tokens[p] for p in span) for span in task.answer_positions()]


def retained_answers(correct: list[list[bool]], solved: list[list[bool]]) -> list[bool]:
    """Per answer the full cache got right (``solved``, per task and answer): still right here?"""
    return [ok for task_ok, task_ref in zip(correct, solved) for ok, r in zip(task_ok, task_ref) if r]


def divergence(reference: list[int], trace: list[int]) -> int:
    """Tokens ``trace`` shares with ``reference`` before the first difference."""
    for i, (a, b) in enumerate(zip(reference, trace)):
        if a != b:
            return i
    return min(len(reference), len(trace))


def trace_length(trace: list[int], eos: set[int]) -> int:
    """Tokens up to and including the first end-of-turn token (all of them if none)."""
    for i, tok in enumerate(trace):
        if tok in eos:
            return i + 1
    return len(trace)


def teacher_force(
    model: nn.Module, caches: list[Any], work: Workload, step: int, ref: mx.array | None
) -> tuple[list[list[int]], mx.array, float, float]:
    """Feed the teacher-forced batch; return predictions, fidelity logprobs or scores.

    Returns:
        ``(argmax per retrieval row, logprobs of scored fidelity positions (reference
        only, else empty), mean top-1 agreement, mean KL)``; the last two are NaN
        for the reference.
    """
    n_ret = len(work.retrieval)
    predicted, kept, agree, kl = [], [], mx.array(0.0), mx.array(0.0)
    for a, b in chunk_bounds(work.teacher.shape[1], work.prefill, step):
        logits = model(work.teacher[:, a:b], cache=caches)  # B, S, V
        predicted.append(logits[:n_ret].argmax(axis=-1))
        lo = max(a, work.score_from)
        if work.n_fidelity and b > lo:
            lp = log_softmax(logits[n_ret:, lo - a :])  # F, S', V
            if ref is None:
                kept.append(lp)
            else:
                r = ref[:, lo - work.score_from : b - work.score_from]
                agree = agree + (lp.argmax(axis=-1) == r.argmax(axis=-1)).sum()
                kl = kl + kl_divergence(r, lp).sum()
        mx.eval(predicted[-1], kept, agree, kl, cache_arrays(caches))
    rows = mx.concatenate(predicted, axis=1).tolist() if n_ret else []
    count = work.n_fidelity * (work.teacher.shape[1] - work.score_from)
    if ref is None:
        logprobs = mx.concatenate(kept, axis=1) if kept else mx.zeros((0,))
        return rows, logprobs, math.nan, math.nan
    return rows, mx.zeros((0,)), agree.item() / max(count, 1), kl.item() / max(count, 1)


def cache_arrays(caches: list[Any]) -> list[Any]:
    """The arrays a cache step leaves lazy; evaluating them keeps each step's graph small."""
    import mlxevict

    return [c.state[:4] if isinstance(c, mlxevict.EvictingKVCache) else c.state[:2] for c in caches if not c.empty()]


def greedy(model: nn.Module, caches: list[Any], prompts: mx.array, new_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy decoding of the ``(B, P)`` prompts; returns traces and decode tokens/s (all rows)."""
    logits = model(prompts, cache=caches)
    y = logits[:, -1].argmax(axis=-1)
    mx.eval(y)
    out = [y]
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        y = model(y[:, None], cache=caches)[:, -1].argmax(axis=-1)
        mx.eval(y)
        out.append(y)
    seconds = time.perf_counter() - start
    traces = mx.stack(out, axis=1).tolist()
    return traces, prompts.shape[0] * (new_tokens - 1) / max(seconds, 1e-9)


def measure(
    model: nn.Module,
    name: str,
    fraction: float | None,
    budgets: tuple[int | None, int | None],
    work: Workload,
    config: EvalConfig,
    ref: Reference | None,
) -> tuple[dict[str, Any], Reference]:
    """Run every task with one cache; return its row (and, for the reference, what it did).

    ``budgets``: entries per layer for the teacher-forced tasks and for generation.
    """
    budget, gen_budget = budgets
    release(reset_peak=True)
    started = time.perf_counter()
    caches = make_caches(model, name, budget, config.settings)
    predicted, logprobs, top1, kl = teacher_force(
        model, caches, work, config.step, None if ref is None else ref.logprobs
    )
    per_row_kv = kv_bytes(caches) // max(work.teacher.shape[0], 1)
    per_row_kv16 = kv_bytes_16bit(caches) // max(work.teacher.shape[0], 1)
    teacher_seconds = time.perf_counter() - started
    del caches
    release(reset_peak=False)
    caches = make_caches(model, name, gen_budget, config.settings)
    traces, tok_s = greedy(model, caches, work.prompts, config.new_tokens)
    del caches
    row: dict[str, Any] = {
        "cache": name,
        "kind": "mlx-lm" if name in MLX_LM_CACHES else "mlxevict",
        "budget_fraction": fraction,
        "budget": budget,
        "generation_budget": gen_budget,
    }
    correct = [answer_correct(t, p) for t, p in zip(work.retrieval, predicted)]
    if ref is None:
        ref = Reference(correct, logprobs, traces)
        top1, kl = 1.0, 0.0
    solved = retained_answers(correct, ref.solved)
    ref_lengths = [trace_length(t, work.eos) for t in ref.traces]
    agreed = [divergence(r[:n], t) for r, t, n in zip(ref.traces, traces, ref_lengths)]
    lengths = [trace_length(t, work.eos) for t in traces]
    row.update(
        retrieval_accuracy=sum(solved) / len(solved) if solved else None,
        retrieval_answers=len(solved),
        fidelity_top1=top1,
        fidelity_kl=kl,
        generation_agreement=_mean(agreed),
        generation_agreement_fraction=_mean([a / n for a, n in zip(agreed, ref_lengths)]),
        trace_length=_mean(lengths),
        decode_tok_s=tok_s,
        peak_memory=mx.get_peak_memory(),
        kv_bytes=per_row_kv,
        kv_bytes_16bit=per_row_kv16,
        seconds=time.perf_counter() - started,
        teacher_seconds=teacher_seconds,
    )
    return row, ref


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def run_eval(model: nn.Module, tokenizer: Any, config: EvalConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Evaluate every cache of ``config`` at every budget; return the results as data.

    Args:
        model: a loaded mlx-lm model (patched for the run, restored after).
        tokenizer: its tokenizer (mlx-lm's wrapper, or anything with ``encode``).
        config: what to run.
        progress: called with a short label before each run (for a progress bar).

    Returns:
        ``{"kind": "eval", "config": ..., "rows": [...], "skipped": [...], ...}``; each
        row has retrieval accuracy, fidelity top-1 and KL, generation agreement,
        trace length, decode tok/s and its ratio to the full cache, peak memory and
        KV bytes (per sequence, at the full context).

    Raises:
        ValueError: a context too short for the tasks.
    """
    import mlxevict

    work = build_workload(tokenizer, config)
    rows: list[dict[str, Any]] = []
    ref = None
    with mlxevict.patched(model):
        runs, skipped = [], []
        for name, fraction in config.runs():
            budgets = config.budgets(model, name, fraction)
            why = None
            if fraction is not None:
                why = check_budget(name, budgets[0], config.settings) or check_budget(name, budgets[1], config.settings)
            if why:
                skipped.append({"cache": name, "budget_fraction": fraction, "reason": why})
            elif name != REFERENCE:
                runs.append((name, fraction, budgets))
        # Warm up (weights paged in, kernels built) so the reference's timing is not the slowest.
        greedy(model, make_caches(model, REFERENCE, None, config.settings), work.prompts[:, :16], 4)
        for name, fraction, budgets in [(REFERENCE, None, (None, None)), *runs]:
            if progress:
                progress(name if fraction is None else f"{name} @ {fraction:g}")
            row, ref = measure(model, name, fraction, budgets, work, config, ref)
            rows.append(row)
    base = rows[0]
    for row in rows:
        row["decode_ratio"] = row["decode_tok_s"] / base["decode_tok_s"]
        row["kv_fraction"] = row["kv_bytes"] / base["kv_bytes"] if base["kv_bytes"] else None
        row["kv_fraction_16bit"] = row["kv_bytes_16bit"] / base["kv_bytes_16bit"] if base["kv_bytes_16bit"] else None
        row["trace_length_ratio"] = row["trace_length"] / base["trace_length"] if base["trace_length"] else None
    return {
        "kind": "eval",
        "reference": REFERENCE,
        "default_policy": mlxevict.DEFAULT_POLICY,
        "config": {
            "context": config.context,
            "generation_context": config.generation_context,
            "fractions": list(config.fractions),
            "budgets_of": "memory" if config.memory else "context",
            "retrieval_tasks": config.retrieval,
            "retrieval_answers_total": sum(len(t.answers) for t in work.retrieval),
            "retrieval_answers_solved_by_full_cache": sum(map(sum, ref.solved)),
            "fidelity_texts": config.fidelity,
            "fidelity_scored_from": work.score_from,
            "generation_prompts": config.generation,
            "prompt_tokens": config.prompt_tokens,
            "new_tokens": config.new_tokens,
            "step": config.step,
            "seed": config.seed,
            "sinks": config.settings.sinks,
            "window": config.settings.window,
            "slack": config.settings.slack,
        },
        "rows": rows,
        "skipped": skipped,
    }
