"""Sampling settings: the flags, else the model's ``generation_config.json``, else mlx_lm.generate's defaults.

DeepSeek-R1's distills ship ``{"do_sample": true, "temperature": 0.6, "top_p": 0.95}``;
a model without the file (the demo model) samples as ``mlx_lm.generate`` does:
greedy. As in transformers, the file's values count only with ``"do_sample": true``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..errors import MlxEvictError

GENERATION_CONFIG = "generation_config.json"
# generation_config.json's key -> the flag's dest (and make_sampler's argument)
CONFIG_KEYS = {"temperature": "temp", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p"}
FLAGS = {"temp": "--temp", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p"}


def mlx_lm_defaults() -> dict[str, Any]:
    """``mlx_lm.generate``'s defaults for ``temp``, ``top_p``, ``top_k``, ``min_p``."""
    import importlib

    mlx_generate = importlib.import_module("mlx_lm.generate")  # the module: mlx_lm.generate is also a function

    return {
        "temp": mlx_generate.DEFAULT_TEMP,
        "top_p": mlx_generate.DEFAULT_TOP_P,
        "top_k": mlx_generate.DEFAULT_TOP_K,
        "min_p": mlx_generate.DEFAULT_MIN_P,
    }


def model_defaults(folder: Path) -> dict[str, Any]:
    """The sampling values of ``folder/generation_config.json`` (``{}`` without the file or without do_sample).

    Raises:
        MlxEvictError: the file is not a JSON object.
    """
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MlxEvictError(f"{path} is not valid JSON ({err}); fix or delete it") from None
    if not isinstance(config, dict):
        raise MlxEvictError(f"{path} is not a JSON object; fix or delete it")
    if config.get("do_sample") is not True:
        return {}
    return {dest: config[key] for key, dest in CONFIG_KEYS.items() if config.get(key) is not None}


def check_sampling(args: argparse.Namespace) -> None:
    """Refuse sampling values mlx-lm would misbehave on, before a model is loaded (unset ones are skipped)."""
    if args.max_tokens < 1:
        raise MlxEvictError(f"--max-tokens {args.max_tokens} must be at least 1")
    if args.temp is not None and args.temp < 0:
        raise MlxEvictError(f"--temp {args.temp} must be >= 0 (0 is greedy)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise MlxEvictError(f"--top-p {args.top_p} must be in (0, 1]")
    if args.top_k is not None and args.top_k < 0:
        raise MlxEvictError(f"--top-k {args.top_k} must be >= 0 (0 keeps every token)")
    if args.min_p is not None and not 0 <= args.min_p <= 1:
        raise MlxEvictError(f"--min-p {args.min_p} must be in [0, 1] (0 turns it off)")
    if args.seed is not None and not 0 <= args.seed < 2**64:
        raise MlxEvictError(f"--seed {args.seed} must be an integer from 0 to 2**64 - 1")


def resolve_sampling(args: argparse.Namespace, folder: Path) -> tuple[dict[str, Any], str]:
    """``temp``, ``top_p``, ``top_k``, ``min_p`` for ``make_sampler``, and a line saying which the model chose.

    Each value is the flag's when given, else the model's ``generation_config.json``, else mlx_lm's.
    The line is ``""`` when the model chose none.
    """
    config = model_defaults(folder)
    values = {**mlx_lm_defaults(), **config}
    chosen = []
    for dest in FLAGS:
        flag = getattr(args, dest)
        if flag is not None:
            values[dest] = flag
        elif dest in config:
            chosen.append(f"{FLAGS[dest]} {config[dest]}")
    values["top_k"] = int(values["top_k"])
    note = f"sampling {', '.join(chosen)} from the model's {GENERATION_CONFIG}" if chosen else ""
    return values, note
