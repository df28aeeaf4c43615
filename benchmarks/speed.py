"""``mlxevict bench``: decode and prefill speed, peak memory and KV bytes per cache.

Two parts, both against mlx-lm's caches measured in the same run:

- decode: a long generation (default 1,000 tokens at budget 256) with mlx-lm's own
  ``generate_step`` for every cache. The caches take turns, ``segment`` tokens each,
  round after round, so a colleague's job or a thermal dip slows all of them
  alike; each round gives every cache a tokens/s ratio to ``rotating`` and to
  ``kvcache``, and the report keeps the median over rounds.
- context: prefill of random prompts of growing length (fed as ``generate_step`` feeds
  them: 2,048-token chunks, then the last token), then a few decode steps,
  one cache at a time (so ``mx.get_peak_memory()`` is that cache's own peak);
  ratios to ``kvcache`` at the same length, median over repeats.

Peak memory in the decode part is estimated for a cache running alone: the
model's weights, the cache's own bytes and the largest transient a segment needed
(``peak − active`` at its start); the other caches that wait their turn are not counted.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from .caches import MLX_LM_CACHES, REFERENCE, CacheSettings, check_budget, kv_bytes, make_caches, release, takes_budget

ROTATING = "rotating"
DEFAULT_CONTEXTS = (256, 512, 1024)  # 2048+ with the quantized caches is slow on a CPU; --contexts
# The context sweep is long; by default it covers mlx-lm's caches and the three
# policies the project is about. ``--policies`` overrides it.
CONTEXT_NAMES = ("kvcache", "rotating", "quantized8", "quantized4", "default", "entropy", "uncertainty")
PREFILL_STEP = 2048  # mlx-lm's prefill_step_size

Progress = Callable[[str], None]


@dataclass(frozen=True)
class BenchConfig:
    """What ``mlxevict bench`` runs. Defaults fit ~30 minutes on a 2-core CPU with SmolLM2-135M."""

    names: tuple[str, ...]
    context_names: tuple[str, ...] = CONTEXT_NAMES
    budget: int = 256
    new_tokens: int = 1000
    segment: int = 50
    prompt_tokens: int = 64
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    probe_tokens: int = 16
    repeats: int = 1
    seed: int = 0
    settings: CacheSettings = field(default_factory=CacheSettings)


def model_nbytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def random_prompt(length: int, vocab: int, seed: int) -> mx.array:
    """``(length,)`` random token ids, the same for every cache of a run."""
    return mx.random.randint(0, vocab, (length,), key=mx.random.key(seed))


def bench_decode(model: nn.Module, config: BenchConfig, progress: Progress | None = None) -> list[dict[str, Any]]:
    """Round-robin decoding of ``new_tokens`` tokens with every cache; one row per cache."""
    names = [n for n in config.names if not check_budget(n, config.budget, config.settings)]
    prompt = random_prompt(config.prompt_tokens, model.args.vocab_size, config.seed)
    weights = model_nbytes(model)
    state = {}
    for name in names:
        caches = make_caches(model, name, config.budget, config.settings)
        gen = generate_step(prompt, model, prompt_cache=caches, max_tokens=config.new_tokens)
        state[name] = {"caches": caches, "gen": gen, "tokens": 0, "seconds": 0.0, "rates": [], "transient": 0}
    rounds = max(1, -(-(config.new_tokens - 1) // config.segment))
    for r in range(rounds + 1):
        if progress:
            progress(f"decode round {r}/{rounds}")
        order = names[r % len(names) :] + names[: r % len(names)]  # no cache always goes first
        for name in order:
            s = state[name]
            want = 1 if r == 0 else min(config.segment, config.new_tokens - s["tokens"])
            if want <= 0:
                continue
            release(reset_peak=False)
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            start = time.perf_counter()
            for _ in range(want):
                next(s["gen"])
            seconds = time.perf_counter() - start
            s["transient"] = max(s["transient"], mx.get_peak_memory() - before)
            s["tokens"] += want
            if r:  # round 0 is the prompt and the first token
                s["seconds"] += seconds
                s["rates"].append(want / seconds)
    rows = []
    for name in names:
        s = state[name]
        ratios = {}
        for base in (ROTATING, REFERENCE):
            if base in state:
                per_round = [a / b for a, b in zip(s["rates"], state[base]["rates"])]
                ratios[base] = statistics.median(per_round) if per_round else None
        own = kv_bytes(s["caches"])
        rows.append(
            {
                "cache": name,
                "kind": "mlx-lm" if name in MLX_LM_CACHES else "mlxevict",
                "budget": config.budget if takes_budget(name) else None,
                "tokens": s["tokens"],
                "decode_tok_s": (s["tokens"] - 1) / s["seconds"] if s["seconds"] else None,
                "decode_tok_s_median": statistics.median(s["rates"]) if s["rates"] else None,
                "round_tok_s": s["rates"],  # per round, for ratios to any other cache of the run
                "ratio_to_rotating": ratios.get(ROTATING),
                "ratio_to_kvcache": ratios.get(REFERENCE),
                "kv_bytes": own,
                "peak_memory": weights + own + s["transient"],
                "step_memory": s["transient"],
            }
        )
        s["caches"] = s["gen"] = None
    release()
    return rows


def bench_context(model: nn.Module, config: BenchConfig, progress: Progress | None = None) -> list[dict[str, Any]]:
    """Prefill ``L`` random tokens then decode ``probe_tokens``, each cache alone; rows per (cache, L)."""
    names = [REFERENCE, *[n for n in config.context_names if n != REFERENCE]]
    raw: dict[tuple[str, int], list[dict[str, float]]] = {}
    for rep in range(config.repeats):
        for L in config.contexts:
            prompt = random_prompt(L, model.args.vocab_size, config.seed + L)[None]
            for name in names:
                if check_budget(name, config.budget, config.settings):
                    continue
                if progress:
                    progress(f"context {L} {name} (repeat {rep + 1}/{config.repeats})")
                raw.setdefault((name, L), []).append(_prefill_and_probe(model, name, prompt, config))
    rows = []
    for (name, L), runs in raw.items():
        ref = raw[(REFERENCE, L)]
        row = {"cache": name, "kind": "mlx-lm" if name in MLX_LM_CACHES else "mlxevict", "context": L}
        for key in ("prefill_tok_s", "decode_tok_s", "peak_memory", "kv_bytes"):
            row[key] = statistics.median(r[key] for r in runs)
        for key in ("prefill_tok_s", "decode_tok_s", "peak_memory"):
            row[key.replace("_tok_s", "") + "_ratio"] = statistics.median(
                r[key] / b[key] for r, b in zip(runs, ref) if b[key]
            )
        row["budget"] = config.budget if takes_budget(name) else None
        rows.append(row)
    return rows


def _prefill_and_probe(model: nn.Module, name: str, prompt: mx.array, config: BenchConfig) -> dict[str, float]:
    release()
    caches = make_caches(model, name, config.budget, config.settings)
    L = prompt.shape[1]
    start = time.perf_counter()
    # As mlx-lm's generate_step feeds a prompt: chunks whose logits nobody reads, then the last token.
    for a in range(0, L - 1, PREFILL_STEP):
        model(prompt[:, a : min(a + PREFILL_STEP, L - 1)], cache=caches)
        mx.eval([c.state for c in caches])
    logits = model(prompt[:, L - 1 :], cache=caches)
    mx.eval(logits)
    prefill = time.perf_counter() - start
    y = logits[:, -1].argmax(axis=-1)
    start = time.perf_counter()
    for _ in range(config.probe_tokens):
        y = model(y[:, None], cache=caches)[:, -1].argmax(axis=-1)
        mx.eval(y)
    decode = time.perf_counter() - start
    result = {
        "prefill_tok_s": L / prefill,
        "decode_tok_s": config.probe_tokens / decode,
        "peak_memory": float(mx.get_peak_memory()),
        "kv_bytes": float(kv_bytes(caches)),
    }
    del caches, logits
    return result


def run_bench(model: nn.Module, config: BenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Both parts of the benchmark; returns the results as data (see the module docstring)."""
    import mlxevict

    skipped = [
        {"cache": n, "budget": config.budget, "reason": why}
        for n in dict.fromkeys([*config.names, *config.context_names])
        if (why := check_budget(n, config.budget, config.settings))
    ]
    with mlxevict.patched(model):
        decode = bench_decode(model, config, progress) if config.new_tokens > 0 else []
        context = bench_context(model, config, progress) if config.contexts else []
    return {
        "kind": "bench",
        "reference": REFERENCE,
        "default_policy": mlxevict.DEFAULT_POLICY,
        "config": {
            "budget": config.budget,
            "new_tokens": config.new_tokens,
            "segment": config.segment,
            "prompt_tokens": config.prompt_tokens,
            "contexts": list(config.contexts),
            "probe_tokens": config.probe_tokens,
            "repeats": config.repeats,
            "seed": config.seed,
            "sinks": config.settings.sinks,
            "window": config.settings.window,
            "slack": config.settings.slack,
            "model_bytes": model_nbytes(model),
        },
        "decode": decode,
        "context": context,
        "skipped": skipped,
    }
