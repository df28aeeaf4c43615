"""``tokenizer.json`` + ``tokenizer_config.json`` rebuilt from a GGUF's ``tokenizer.*`` metadata.

Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is handled: it is what
llama-3-family and qwen2 GGUFs use. The pre-tokenizer (how text is split before
BPE) is not stored in the GGUF, only named by ``tokenizer.ggml.pre``; the regexes
below are the ones llama.cpp and the original Hugging Face tokenizers use for
those names, so the MLX model tokenizes the same text into the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from mlxevict.errors import MlxEvictError

from .gguf import GGUFFile

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's fallback when a GGUF names no pre-tokenizer: these regexes, each splitting
# the pieces of the one before.
_DEFAULT_REGEXES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]")
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
# tokenizer.ggml.pre -> (pre-tokenizer family, ignore_merges). llama-3 matches whole
# words found in the vocab before merging, as its Hugging Face tokenizer does.
PRE_TOKENIZERS: dict[str, tuple[str, bool]] = {
    "default": ("default", False),
    "gpt2": ("gpt2", False),
    "smollm": ("smollm", False),
    "llama-bpe": ("llama3", True),
    "llama3": ("llama3", True),
    "llama-v3": ("llama3", True),
    "qwen2": ("qwen2", False),
    "deepseek-r1-qwen": ("qwen2", False),
}


def build_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """The Hugging Face ``tokenizers`` object equivalent to the GGUF's tokenizer.

    Args:
        gguf: a parsed GGUF with ``tokenizer.ggml.*`` metadata.

    Returns:
        A byte-level BPE tokenizer with the GGUF's vocab, merges and special tokens.

    Raises:
        MlxEvictError: no tokenizer, a non-BPE tokenizer or an unknown pre-tokenizer.
    """
    kind = gguf.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise MlxEvictError(f"{gguf.path}: tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') is")
    # llama.cpp treats a missing name as "default"; so do we.
    pre = str(gguf.metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise MlxEvictError(
            f"{gguf.path}: pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}"
        )
    family, ignore_merges = PRE_TOKENIZERS[pre]
    tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise MlxEvictError(f"{gguf.path}: tokenizer.ggml.tokens holds duplicate tokens")
    merges = [tuple(m.split(" ", 1)) for m in gguf.require("tokenizer.ggml.merges")]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = _pre_tokenizer(family)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(gguf, tokens)
    token_types = gguf.metadata.get("tokenizer.ggml.token_type")
    if token_types is not None:
        tok.add_tokens(
            [
                AddedToken(tokens[i], special=int(t) == TOKEN_CONTROL, normalized=False)
                for i, t in enumerate(token_types)
                if int(t) in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
            ]
        )
    return tok


def _pre_tokenizer(family: str) -> pre_tokenizers.PreTokenizer:
    """How text is split into words before BPE, per pre-tokenizer family."""
    if family in ("gpt2", "smollm"):
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if family == "gpt2":
            return byte_level
        # SmolLM splits every digit on its own before the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    regexes = {"default": _DEFAULT_REGEXES, "llama3": (_LLAMA3_REGEX,), "qwen2": (_QWEN2_REGEX,)}[family]
    return pre_tokenizers.Sequence(
        [
            *(pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _post_processor(gguf: GGUFFile, tokens: list[str]) -> processors.PostProcessor:
    """Byte-level offsets, plus BOS/EOS around each sequence when the GGUF asks for them."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    add_bos, add_eos = _add_bos_eos(gguf)
    if not (add_bos or add_eos):
        return byte_level
    bos_id = int(gguf.metadata.get("tokenizer.ggml.bos_token_id", 0))
    eos_id = int(gguf.metadata.get("tokenizer.ggml.eos_token_id", 0))
    before = [tokens[bos_id]] if add_bos else []
    after = [tokens[eos_id]] if add_eos else []
    single = [*before, "$A:0", *after]
    specials = [(tokens[i], i) for i, wanted in ((bos_id, add_bos), (eos_id, add_eos)) if wanted]
    template = processors.TemplateProcessing(
        single=single, pair=[*single, *before, "$B:1", *after], special_tokens=specials
    )
    return processors.Sequence([byte_level, template])


def _add_bos_eos(gguf: GGUFFile) -> tuple[bool, bool]:
    """Whether encoding prepends BOS / appends EOS; a missing flag or token id means no."""
    meta = gguf.metadata
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and "tokenizer.ggml.bos_token_id" in meta
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and "tokenizer.ggml.eos_token_id" in meta
    return add_bos, add_eos


def tokenizer_config(gguf: GGUFFile) -> dict[str, Any]:
    """``tokenizer_config.json``: special token strings, BOS/EOS flags and the chat template."""
    meta = gguf.metadata
    tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
    add_bos, add_eos = _add_bos_eos(gguf)
    arch = gguf.architecture
    config: dict[str, Any] = {
        # The generic fast tokenizer loads tokenizer.json as written; a model-specific
        # class (e.g. Qwen2Tokenizer) may rebuild its own pre-tokenizer instead.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    if f"{arch}.context_length" in meta:
        config["model_max_length"] = int(meta[f"{arch}.context_length"])
    for name, key in _SPECIAL_TOKEN_KEYS.items():
        if key in meta and int(meta[key]) < len(tokens):
            config[name] = tokens[int(meta[key])]
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def write_tokenizer(gguf: GGUFFile, out_dir: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``."""
    # Written by Python, not the tokenizers library, so a full disk is an OSError like any other.
    (out_dir / "tokenizer.json").write_text(build_tokenizer(gguf).to_str(), encoding="utf-8")
    config = json.dumps(tokenizer_config(gguf), indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
