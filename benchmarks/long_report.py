"""The long suite's results for people: one table per half, a ranking, and a quality-per-byte plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .caches import REFERENCE
from .long_eval import choose_storage
from .long_tasks import RECALL_FROM
from .report import _num, plot_bytes, table, write_json


def _budget(row: dict[str, Any]) -> str:
    if row["fraction"] is None:
        return "all"
    return f"{row['fraction']:g} of {'bytes' if row['budget_of'] == 'memory' else 'tokens'}"


def _answers(pair: list[int] | None) -> str:
    return "–" if not pair or not pair[1] else f"{pair[0]}/{pair[1]}"


def _name(row: dict[str, Any]) -> str:
    return row["cache"] + (" (picked on tuning)" if row.get("picked_on_tuning") else "")


def split_table(split: dict[str, Any]) -> str:
    """One line per run: retrieval (all, per length, per kind), fidelity, bytes."""
    rows = split["rows"]
    lengths = sorted({k for r in rows for k in r["retrieval_by_length"]}, key=int)
    kinds = sorted({k for r in rows for k in r["retrieval_by_kind"]})
    recall = any(r.get("recall_kl") is not None for r in rows)
    head = ["cache", "protocol", "budget", "retrieval", *(f"{L} tok." for L in lengths), *kinds, "top-1", "KL",
            *(("recall top-1", "recall KL") if recall else ()), "KV / 16-bit full"]  # fmt: skip
    body = [
        [
            _name(r), r["protocol"], _budget(r), _answers(r["retrieval"]),
            *(_answers(r["retrieval_by_length"].get(L)) for L in lengths),
            *(_answers(r["retrieval_by_kind"].get(k)) for k in kinds),
            _num(r["fidelity_top1"]), _num(r["fidelity_kl"], ".4f"),
            *((_num(r.get("recall_top1")), _num(r.get("recall_kl"), ".4f")) if recall else ()), _num(r["kv_fraction_16bit"]),
        ]  # fmt: skip
        for r in rows
    ]
    return table(head, body)


def text_table(split: dict[str, Any]) -> str:
    """KL per fidelity text of every run but the full cache's, headed by the source leading each
    (empty with fewer than two texts)."""
    leads = next((t.get("leads") for t in split.get("tasks", []) if t["batch"] == "fidelity"), None)
    rows = [r for r in split["rows"] if r.get("fidelity_kl_by_text") and r["cache"] != REFERENCE]
    if not leads or len(leads) < 2 or not rows:
        return ""
    head = ["cache", "protocol", "budget", *(f"{i + 1}: {s}" for i, s in enumerate(leads))]
    body = [[_name(r), r["protocol"], _budget(r), *(_num(k, ".4f") for k in r["fidelity_kl_by_text"])] for r in rows]
    return table(head, body)


def ranking(split: dict[str, Any]) -> str:
    """Per budget and protocol, the runs ordered by retrieval answers kept, then by KL (lower first)."""
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for r in split["rows"]:
        if r["fraction"] is not None and r["fidelity_kl"] is not None:
            groups.setdefault((r["budget_of"], r["protocol"], r["fraction"]), []).append(r)
    lines = []
    for (of, protocol, f), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2])):
        rows = sorted(rows, key=lambda r: (-(r["retrieval_accuracy"] or 0.0), r["fidelity_kl"]))
        order = " > ".join(f"`{r['cache']}` ({_answers(r['retrieval'])}, {r['fidelity_kl']:.3f})" for r in rows)
        lines.append(f"- {f:g} of {of}, {protocol}: {order}")
    return "\n".join(lines)


def _recall(cfg: dict[str, Any]) -> str:
    if not cfg.get("recall_texts"):
        return ""
    return (
        f"Recall: {cfg['recall_texts']} text(s) of {cfg['fidelity_length']} tokens whose last {cfg['fidelity_scored']} "
        f"tokens restate, token for token, a passage from {min(RECALL_FROM):.0%}-{max(RECALL_FROM):.0%} into the text, "
        "scored as fidelity (reported; the "
        "storage is picked on retrieval and fidelity). "
    )


def _minutes(results: dict[str, Any]) -> str:
    rows = [r for split in results["splits"].values() for r in split["rows"]]
    return f"{sum(r['seconds'] for r in rows) / 60:.0f} min of runs in all, " if rows else ""


def _lengths(cfg: dict[str, Any]) -> str:
    """The contexts of the halves: ``1024, 2048`` or ``1024 (tuning half), 1024, 2048 (test half)``."""
    test, tuning = ", ".join(map(str, cfg["lengths"])), ", ".join(map(str, cfg.get("tuning_lengths") or ()))
    return test if tuning in ("", test) else f"{tuning} (tuning half), {test} (test half)"


def long_markdown(results: dict[str, Any]) -> str:
    cfg = results["config"]
    out = [
        f"# Long-context evaluation ({results.get('model', '')})\n",
        f"Command: `{results.get('command', '')}` ({_minutes(results)}{results.get('machine', '')}).\n",
        f"Retrieval rows of {_lengths(cfg)} tokens (kinds: {', '.join(cfg['kinds'])}; "
        f"{cfg['instances']} row{'s' if cfg['instances'] > 1 else ''} of each per length), facts inside the streamed prose; an answer counts when every "
        "answer token is the greedy choice under teacher forcing, over the answers the full cache gets. "
        f"Fidelity: the last {cfg['fidelity_scored']} tokens of {cfg['fidelity_texts']} natural texts of "
        f"{cfg['fidelity_length']} tokens, top-1 agreement with the full cache and KL(full ‖ cache) in nats. "
        + _recall(cfg)
        + f"`stream`: {cfg['chunk']}-token chunks under the budget; `compress`: the context held whole and compressed at "
        "the first single-token step. KV / 16-bit full: bytes held as a 16-bit model holds them, relative to a "
        "16-bit full cache (the longest row). Storage picked on the tuning half: "
        + (", ".join(f"{k} of bytes → `{v}`" for k, v in results.get("chosen", {}).items()) or "none")
        + ".\n",
    ]
    for name, split in results["splits"].items():
        out.append(f"## {name} half (seed {split['seed']})\n")
        out.append(split_table(split) + "\n")
        if order := ranking(split):
            out.append("Ranking (retrieval answers, then KL):\n\n" + order + "\n")
        if texts := text_table(split):
            out.append("KL per fidelity text (numbered, with the source leading it):\n\n" + texts + "\n")
        out += [f"- skipped {s['run']}: {s['reason']}" for s in split["skipped"]]
    return "\n".join(out) + "\n"


def _plot_rows(split: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows shaped for :func:`.report.plot_bytes`: one line per cache and protocol."""
    out = []
    for r in split["rows"]:
        label = r["cache"] if r["protocol"] == "stream" else f"{r['cache']} [compress]"
        out.append({**r, "cache": label})
    return out


def write_long(results: dict[str, Any], out: Path) -> list[Path]:
    """``long.json`` (first, so a later failure keeps the data), ``long.md`` and ``long_<half>.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [write_json(results, out / "long.json")]
    md = out / "long.md"
    md.write_text(long_markdown(results))
    return [*paths, md, *plot_long(results, out)]


def plot_long(results: dict[str, Any], out: Path) -> list[Path]:
    """``long_<half>.png`` in ``out``, one per half."""
    paths = []
    for name, split in results["splits"].items():
        title = f"mlxevict eval (long, {name} half): quality per KV byte ({results.get('model', '')})"
        paths.append(plot_bytes(_plot_rows(split), out / f"long_{name}.png", title))
    return paths


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from runs of the same suite split across processes (each run once; the first copy kept)."""
    merged = {k: v for k, v in parts[0].items() if k != "splits"}
    merged["command"] = " ; ".join(p.get("command", "") for p in parts)
    merged["seconds"] = max(p.get("seconds", 0) for p in parts)
    merged["splits"] = {}
    for part in parts:
        for name, split in part["splits"].items():
            into = merged["splits"].setdefault(name, {**split, "rows": [], "skipped": []})
            seen = {(r["cache"], r["budget_of"], r["fraction"], r["protocol"]) for r in into["rows"]}
            into["rows"] += [r for r in split["rows"] if (r["cache"], r["budget_of"], r["fraction"], r["protocol"]) not in seen]
            into["skipped"] += split["skipped"]
    if "tuning" in merged["splits"]:  # pick again from every tuning row, and mark the picks on the test half
        tuning = merged["splits"]["tuning"]["rows"]
        chosen = choose_storage(tuning, tuple(sorted({r["fraction"] for r in tuning if r["budget_of"] == "memory"})))
        merged["chosen"] = {f"{k:g}": v for k, v in chosen.items()}
        for row in merged["splits"].get("test", {}).get("rows", []):
            row["picked_on_tuning"] = row["budget_of"] == "memory" and chosen.get(row["fraction"]) == row["cache"]
    return merged


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m mlxevict.benchmarks.long_report", description=merge.__doc__)
    p.add_argument("out", type=Path, help="folder for long.json, long.md and the plots")
    p.add_argument("parts", nargs="+", type=Path, help="long.json files of the runs to merge")
    args = p.parse_args(argv)
    for path in write_long(merge([json.loads(x.read_text()) for x in args.parts]), args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
