"""``mlxevict info [MODEL]``: a memory plan, without loading the weights."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from typing import Any, Optional

import psutil

from ..budget import AUTO_FRACTION, parse_budget, parse_size, request_nbytes, storage_nbytes
from ..cache import DEFAULT_BUDGET
from ..distributed import plan_hosts
from ..errors import MlxEvictError
from ..family import DEEPSEEK_R1_DISTILL, FAMILY_NAME, family_plan, is_family_name
from ..geometry import kv_shape, weights_nbytes
from ..kvstorage import DEFAULT_GROUP_SIZE, GROUP_SIZES, KV_BITS, SPLIT_BITS, KVStorage
from ..memory import DEFAULT_MARGIN, format_bytes
from ..openblas import openblas_library, openblas_loaded
from ..paged_storage import DEFAULT_PAGES
from ..plan import page_folder, paged_tokens, plan_cache, sketch_bytes_per_token, tiers_storage
from ..resolve import check_architecture, hub_weights_nbytes, resolve_model
from .flags import add_model_argument, add_page_options, page_dir_flag

PLAN_TOKENS = (8 * 1024, 32 * 1024, 128 * 1024)

_EPILOG = """\
The plan: weights size, KV bytes per token (layers x kv-heads x head-dim x 2 x
dtype size), a full cache's KV at 8k/32k/128k tokens, the budget that fits this
machine's free memory (auto), and what an evicting cache of --budget tokens saves
against a full cache at 32k tokens (or the model's context, if shorter), and per
storage mode (--kv-bits) the bytes per token and the tokens the auto KV memory
holds. A hub repo's weights are not downloaded for this (only its config).

examples:
  mlxevict info                                        # the demo model
  mlxevict info mlx-community/DeepSeek-R1-Distill      # which distill fits, and its plan
  mlxevict info ./smollm2 --budget 1.5GB --json
  mlxevict info mlx-community/DeepSeek-R1-Distill-Llama-70B-4bit --hosts 2 --memory 64GB   # over 2 Macs
"""


def add_info_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``info`` on the top-level ``mlxevict`` parser."""
    parser = subparsers.add_parser(
        "info",
        help="show a model's memory plan: weights, KV per token, the budget that fits",
        description="Show a model's memory plan: weights, KV bytes per token, full-cache sizes, the budget that fits.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_argument(parser)
    parser.add_argument(
        "--budget",
        default=str(DEFAULT_BUDGET),
        help="the budget whose savings to show: tokens, 1.5GB or auto (default %(default)s)",
    )
    add_page_options(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--hosts", type=int, help="plan the model split over N machines (mlx.launch -n N)")
    parser.add_argument("--memory", help="with --hosts: each machine's memory (16GB); default: this machine's")
    parser.set_defaults(func=run_info)


def _weights_size(resolved, config_weights: int) -> tuple[Optional[int], str]:
    if config_weights:
        return config_weights, "on disk"
    if resolved.weights_nbytes:
        return resolved.weights_nbytes, "after conversion"
    size = hub_weights_nbytes(resolved.name)
    if size:
        return size, "to download"
    known = {m.repo: m for m in DEEPSEEK_R1_DISTILL}.get(resolved.name)
    if known:
        return known.weights_nbytes, "to download, approximate"
    return None, "unknown (not downloaded)"


def storage_modes(shape, kv_memory: int) -> list[dict[str, Any]]:
    """Bytes per token and the tokens ``kv_memory`` holds: the model's dtype, 8 and 4 bits, 5/3 bits, and the
    memory rule's precision tiers (an entry counted in its low tier, as their budget counts it)."""
    group = next((g for g in (DEFAULT_GROUP_SIZE, *GROUP_SIZES) if shape.head_dim % g == 0), None)
    modes = []
    storages = [KVStorage.of(bits, group if bits else None) for bits in (None, *KV_BITS, SPLIT_BITS)]
    if group is not None:
        storages.append(tiers_storage(1.0, group))  # the rule's tiers where it evicts least
    for storage in storages:
        bits = storage.kv_bits
        if bits is not None and group is None:
            continue  # no group size divides the head dim: the render says so
        per_token = shape.storage_bytes(storage)
        modes.append(
            {
                "kv_bits": storage.kv_bits,
                "kv_group_size": group if bits else None,
                "flags": storage.flags,
                "bytes_per_token": per_token,
                "fits_tokens": kv_memory // per_token,
            }
        )
    return modes


def plan(args: argparse.Namespace) -> dict[str, Any]:
    memory = psutil.virtual_memory()
    family = args.model is not None and is_family_name(args.model)
    try:
        # The family choice's reason is part of the plan, so resolution reports nothing itself.
        resolved = resolve_model(args.model, weights=False, progress=sys.stderr.isatty(), budget=args.budget)
    except MlxEvictError as err:
        if not family:
            raise
        # Offline with nothing downloaded: the family's numbers are known without the hub.
        return {
            "model": FAMILY_NAME,
            "downloaded": False,
            "not_downloaded": str(err),
            "system_total": memory.total,
            "system_available": memory.available,
            "family": family_plan(memory.total, memory.available, args.budget),
        }
    config = check_architecture(resolved.path)
    shape = kv_shape(resolved.path)
    per_token = shape.bytes_per_token
    weights, weights_note = _weights_size(resolved, weights_nbytes(resolved.path))
    context = config.get("max_position_embeddings")
    # The weights still to be loaded come out of what is available now.
    free = max(0, memory.available - (weights or 0) - DEFAULT_MARGIN)
    # The planner decides as generate and chat do (the storage of a budget in memory, the context cap).
    auto = plan_cache(resolved.path, "auto", available=free)
    budget = plan_cache(resolved.path, args.budget, available=free)
    compare_at = min(context or PLAN_TOKENS[1], PLAN_TOKENS[1])
    full = per_token * compare_at
    held = plan_cache(resolved.path, min(budget.tokens, compare_at), budget.storage).nbytes(resolved.path)
    # The memory rule's page store (as chat plans it, at the context): entries in the dtype, the sketch, the pages.
    given, pages = page_dir_flag(args), args.pages or DEFAULT_PAGES
    folder = page_folder(given, resolved.path, budget.request, pages=pages, available=free)
    paged = budget.request.tokens is None and folder is not None
    if paged:
        tokens = paged_tokens(budget.request, resolved.path, pages=pages, available=free)
        budget = replace(budget, tokens=tokens, storage=KVStorage(), notes=())
        held = min(request_nbytes(budget.request, free), full)
    elif budget.storage.low_bits and budget.tokens > compare_at:
        # Precision tiers spend the bytes beyond the low tier's entries on keeping entries high, up to all of them.
        high = replace(budget.storage, low_bits=None)
        held = min(budget.nbytes(resolved.path), storage_nbytes(resolved.path, compare_at, high))
    result = {
        "model": resolved.name,
        "downloaded": weights_note == "on disk",
        "path": str(resolved.path),
        "source": resolved.source,
        "reason": resolved.reason,
        "architecture": config.get("model_type"),
        "layers": shape.layers,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "dtype_size": shape.dtype_size,
        "kv_bytes_per_token": per_token,
        "weights_nbytes": weights,
        "weights_note": weights_note,
        "context_limit": context,
        "full_kv_nbytes": {str(n): per_token * n for n in PLAN_TOKENS},
        "system_total": memory.total,
        "system_available": memory.available,
        "auto_budget": auto.tokens,
        "auto_kv_bits": auto.storage.kv_bits,
        "auto_budget_nbytes": auto.nbytes(resolved.path),
        "budget": budget.tokens,
        "budget_kv_bits": budget.storage.kv_bits,
        "budget_kv_nbytes": request_nbytes(budget.request, free) if paged else budget.nbytes(resolved.path),
        "budget_storage": f"{budget.storage.label}, evicted entries to disk" if paged else budget.storage.label,
        "budget_paged": paged,
        "budget_page_rule": paged and given is None,
        "budget_text": budget.request.text,
        "compare_at_tokens": compare_at,
        # A budget in memory picks its storage by its share of the tokens expected: here the context, as chat does.
        "planned_for_tokens": context if budget.request.tokens is None else None,
        "saved_nbytes": full - held,
        "saved_fraction": (full - held) / full if full else 0.0,
        "auto_kv_nbytes": int(free * AUTO_FRACTION),
        "storage_modes": storage_modes(shape, int(free * AUTO_FRACTION)),
        "calibrated_layers": _calibrated(resolved.path, weights_note),
        "page_store": page_store(resolved.path, shape, budget.request),
        "openblas": openblas_loaded() if openblas_library() else None,
        "hosts": _hosts(args, config, weights, per_token, memory.total),
    }
    if family:
        result["family"] = family_plan(memory.total, memory.available, args.budget)
    return result


def page_store(path: Any, shape, request) -> dict[str, Any]:
    """What ``--page-dir`` keeps in memory per evicted token (the 2-bit sketch of its keys), and the entries a
    budget in memory holds with it at the model's context (as chat plans it), or why it holds none."""
    try:
        sketch = sketch_bytes_per_token(shape)
    except MlxEvictError as err:  # a head dim the sketch cannot group
        return {"unsupported": str(err)}
    held, error = None, None
    if request.tokens is None:
        try:
            held = paged_tokens(request, path)
        except MlxEvictError as err:
            error = str(err)
    return {"sketch_bytes_per_token": sketch, "entry_bytes_16bit": shape.bytes_per_token * 2 // shape.dtype_size,
            "budget_held": held, "budget_error": error}


def _page_lines(p: dict[str, Any], budget: str) -> list[str]:
    pages = p["page_store"]
    if "unsupported" in pages:
        return [f"page store    not with this model: {pages['unsupported']}"]
    share = pages["sketch_bytes_per_token"] / pages["entry_bytes_16bit"]
    line = (f"page store    --page-dir keeps evicted entries on disk and {pages['sketch_bytes_per_token']:,} B per "
            f"evicted token in memory ({share:.1%} of a 16-bit entry)")
    if p.get("budget_page_rule"):
        line += (f"; --budget {budget} uses it without --page-dir (the memory rule: it would evict, and it is at "
                 f"least 12% of a 16-bit full cache of the context), in the system's temp folder, and holds "
                 f"{p['budget']:,} entries at the context; --page-dir none: precision tiers instead")
    elif p.get("budget_paged"):
        line += f"; --budget {budget} with --page-dir holds {p['budget']:,} entries at the context"
    elif pages["budget_held"] is not None:
        line += f"; --budget {budget} then holds {pages['budget_held']:,} entries at the context"
    elif pages["budget_error"]:
        line += f"; {pages['budget_error']}"
    return [line]


def _calibrated(path: Any, weights_note: str) -> Optional[list[int]]:
    """The layers ``mlxevict calibrate`` keeps in 8 bits for this model; ``None``: not calibrated (or no weights)."""
    from ..calibrate import saved_calibration

    found = saved_calibration(path) if weights_note == "on disk" else None
    return None if found is None else list(found.layers)


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def render(p: dict[str, Any]) -> str:
    weights = format_bytes(p["weights_nbytes"]) if p["weights_nbytes"] else "?"
    context = p["context_limit"]
    auto_bits = f", {_label(p['auto_kv_bits'])}" if p["auto_kv_bits"] else ""
    budget_bits = f" ({p['budget_storage']})" if p["budget_kv_bits"] or p.get("budget_paged") else ""
    compare = p["compare_at_tokens"]
    beyond = ""  # only precision tiers count a budget beyond the context: entries at their low tier's bytes
    if context and p["budget"] > context:
        beyond = f" (tokens at the low tier's bytes: the context's {context:,} fit, and the rest keeps entries high)"
    full = "   ".join(
        f"{_k(int(n))}: {format_bytes(b)}" + (" (beyond the context limit)" if context and int(n) > context else "")
        for n, b in p["full_kv_nbytes"].items()
    )
    lines = [
        f"model         {p['model']}  ({p['architecture']}, {p['source']}: {p['path']})",
        f"weights       {weights} ({p['weights_note']})",
        f"KV per token  {p['kv_bytes_per_token']:,} bytes = {p['layers']} layers x {p['kv_heads']} kv-heads x "
        f"{p['head_dim']} head-dim x 2 x {p['dtype_size']} bytes",
        f"full KV       {full}",
        f"context       {context or '?'} tokens",
        f"memory        {format_bytes(p['system_total'])} total, {format_bytes(p['system_available'])} available now",
        f"budget        auto = {p['auto_budget']:,} tokens ({format_bytes(p['auto_budget_nbytes'])} KV{auto_bits}) "
        "fits this machine next to the weights",
        f"eviction      --budget {p['budget']:,} tokens holds {format_bytes(p['budget_kv_nbytes'])} of KV"
        f"{budget_bits}{beyond}; "
        f"a full cache at {_k(compare)} tokens holds {format_bytes(p['kv_bytes_per_token'] * compare)}: "
        f"saves {format_bytes(p['saved_nbytes'])} ({100 * p['saved_fraction']:.0f}%)",
    ]
    if p.get("planned_for_tokens"):
        lines.append(f"              planned for {p['planned_for_tokens']:,} tokens (the context), as chat and serve plan "
                     "it; generate plans for its prompt and --max-tokens, so its storage may differ")
    auto_memory = format_bytes(p["auto_kv_nbytes"])
    lines.append(f"storage       bytes per token, and tokens the auto KV memory ({auto_memory}) holds:")
    names = [m["flags"] if m["kv_bits"] else f"{8 * p['dtype_size']}-bit float" for m in p["storage_modes"]]
    width = max(map(len, names))
    for name, m in zip(names, p["storage_modes"]):
        lines.append(f"              {name:<{width}} {m['bytes_per_token']:>10,} B  {m['fits_tokens']:>12,} tokens")
    if len(p["storage_modes"]) == 1:
        lines.append(f"              --kv-bits needs a head dim divisible by {', '.join(map(str, GROUP_SIZES))}")
    else:
        lines.append(
            "              (quantized caches keep the newest --fp-window tokens in full precision too, "
            "or in 8 bits with --window-bits 8)"
        )
    if "page_store" in p:
        lines += _page_lines(p, p.get("budget_text", ""))
    layers = p["calibrated_layers"]
    if layers is None:
        lines.append("calibration   none: `mlxevict calibrate MODEL` finds the layers a memory budget keeps in 8 bits")
    else:
        kept = f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))}" if layers else "no layer"
        lines.append(f"calibration   {kept} in 8 bits when a --budget in memory evicts and is at least 18% of a "
                     "16-bit full cache of the tokens expected (mlxevict calibrate)")
    if p["reason"]:
        lines.insert(1, f"chosen        {p['reason']}")
    if p["hosts"]:
        lines += _host_lines(p["hosts"])
    if p["openblas"] is not None:
        blas = "OpenBLAS preloaded" if p["openblas"] else "reference BLAS (slow): set LD_PRELOAD to OpenBLAS"
        lines.append(f"cpu blas      {blas}")
    if "family" in p:
        lines += render_family(p["family"])
    return "\n".join(lines)


def render_not_downloaded(p: dict[str, Any]) -> str:
    """The family's plan when no member is on this machine and the hub cannot be reached."""
    lines = [
        f"model         {p['model']}: not downloaded",
        f"why           {p['not_downloaded']}",
        f"memory        {format_bytes(p['system_total'])} total, {format_bytes(p['system_available'])} available now",
    ]
    return "\n".join(lines + render_family(p["family"]))


def render_family(f: dict[str, Any]) -> list[str]:
    labels = list(f["members"][0]["kv_bytes_per_token"])
    head = "".join(f"{label:>12}" for label in labels)
    lines = [
        f"family        the {f['family']} distills (4-bit weights; KV bytes per token by storage):",
        f"              {'':<6}{'weights':>10}{head}{'needs':>12}",
    ]
    for m in f["members"]:
        kv = "".join(f"{m['kv_bytes_per_token'][label]:>12,}" for label in labels)
        lines.append(
            f"              {m['params']:<6}{format_bytes(m['weights_nbytes']):>10}{kv}{format_bytes(m['need_nbytes']):>12}"
        )
    picks = "   ".join(f"{memory}: {pick or 'none'}" for memory, pick in f["fits"].items())
    lines += [
        f"fits          {picks}   this machine (free memory now): {f['fits_this_machine'] or 'none'}",
        f"              needs: weights + KV at --budget {f['budget']} + overhead; a pick leaves "
        f"{format_bytes(f['headroom_nbytes'])} free, and a machine of a given size has "
        f"{format_bytes(f['in_use_nbytes'])} in use by the system and a browser",
    ]
    return lines


def run_info(args: argparse.Namespace) -> int:
    parse_budget(args.budget)  # a bad budget fails before any download
    p = plan(args)
    print(json.dumps(p) if args.json else render(p) if "path" in p else render_not_downloaded(p))
    return 0


def _label(bits: int | list[int]) -> str:
    return KVStorage.of(bits if isinstance(bits, int) else tuple(bits)).label


def _hosts(args: argparse.Namespace, config: dict, weights: Optional[int], per_token: int, total: int):
    """``--hosts N``: the model over N machines of ``--memory`` each (docs/distributed.md), or ``None``."""
    if args.hosts is None:
        if args.memory is not None:
            raise MlxEvictError("--memory needs --hosts N (the machines the model is split over)")
        return None
    if not weights:
        raise MlxEvictError("--hosts needs the weights' size, which is unknown for this model; download it first")
    memory = parse_size(args.memory) if args.memory else total
    if args.pipeline:
        from ..launch import has_pipeline

        if not has_pipeline(str(config.get("model_type"))):
            raise MlxEvictError(f"mlx-lm has no pipeline parallelism for {config.get('model_type')} models; "
                                "drop --pipeline to plan a split of every layer's heads")
    try:
        plan = plan_hosts(config, weights, per_token, args.hosts, memory, DEFAULT_MARGIN, pipeline=args.pipeline)
        return {**asdict(plan), "pipeline": args.pipeline}
    except ValueError as err:
        raise MlxEvictError(str(err)) from None


def _host_lines(h: dict[str, Any]) -> list[str]:
    where = f"{h['hosts']} hosts of {format_bytes(h['memory'])}"
    if not h["shardable"]:
        return [f"hosts         {where}: {h['reason']}"]
    n = h["min_hosts"]
    split = "layers" if h["pipeline"] else "heads"
    fewest = f"; the weights fit on {n} host{'s' if n > 1 else ''} or more" if n else f"; no split of the {split} fits"
    return [
        f"hosts         {where}{', a pipeline of whole layers' if h['pipeline'] else ''}: "
        f"{format_bytes(h['weights_per_host'])} of weights each (the embedding and head on every host){fewest}",
        f"              KV {h['kv_bytes_per_token']:,} bytes per token per host; {format_bytes(h['kv_memory'])} "
        f"left for KV on each holds {h['full_tokens']:,} tokens of a full cache",
    ]
