"""Tiny random-weight mlx-lm model *folders* (and a hub cache, a GGUF) on disk, for load paths and the CLI.

The model is a real mlx-lm ``llama`` (or ``qwen2``) with a small ``ModelArgs``
and random weights; the tokenizer is a byte-level BPE trained in a few
milliseconds with the ``tokenizers`` library, with ChatML special tokens and
``<think>``/``</think>``. The end-of-sequence token is made unreachable (its
output row points against a constant residual direction), and so are byte tokens
that are not printable ASCII, so runs last exactly ``max_tokens`` and each token
is text; tests that need a stop force it with a logits processor.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
EOS = "<|im_end|>"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# DeepSeek-R1 style: the generation prompt opens the think block.
THINK = CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")
TEMPLATES = {"chatml": CHATML, "think": THINK, None: None}
CORPUS = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "What is the capital of France? Paris is the capital of France.",
    "Let me think step by step about the answer, then write it down.",
    "user assistant system think reasoning answer memory cache budget",
]
CONST_DIM = 0  # residual dimension held at a large constant, so the EOS logit stays very negative


def build_tokenizer(vocab_size: int = 400) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def build_tiny_model(
    path: Path,
    *,
    template: str | None = "chatml",
    model_type: str = "llama",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    max_position_embeddings: int = 2048,
    dtype: mx.Dtype = mx.float32,
    seed: int = 0,
) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json to ``path``."""
    from mlx_lm.utils import _get_classes

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    config = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": tok.token_to_id(EOS),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": None}
    if TEMPLATES[template]:
        tokenizer_config["chat_template"] = TEMPLATES[template]
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    embed = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = _with_const(embed, 30.0)
    head = mx.random.normal(weights["lm_head.weight"].shape)
    head[:, CONST_DIM] = 0.0
    never = mx.zeros((hidden,))
    never[CONST_DIM] = -20.0
    # Special tokens (EOS, think tags) and bytes that are not printable ASCII alone are never sampled:
    # runs last exactly max_tokens and every token decodes to text by itself.
    for token in range(tok.get_vocab_size()):
        text = tok.decode([token])
        if text in SPECIAL or not text or not all(" " <= ch <= "~" for ch in text):
            head[token] = never
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(path / "model.safetensors"), {k: v.astype(dtype) for k, v in weights.items()})
    return path


def _with_const(embed: mx.array, value: float) -> mx.array:
    embed = mx.array(embed)
    embed[:, CONST_DIM] = value
    return embed


def write_hub_repo(hub: Path, repo: str, folder: Path, revision: str | None = None) -> Path:
    """Lay ``folder``'s files out in ``hub`` as huggingface_hub's cache does; return the snapshot folder.

    ``models--org--name/blobs/<hash>`` hold the bytes, ``snapshots/<rev>/<file>``
    link to them, and ``refs/main`` names the revision.
    """
    revision = revision or hashlib.sha1(repo.encode()).hexdigest()
    root = Path(hub) / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / revision
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    for file in sorted(Path(folder).iterdir()):
        data = file.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.name
        if link.exists() or link.is_symlink():
            link.unlink()
        os.symlink(os.path.relpath(blob, snapshot), link)
    return snapshot


def write_tiny_gguf(path: Path, *, layers: int = 1, hidden: int = 32, heads: int = 2, kv_heads: int = 1) -> Path:
    """A tiny llama GGUF (float32, random weights, byte-level vocab) as llama.cpp lays it out."""
    import numpy as np
    from gguf_writer import byte_level_vocab, f32, small_model_metadata, write_gguf

    rng = np.random.default_rng(0)
    vocab = byte_level_vocab()
    head_dim = hidden // heads
    ffn = 2 * hidden

    def w(*shape):
        return f32(rng.normal(0, 0.2, shape))

    tensors = {"token_embd.weight": w(len(vocab), hidden), "output_norm.weight": f32(np.ones(hidden))}
    for i in range(layers):
        tensors |= {
            f"blk.{i}.attn_norm.weight": f32(np.ones(hidden)),
            f"blk.{i}.attn_q.weight": w(heads * head_dim, hidden),
            f"blk.{i}.attn_k.weight": w(kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": w(kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": w(hidden, heads * head_dim),
            f"blk.{i}.ffn_norm.weight": f32(np.ones(hidden)),
            f"blk.{i}.ffn_gate.weight": w(ffn, hidden),
            f"blk.{i}.ffn_up.weight": w(ffn, hidden),
            f"blk.{i}.ffn_down.weight": w(hidden, ffn),
        }
    metadata = small_model_metadata(
        "llama", layers=layers, hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv_heads, rope_base=10000.0, chat_template=CHATML
    )
    return write_gguf(Path(path), metadata, tensors)
