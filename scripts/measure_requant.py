"""Measure how much of each GGUF type's precision the converter keeps, and how fast it decodes.

    bash scripts/with-openblas .venv/bin/python scripts/measure_requant.py

For every quantized type the converter reads: random blocks (seed 0, 64 x 1024 values),
decoded by the gguf package (llama.cpp's reference decoders) and by the converter; the
relative RMS error of the converter's MLX tensor against the gguf decoding. Q4_K/Q5_K/
Q6_K also with weight-sized scales (tests/gguf_writer.random_kquant). Then the seconds
to convert one 4096 x 4096 tensor of Q4_K (repacked) and Q6_K (re-quantized).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test helpers write the blocks
from gguf_writer import dequantize_gguf, random_kquant, random_quant_bytes  # noqa: E402

from mlxevict.convert.quants import BITS, KQUANT_BITS, REQUANT_BITS, mlx_bits, to_mlx  # noqa: E402

SHAPE = (64, 1024)


def rel_rms(entry: tuple) -> float:
    ref = dequantize_gguf(entry)
    got = np.array(to_mlx(np.frombuffer(entry[2], dtype=np.uint8), entry[1], entry[0]).dequantize(mx.float32))
    return float(np.sqrt(((got - ref) ** 2).mean() / (ref**2).mean()))


def main() -> None:
    rng = np.random.default_rng(0)
    print("| GGUF type | becomes | rel. RMS error (random blocks) | rel. RMS error (weight-sized K scales) |")
    print("|---|---|---|---|")
    for type_name in (*BITS, *KQUANT_BITS, *REQUANT_BITS):
        if type_name in BITS:
            continue  # exact by construction, tested bit for bit against MLX's own GGUF reader
        how = "repacked" if type_name in KQUANT_BITS else "re-quantized"
        k = f"{rel_rms(random_kquant(type_name, SHAPE, rng)):.1e}" if type_name in ("Q4_K", "Q5_K", "Q6_K") else ""
        error = rel_rms(random_quant_bytes(type_name, SHAPE, rng))
        print(f"| {type_name} | {mlx_bits(type_name)}-bit, {how} | {error:.1e} | {k} |")
    for type_name in ("Q4_K", "Q6_K"):
        entry = random_kquant(type_name, (4096, 4096), rng)
        raw = np.frombuffer(entry[2], dtype=np.uint8)
        start = time.perf_counter()
        tensor = to_mlx(raw, entry[1], type_name)
        mx.eval(tensor.weight, tensor.scales, tensor.biases)
        print(f"{type_name}: one 4096 x 4096 tensor in {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
