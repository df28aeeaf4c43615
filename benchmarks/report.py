"""Results for people and machines: JSON, Markdown tables and PNG plots (matplotlib Agg)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from .style import DEFAULT_POLICY, canonical, groups, percent, style

KIB, MIB = 1024, 1024**2
QUALITY_METRICS = (
    ("retrieval_accuracy", "retrieval accuracy"),
    ("fidelity_top1", "fidelity top-1"),
    ("fidelity_kl", "KL (nats)"),
)  # row key, plot title


def write_json(results: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, allow_nan=True) + "\n")
    return path


def _num(value: Any, fmt: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, fmt)


def _bytes(value: Any) -> str:
    if value is None:
        return "–"
    return f"{value / MIB:.1f} MiB" if value >= MIB else f"{value / KIB:.0f} KiB"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _label(row: dict[str, Any], default_policy: str) -> str:
    name = row["cache"]
    base, _, storage = name.partition(":")
    return f"{name} (= default{':' + storage if storage else ''})" if base == default_policy else name


def _budget_note(cfg: dict[str, Any]) -> str:
    if cfg.get("budgets_of") == "memory":
        return (
            "budget = fraction of the KV bytes of a 16-bit full cache at that context; each cache keeps the "
            "entries per layer (in brackets) its storage fits in them"
        )
    return "budget = fraction of the context, entries per layer (in brackets)"


def eval_markdown(results: dict[str, Any]) -> str:
    """The eval table: one line per cache and budget, the full cache first."""
    cfg = results["config"]
    rows = sorted(
        results["rows"],
        key=lambda r: (r["budget_fraction"] is not None, -(r["budget_fraction"] or 0), r["kind"] != "mlx-lm"),
    )
    body = [
        [
            _label(r, results["default_policy"]),
            "all" if r["budget_fraction"] is None else f"{r['budget_fraction']:g} ({r['budget']})",
            _num(r["retrieval_accuracy"], ".2f"),
            _num(r["fidelity_top1"]),
            _num(r["fidelity_kl"]),
            _num(r["generation_agreement"], ".1f"),
            _num(r["trace_length"], ".1f"),
            _num(r["decode_ratio"], ".2f"),
            _bytes(r["peak_memory"]),
            _bytes(r["kv_bytes"]),
            _num(r["kv_fraction_16bit"]),
        ]
        for r in rows
    ]
    head = [
        "cache", "budget", "retrieval acc.", "fidelity top-1", "KL (nats)", "gen. agreement (tokens)",
        "trace length", "decode × full (noisy)", "peak memory", "KV bytes / seq.", "KV / 16-bit full",
    ]  # fmt: skip
    notes = [
        f"Context {cfg['context']} tokens (generation: {cfg['prompt_tokens']} prompt + {cfg['new_tokens']} "
        f"generated); {_budget_note(cfg)}. Retrieval accuracy over the "
        f"{cfg['retrieval_answers_solved_by_full_cache']} of {cfg['retrieval_answers_total']} answers the full "
        "cache gets right. Fidelity over the second half of "
        f"{cfg['fidelity_texts']} natural texts; generation agreement: greedy tokens equal to the full cache's "
        f"before the first difference (of {cfg['new_tokens']}), mean over {cfg['generation_prompts']} prompts. "
        "Decode × full is one batched measurement per cache, sequential, so it moves with the machine's load; "
        "`mlxevict bench` measures speed properly. KV / 16-bit full: KV bytes relative to a 16-bit full "
        "`KVCache` holding the whole context, as a 16-bit model holds them (floats at 2 bytes, packed words as "
        "they are; mlx-lm's caches by the entries they hold, mlxevict's by their fixed allocation); "
        "`NAME:q8`/`:q4` store what they keep in 8/4 bits (4 bits rotated, see `mlxevict.quantized`); "
        "`:q4w8` keeps the recent window in 8 bits instead of full precision; `:k5v3w8` too, with keys in 5 bits "
        "and values in 3.",
    ]
    skipped = "".join(f"\n- skipped {s['cache']} @ {s['budget_fraction']:g}: {s['reason']}" for s in results["skipped"])
    return table(head, body) + "\n\n" + " ".join(notes) + skipped + "\n"


def bench_markdown(results: dict[str, Any]) -> str:
    """The bench tables: decode at one budget, then the context sweep."""
    cfg = results["config"]
    out = []
    if results["decode"]:
        body = [
            [
                _label(r, results["default_policy"]),
                str(r["budget"] or "all"),
                _num(r["decode_tok_s"], ".1f"),
                _num(r["ratio_to_rotating"], ".2f"),
                _num(r["ratio_to_kvcache"], ".2f"),
                _bytes(r["peak_memory"]),
                _bytes(r["kv_bytes"]),
            ]
            for r in results["decode"]
        ]
        out.append(
            f"Decode, {cfg['new_tokens']} generated tokens after a {cfg['prompt_tokens']}-token prompt, "
            f"budget {cfg['budget']}; ratios are medians over rounds of {cfg['segment']} tokens taken in turn.\n\n"
            + table(
                ["cache", "budget", "decode tok/s", "× rotating", "× kvcache", "peak memory", "KV bytes"], body
            )
        )
    if results["context"]:
        body = [
            [
                _label(r, results["default_policy"]),
                str(r["context"]),
                _num(r["prefill_tok_s"], ".1f"),
                _num(r["prefill_ratio"], ".2f"),
                _num(r["decode_tok_s"], ".1f"),
                _num(r["decode_ratio"], ".2f"),
                _bytes(r["peak_memory"]),
                _bytes(r["kv_bytes"]),
            ]
            for r in sorted(results["context"], key=lambda r: (r["context"], r["kind"] != "mlx-lm"))
        ]
        out.append(
            f"Context sweep: prefill of a random prompt, then {cfg['probe_tokens']} decode steps, one cache "
            f"at a time; budget {cfg['budget']}; ratios to kvcache at the same length, median of "
            f"{cfg['repeats']} repeat(s).\n\n"
            + table(
                ["cache", "context", "prefill tok/s", "× kvcache", "decode tok/s", "× kvcache", "peak memory", "KV bytes"],
                body,
            )
        )
    skipped = "".join(f"\n- skipped {s['cache']}: {s['reason']}" for s in results["skipped"])
    return "\n\n".join(out) + "\n" + skipped


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _legend_name(name: str, default_policy: str) -> str:
    if name == "default":
        return f"default ({default_policy})"
    return f"{name} (default)" if canonical(name, default_policy) == default_policy else name


def _percent_axis(ax, smallest: float) -> None:
    """A log2 x axis labelled in percent (12.5%, 25%, 50%, 100%), from the power of 2 under ``smallest``
    to 100%, the same in every panel."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xlim(2 ** math.floor(math.log2(smallest)) / 1.15, 1.15)
    ax.xaxis.set_major_locator(LogLocator(base=2))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: percent(value)))


def plot_quality(rows: list[dict[str, Any]], path: Path, **options: Any) -> Path:
    """:func:`quality_figure` saved to ``path``."""
    return _save(quality_figure(rows, **options), path)


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight": the legends outside the panels stay in
    _pyplot().close(fig)
    return path


def quality_figure(rows: list[dict[str, Any]], *, x, xlabel: str, title: str, default_policy: str, log_kl: bool):
    """Retrieval, fidelity top-1 and KL (columns) against ``x(row)``, one row of panels per group of caches.

    Each cache keeps its colour, marker and line style (``benchmarks.style``); a row holds at most
    ``MAX_SERIES`` of them, with the default policy and the full cache as references, and its legend
    sits outside the panels. With ``log_kl``, KL is on a log scale with zero drawn at 1e-5.
    """
    plt = _pyplot()
    by_cache: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_cache.setdefault(r["cache"], []).append(r)
    panels = groups(by_cache, default_policy)
    smallest = min((x(r) for r in rows if x(r)), default=0.125)
    fig, axes = plt.subplots(len(panels), len(QUALITY_METRICS), figsize=(15, 3.4 * len(panels)), squeeze=False)
    for row_axes, (group, names) in zip(axes, panels):
        for ax, (key, metric) in zip(row_axes, QUALITY_METRICS):
            for name in names:
                pts = sorted(
                    (x(r), max(r[key], 1e-5) if log_kl and key == "fidelity_kl" else r[key])
                    for r in by_cache[name]
                    if r[key] is not None and not _isnan(r[key]) and x(r) is not None
                )
                if pts:
                    ax.plot(
                        [p[0] for p in pts], [p[1] for p in pts], label=_legend_name(name, default_policy),
                        markersize=5, linewidth=1.4, **style(name, default_policy).kwargs(),
                    )  # fmt: skip
            _percent_axis(ax, smallest)
            if log_kl and key == "fidelity_kl":
                ax.set_yscale("log")
            ax.set_title(f"{metric}: {group}", fontsize=10)
            ax.set_xlabel(xlabel, fontsize=9)
            ax.grid(alpha=0.3)
        row_axes[-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))  # the title clear of the top panels
    return fig


def plot_eval(results: dict[str, Any], path: Path) -> Path:
    """``eval.png``: :func:`eval_figure` saved."""
    return _save(eval_figure(results), path)


def eval_figure(results: dict[str, Any]):
    """Quality vs the kept fraction (or, with ``--memory``, vs the budget in KV memory)."""
    memory = results["config"].get("budgets_of") == "memory"
    xlabel = (
        "budget (% of a 16-bit full cache's KV bytes)"
        if memory
        else "kept (% of the context's tokens; quantized: % of 16-bit bytes)"
    )
    what = "the KV memory budget" if memory else "kept fraction"
    return quality_figure(
        results["rows"], x=_kept, xlabel=xlabel, default_policy=results.get("default_policy", DEFAULT_POLICY),
        title=f"mlxevict eval: quality vs {what} ({results.get('model', '')})", log_kl=False,
    )  # fmt: skip


def plot_bytes(rows: list[dict[str, Any]], path: Path, title: str, default_policy: str = DEFAULT_POLICY) -> Path:
    """Quality vs KV bytes relative to a 16-bit full cache (the quality-per-byte frontier); KL on a log scale."""
    return plot_quality(
        rows, path, x=lambda r: r["kv_fraction_16bit"], xlabel="KV bytes (% of a 16-bit full cache's)",
        title=title, default_policy=default_policy, log_kl=True,
    )  # fmt: skip


def _kept(row: dict[str, Any]) -> float:
    """The budget fraction; for quantized caches (which keep every token) their bytes relative to 16 bits."""
    if row["budget_fraction"] is not None:
        return row["budget_fraction"]
    if row["cache"].startswith("quantized"):
        return row.get("kv_fraction_16bit") or row.get("kv_fraction") or 1.0  # older results: no 16-bit column
    return 1.0


def _isnan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def plot_memory(results: dict[str, Any], path: Path) -> Path:
    """``memory.png``: :func:`memory_figure` saved."""
    return _save(memory_figure(results), path)


def memory_figure(results: dict[str, Any]):
    """Peak memory and KV bytes (columns) vs context length, one row of panels per group of caches."""
    plt = _pyplot()
    default_policy = results.get("default_policy", DEFAULT_POLICY)
    by_cache: dict[str, list[dict[str, Any]]] = {}
    for r in results["context"]:
        by_cache.setdefault(r["cache"], []).append(r)
    panels = groups(by_cache, default_policy)
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 3.4 * len(panels)), squeeze=False)
    for row_axes, (group, names) in zip(axes, panels):
        for ax, key, metric in zip(row_axes, ("peak_memory", "kv_bytes"), ("peak memory (MiB)", "KV cache (MiB)")):
            for name in names:
                rows = sorted(by_cache[name], key=lambda r: r["context"])
                ax.plot(
                    [r["context"] for r in rows], [r[key] / MIB for r in rows],
                    label=_legend_name(name, default_policy), markersize=5, linewidth=1.4,
                    **style(name, default_policy).kwargs(),
                )  # fmt: skip
            ax.set_xscale("log", base=2)
            contexts = sorted({r["context"] for r in results["context"]})
            ax.set_xticks(contexts, [str(c) for c in contexts])
            ax.minorticks_off()
            ax.set_xlabel("context length (tokens)", fontsize=9)
            ax.set_ylabel(metric, fontsize=9)
            ax.set_title(f"{metric}: {group}", fontsize=10)
            ax.grid(alpha=0.3)
        row_axes[-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    budget = results["config"]["budget"]
    fig.suptitle(f"mlxevict bench: memory vs context length, budget {budget} ({results.get('model', '')})")
    fig.tight_layout()
    return fig


def write_eval(results: dict[str, Any], out: Path) -> list[Path]:
    """``eval.json``, ``eval.md``, ``eval.png`` (vs kept fraction) and ``eval_bytes.png`` (vs KV bytes) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    md = out / "eval.md"
    md.write_text(eval_markdown(results))
    title = f"mlxevict eval: quality vs KV bytes ({results.get('model', '')})"
    default_policy = results.get("default_policy", DEFAULT_POLICY)
    return [
        write_json(results, out / "eval.json"),
        md,
        plot_eval(results, out / "eval.png"),
        plot_bytes(results["rows"], out / "eval_bytes.png", title, default_policy),
    ]


def write_bench(results: dict[str, Any], out: Path) -> list[Path]:
    """``bench.json``, ``bench.md`` and (with a context sweep) ``memory.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    md = out / "bench.md"
    md.write_text(bench_markdown(results))
    paths = [write_json(results, out / "bench.json"), md]
    if results["context"]:
        paths.append(plot_memory(results, out / "memory.png"))
    return paths
