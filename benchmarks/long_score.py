"""The long suite's scores: a run's outcome on a batch, the full cache's kept between runs, and result rows."""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from . import storage_variants as sv
from .caches import MLX_LM_CACHES, split_storage
from .long_feed import Batch
from .long_runs import LongConfig, Run
from .quality import kl_divergence, log_softmax


@dataclass
class Outcome:
    """What one run did on one batch."""

    correct: list[list[bool]] = field(default_factory=list)  # per row, per answer
    logprobs: mx.array | None = None  # reference only: fidelity tail
    top1: float = math.nan
    kl: float = math.nan
    kv_fraction: float = math.nan
    top1_by_text: list[float] = field(default_factory=list)  # fidelity and recall, per text
    kl_by_text: list[float] = field(default_factory=list)


def score(batch: Batch, logits: mx.array, ref: Outcome | None) -> Outcome:
    """Retrieval answers or fidelity against the reference's outcome (``None``: this is the reference)."""
    if batch.rows:
        pred = logits.argmax(axis=-1).tolist()  # B, T
        pad = [0] * batch.tail  # predictions index absolute positions
        return Outcome(correct=[r.correct(pad + p) for r, p in zip(batch.rows, pred)])
    lp = log_softmax(logits)
    if ref is None:
        return _reference(lp)
    agree = lp.argmax(axis=-1) == ref.logprobs.argmax(axis=-1)  # B, T
    kl = kl_divergence(ref.logprobs, lp)
    return Outcome(
        top1=agree.mean().item(), kl=kl.mean().item(),
        top1_by_text=agree.mean(axis=-1).tolist(), kl_by_text=kl.mean(axis=-1).tolist(),
    )  # fmt: skip


def _reference(logprobs: mx.array) -> Outcome:
    """The full cache's fidelity outcome: its own distributions, agreeing with itself."""
    n = logprobs.shape[0]
    return Outcome(logprobs=logprobs, top1=1.0, kl=0.0, top1_by_text=[1.0] * n, kl_by_text=[0.0] * n)


def reference_path(config: LongConfig, split: str, batch: Batch) -> Path | None:
    """Where the full cache's outcome on ``batch`` is kept between runs (``config.reference_dir``), or ``None``."""
    if not config.reference_dir:
        return None
    digest = zlib.crc32(np.asarray(batch.tokens).tobytes())
    return Path(config.reference_dir) / f"{split}-{batch.name.replace(' ', '')}-{batch.tail}-{digest:08x}"


def save_reference(path: Path, out: Outcome) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if out.logprobs is not None:
        mx.save(str(path.with_suffix(".npy")), out.logprobs)
    path.with_suffix(".json").write_text(json.dumps({"correct": out.correct, "kv_fraction": out.kv_fraction}))


def load_reference(path: Path) -> Outcome:
    meta = json.loads(path.with_suffix(".json").read_text())
    npy = path.with_suffix(".npy")
    if npy.exists():
        return replace(_reference(mx.load(str(npy))), correct=meta["correct"], kv_fraction=meta["kv_fraction"])
    return Outcome(meta["correct"], kv_fraction=meta["kv_fraction"])


def same_as(run: Run, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The token-budget row that a 16-bit cache's memory-budget ``run`` repeats, if measured."""
    if run.budget_of != "memory" or run.cache in sv.VARIANTS or split_storage(run.cache)[1]:
        return None
    match = (run.cache, "tokens", run.fraction, run.protocol)
    return next((r for r in rows if (r["cache"], r["budget_of"], r["fraction"], r["protocol"]) == match), None)


def result_row(run: Run, outcomes: dict[str, Outcome], refs: dict[str, Outcome], batches: list[Batch], seconds: float) -> dict[str, Any]:
    row: dict[str, Any] = {
        "cache": run.cache, "budget_of": run.budget_of, "fraction": run.fraction, "protocol": run.protocol,
        "kind": "mlx-lm" if split_storage(run.cache)[0] in MLX_LM_CACHES else "mlxevict", "seconds": round(seconds, 1),
    }  # fmt: skip
    kept, by_length, by_kind = [], {}, {}
    for batch in batches:
        if not batch.rows:
            continue
        solved = refs[batch.name].correct
        for r, ok, ref in zip(batch.rows, outcomes[batch.name].correct, solved):
            hits = [o for o, s in zip(ok, ref) if s]
            kept += hits
            by_length.setdefault(str(batch.tokens.shape[1]), []).extend(hits)
            by_kind.setdefault(r.kind, []).extend(hits)
    row["retrieval"] = [sum(kept), len(kept)]
    row["retrieval_accuracy"] = sum(kept) / len(kept) if kept else None
    row["retrieval_by_length"] = {k: [sum(v), len(v)] for k, v in by_length.items()}
    row["retrieval_by_kind"] = {k: [sum(v), len(v)] for k, v in by_kind.items()}
    for name in ("fidelity", "recall"):
        out = outcomes.get(name)
        row[f"{name}_top1"] = out.top1 if out else None
        row[f"{name}_kl"] = out.kl if out else None
        if out and out.kl_by_text:
            row[f"{name}_top1_by_text"] = out.top1_by_text
            row[f"{name}_kl_by_text"] = out.kl_by_text
    fractions = [o.kv_fraction for o in outcomes.values()]
    row["kv_fraction_16bit"] = max(fractions) if fractions else None
    return row


def describe_batches(batches: list[Batch]) -> list[dict[str, Any]]:
    out = []
    for b in batches:
        out.append({
            "batch": b.name, "rows": int(b.tokens.shape[0]), "tokens": int(b.tokens.shape[1]), "tail_from": b.tail,
            "kinds": [r.kind for r in b.rows], "depths": [[round(d, 2) for d in r.depths] for r in b.rows],
            **({"leads": b.leads} if b.leads else {}), **({"restated_from": b.restated_from} if b.restated_from else {}),
        })  # fmt: skip
    return out
