"""A minimal GGUF writer for tests: craft small, exact files; and K-quant files through the gguf package's writer.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np

ALIGNMENT = 32
TYPE_IDS = {t.name: t.value for t in gguf.GGMLQuantizationType}
_BYTES_PER_BLOCK = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value(v: Any) -> tuple[int, bytes]:
    """(GGUF value type, encoded value)."""
    if isinstance(v, bool):
        return 7, struct.pack("<?", v)
    if isinstance(v, int):
        return 4, struct.pack("<I", v)
    if isinstance(v, float):
        return 6, struct.pack("<f", v)
    if isinstance(v, str):
        return 8, _string(v)
    if isinstance(v, list):
        if all(isinstance(x, str) for x in v):
            return 9, struct.pack("<IQ", 8, len(v)) + b"".join(_string(x) for x in v)
        arr = np.asarray(v, dtype=np.int32)
        return 9, struct.pack("<IQ", 5, len(arr)) + arr.tobytes()
    raise TypeError(f"cannot encode {v!r}")


def write_gguf(path: Path, metadata: dict[str, Any], tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> Path:
    """Write a GGUF v3 file.

    Args:
        path: where to write.
        metadata: key -> str, bool, int (uint32), float (float32) or list of str/int.
        tensors: name -> (type name, numpy-order shape, raw bytes).
    """
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for key, v in metadata.items():
        vtype, raw = _value(v)
        header += _string(key) + struct.pack("<I", vtype) + raw
    data = b""
    for name, (type_name, shape, raw) in tensors.items():
        data += b"\0" * (-len(data) % ALIGNMENT)
        header += _string(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *reversed(shape))
        header += struct.pack("<IQ", TYPE_IDS[type_name], len(data))
        data += raw
    header += b"\0" * (-len(header) % ALIGNMENT)
    path.write_bytes(header + data)
    return path


def f32(array: np.ndarray) -> tuple[str, tuple[int, ...], bytes]:
    """A float32 tensor entry for ``write_gguf``."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    return "F32", array.shape, array.tobytes()


def random_blocks(type_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> tuple[str, tuple, bytes]:
    """A tensor entry of random but valid Q4_0/Q4_1/Q8_0 blocks (scales in [0.01, 0.1])."""
    n_blocks = int(np.prod(shape)) // 32
    blocks = rng.integers(0, 256, size=(n_blocks, _BYTES_PER_BLOCK[type_name]), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(0.01, 0.1, size=(n_blocks, 1)).astype(np.float16).view(np.uint8)
    if type_name == "Q4_1":
        blocks[:, 2:4] = rng.uniform(-0.5, 0.5, size=(n_blocks, 1)).astype(np.float16).view(np.uint8)
    return type_name, shape, blocks.tobytes()


def dequantize_reference(type_name: str, shape: tuple[int, ...], raw: bytes) -> np.ndarray:
    """Decode blocks exactly as the GGUF spec states (float32), independent of the converter."""
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(-1, _BYTES_PER_BLOCK[type_name])
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    if type_name == "Q8_0":
        values = d * blocks[:, 2:].view(np.int8).astype(np.float32)
    else:
        qs = blocks[:, 4:] if type_name == "Q4_1" else blocks[:, 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        if type_name == "Q4_1":
            values = d * q + blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        else:
            values = d * (q - 8)
    return values.reshape(shape)


def byte_level_vocab() -> list[str]:
    """GPT-2's 256 byte symbols followed by ChatML's two control tokens."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)] + ["<|im_start|>", "<|im_end|>"]


def small_model_metadata(
    arch: str, *, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, rope_base: float, chat_template: str
) -> dict[str, Any]:
    """GGUF metadata of a small llama/qwen2 model with :func:`byte_level_vocab` (BOS 256, EOS 257)."""
    return {
        "general.architecture": arch,
        f"{arch}.block_count": layers,
        f"{arch}.context_length": 512,
        f"{arch}.embedding_length": hidden,
        f"{arch}.feed_forward_length": ffn,
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.rope.freq_base": rope_base,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe" if arch == "llama" else "qwen2",
        "tokenizer.ggml.tokens": byte_level_vocab(),
        "tokenizer.ggml.token_type": [1] * 256 + [3, 3],
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 256,
        "tokenizer.ggml.eos_token_id": 257,
        "tokenizer.chat_template": chat_template,
    }


# K-quant super-block layouts (ggml-common.h): byte offsets of the float16 scale fields.
_KQUANT_F16 = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# Super-scale ``d`` per type (dmin = d * the mean q), so weights come out with std of about 0.05-0.1.
_KQUANT_D = {"Q4_K": 4e-4, "Q5_K": 2e-4, "Q6_K": 4e-5}
_KQUANT_MEAN_Q = {"Q4_K": 7.5, "Q5_K": 15.5}


def random_kquant(type_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> tuple[str, tuple, bytes]:
    """A tensor entry of random Q4_K/Q5_K/Q6_K super-blocks with weight-sized scales (rows a multiple of 256)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, size=(int(np.prod(shape)) // block, nbytes), dtype=np.uint8)
    d = rng.uniform(0.5, 1.5, size=(blocks.shape[0], 1)) * _KQUANT_D[type_name]
    fields = [d] + ([d * _KQUANT_MEAN_Q[type_name]] if type_name in _KQUANT_MEAN_Q else [])
    for at, value in zip(_KQUANT_F16[type_name], fields):
        blocks[:, at : at + 2] = value.astype(np.float16).view(np.uint8)
    return type_name, shape, blocks.tobytes()


def random_quant_bytes(type_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> tuple[str, tuple, bytes]:
    """Random blocks of any ggml type, every byte below 0x3C so no float16 field is inf or NaN (|x| < 1)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 0x3C, size=(int(np.prod(shape)) // block, nbytes), dtype=np.uint8)
    if type_name == "MXFP4":  # its scale is a power of two, 2 ** (byte - 127): keep weights near 1
        blocks[:, 0] = rng.integers(120, 128, size=blocks.shape[0])
    return type_name, shape, blocks.tobytes()


def dequantize_gguf(entry: tuple[str, tuple, bytes]) -> np.ndarray:
    """The float32 values of a tensor entry, decoded by the gguf package (llama.cpp's reference decoders)."""
    type_name, shape, raw = entry
    data = np.frombuffer(raw, dtype=np.uint8).reshape(int(np.prod(shape[:-1])), -1)
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name]).reshape(shape).astype(np.float32)


def write_gguf_package(path: Path, metadata: dict[str, Any], tensors: dict[str, tuple[str, tuple, bytes]]) -> Path:
    """Write a GGUF file with the gguf package's ``GGUFWriter`` (the writer llama.cpp's converter uses)."""
    writer = gguf.GGUFWriter(str(path), metadata["general.architecture"])
    for key, v in metadata.items():
        if key == "general.architecture":
            continue
        if isinstance(v, bool):
            writer.add_bool(key, v)
        elif isinstance(v, int):
            writer.add_uint32(key, v)
        elif isinstance(v, float):
            writer.add_float32(key, v)
        elif isinstance(v, str):
            writer.add_string(key, v)
        else:
            writer.add_array(key, v)  # the gguf package drops an empty list
    for name, (type_name, shape, raw) in tensors.items():
        qtype = gguf.GGMLQuantizationType[type_name]
        if type_name == "F32":
            writer.add_tensor(name, np.frombuffer(raw, dtype=np.float32).reshape(shape))
        else:
            data = np.frombuffer(raw, dtype=np.uint8).reshape(int(np.prod(shape[:-1])), -1)
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
