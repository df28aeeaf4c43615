"""``mlxevict convert MODEL.gguf OUT_DIR``: the converter's command line."""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path
from typing import TextIO

from .convert import DTYPES, convert_gguf
from .gguf import SUPPORTED_TYPES
from .weights import SUPPORTED_ARCHITECTURES

PROGRESS_MIN_BYTES = 256 * 1024**2  # smaller files convert in a few seconds: no bar
BAR_WIDTH = 30

_TYPES = textwrap.fill(", ".join(SUPPORTED_TYPES), width=88, initial_indent="  ", subsequent_indent="  ")
_EPILOG = f"""\
supported architectures: {", ".join(SUPPORTED_ARCHITECTURES)} (e.g. SmolLM2, Llama 3,
  DeepSeek-R1-Distill-Llama, Qwen2/2.5, DeepSeek-R1-Distill-Qwen)
supported tensor types:
{_TYPES}
  quantized tensors stay quantized (MLX affine, group size 32) unless --dtype is given:
  Q4_0/Q4_1/Q8_0 exactly, Q4_K/Q5_K with the same values (scales in float16), the rest
  re-quantized to 8 bits (Q5_*, Q6_K) or 4 bits (Q2_K, Q3_K, IQ*, TQ*, MXFP4); a note says which
tokenizer:               byte-level BPE (tokenizer.ggml.model = gpt2)

example:
  mlxevict convert SmolLM2-135M-Instruct.Q4_1.gguf smollm2/ --dtype float32
  mlx_lm.generate --model smollm2 --prompt "What is the capital of France?"
"""


def add_convert_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``convert`` on the top-level ``mlxevict`` parser."""
    parser = subparsers.add_parser(
        "convert",
        help="convert a GGUF model into an MLX model folder",
        description="Convert a GGUF model into an MLX model folder that mlx_lm.load() opens.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("gguf", metavar="MODEL.gguf", type=Path, help="the GGUF file")
    parser.add_argument(
        "out_dir", metavar="OUT_DIR", type=Path, help="the folder to write (missing, empty, or an earlier conversion)"
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        help="dequantize every tensor to this type (float32 runs fastest on a CPU); default: keep as stored",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace an earlier conversion in OUT_DIR (never a folder holding other files)",
    )
    parser.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    """Convert, with a progress bar on stderr for large files; print where the model went."""
    large = args.gguf.is_file() and args.gguf.stat().st_size >= PROGRESS_MIN_BYTES
    bar = _ProgressBar(sys.stderr) if large and sys.stderr.isatty() else None
    start = time.perf_counter()
    try:
        out = convert_gguf(
            args.gguf, args.out_dir, dtype=args.dtype, force=args.force, progress=bar, report=_note
        )
    finally:
        if bar is not None:
            bar.finish()
    kind = args.dtype or "as stored"
    print(f"converted {args.gguf} -> {out} ({kind}) in {time.perf_counter() - start:.1f} s")
    return 0


def _note(line: str) -> None:
    print(f"mlxevict: note: {line}", file=sys.stderr, flush=True)


class _ProgressBar:
    """A one-line ``[#####.....]  42%  1.2/2.9 GB`` bar redrawn in place."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        filled = BAR_WIDTH * done // max(total, 1)
        percent = 100 * done // max(total, 1)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        self.stream.write(f"\rconverting [{bar}] {percent:3d}%  {done / 1e9:.1f}/{total / 1e9:.1f} GB")
        self.stream.flush()
        self.drawn = True

    def finish(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
