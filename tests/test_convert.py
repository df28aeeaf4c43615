"""The GGUF → MLX converter: exact tiny models, block decoding, clear errors, and the real SmolLM2."""

from __future__ import annotations

import json
import struct
import subprocess
import sysconfig
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment
from mlx.utils import tree_flatten, tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models import llama, qwen2
from mlx_lm.models.rope_utils import Llama3RoPE
from mlx_lm.utils import load_tokenizer

from gguf_writer import (
    byte_level_vocab,
    dequantize_gguf,
    dequantize_reference,
    f32,
    random_blocks,
    random_kquant,
    random_quant_bytes,
    small_model_metadata,
    write_gguf,
    write_gguf_package,
)
from mlxevict.cli import main
from mlxevict.convert import convert as convert_module
from mlxevict.convert import convert_gguf
from mlxevict.convert.convert import MARKER
from mlxevict.convert.gguf import read_gguf
from mlxevict.convert.quants import REQUANT_BITS, to_mlx
from mlxevict.convert.tokenizer import build_tokenizer
from mlxevict.convert.weights import llama3_rope_factors
from mlxevict.demo_model import demo_model_path
from mlxevict.errors import MlxEvictError

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HIDDEN, LAYERS, FFN, HEADS, KV_HEADS, HEAD_DIM = 64, 2, 96, 4, 2, 16
ROPE_BASE = 10000.0
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# GGUF names, written out as llama.cpp names them (the converter's own table is not reused).
GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
QUESTION = "What is the capital of France?"
# Measured q4 vs float32 max |logit difference| on LOGITS_TEXT: 0.03 (logits span ±40).
LOGITS_MAX_DIFF = 0.15
LOGITS_TEXT = (
    "The history of the Roman Empire spans more than a thousand years. It began when Augustus became the first "
    "emperor in 27 BC, after a long period of civil war. At its height, the empire stretched from Britain in the "
    "north to Egypt in the south, and from Spain in the west to Mesopotamia in the east. Roads, aqueducts and "
    "cities connected its provinces, while Latin and Greek served as common languages. Trade flourished across "
    "the Mediterranean, which the Romans called Mare Nostrum, our sea. The empire faced many challenges, including "
    "invasions, economic troubles and political instability. In 395 AD it was divided into eastern and western "
    "halves. The western empire fell in 476, but the eastern empire, later known as the Byzantine Empire, survived "
    "until 1453, when Constantinople was captured by the Ottoman Turks. Its laws, languages and buildings still "
    "shape Europe today, from the alphabet we write with to the calendar that names our months."
)


# --- tiny models with random weights -------------------------------------------------------------


def _source_model(arch: str, rope_scaling: dict | None = None) -> tuple[object, dict]:
    """An mlx-lm model in Hugging Face layout with random weights (norms included)."""
    module = {"llama": llama, "qwen2": qwen2}[arch]
    args = dict(
        model_type=arch, hidden_size=HIDDEN, num_hidden_layers=LAYERS, intermediate_size=FFN,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5,
        vocab_size=len(byte_level_vocab()), rope_theta=ROPE_BASE, max_position_embeddings=512,
        rope_scaling=rope_scaling, tie_word_embeddings=arch == "llama",
    )  # fmt: skip
    model = module.Model(module.ModelArgs(**args))
    mx.random.seed(0)
    model.update(tree_map(lambda p: 0.2 * mx.random.normal(p.shape), model.parameters()))
    return model, args


def _permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of llama Q/K rows into interleaved RoPE order."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_from_model(path: Path, model, arch: str, rope_scaling: dict | None = None) -> Path:
    """Write ``model`` as llama.cpp would: GGUF names, permuted llama Q/K, tokenizer metadata."""
    tensors = {}
    for name, w in tree_flatten(model.parameters()):
        module, param = name.rsplit(".", 1)
        a = np.array(w)
        if module.startswith("model.layers."):
            _, _, layer, sub = module.split(".", 3)
            gguf_module = f"blk.{layer}.{GGUF_NAMES[sub]}"
            if arch == "llama" and sub in ("self_attn.q_proj", "self_attn.k_proj"):
                a = _permute_for_gguf(a, HEADS if sub == "self_attn.q_proj" else KV_HEADS)
        else:
            gguf_module = GGUF_NAMES[module]
        tensors[f"{gguf_module}.{param}"] = f32(a)
    if rope_scaling is not None:
        # llama.cpp stores llama3 scaling only as per-frequency wavelength factors.
        rope = model.model.layers[0].self_attn.rope
        tensors["rope_freqs.weight"] = f32(np.array(rope._freqs) / ROPE_BASE ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM))
    metadata = small_model_metadata(
        arch, layers=LAYERS, hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS, rope_base=ROPE_BASE, chat_template=CHATML
    )
    return write_gguf(path, metadata, tensors)


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory) -> Path:
    model, _ = _source_model("llama")
    return _gguf_from_model(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", model, "llama")


def _assert_same_logits(source, out_dir: Path) -> None:
    converted, _ = mlx_lm.load(str(out_dir))
    tokens = mx.array(np.random.default_rng(0).integers(0, 258, size=(1, 24)))
    np.testing.assert_allclose(np.array(converted(tokens)), np.array(source(tokens)), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "arch, rope_scaling",
    [("llama", None), ("llama", LLAMA3_SCALING), ("qwen2", None)],
    ids=["llama", "llama3-rope", "qwen2"],
)
def test_tiny_model_converts_to_same_logits(tmp_path, capsys, arch, rope_scaling):
    source, _ = _source_model(arch, rope_scaling)
    gguf = _gguf_from_model(tmp_path / "m.gguf", source, arch, rope_scaling)
    out = tmp_path / "out"
    assert main(["convert", str(gguf), str(out)]) == 0
    assert "converted" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["rope_traditional"] is (arch == "llama")
    assert config["rope_scaling"] == rope_scaling
    assert "quantization" not in config
    _assert_same_logits(source, out)


def test_llama3_rope_factors_match_mlx_lm():
    rope = Llama3RoPE(HEAD_DIM, traditional=True, base=ROPE_BASE, scaling_config=LLAMA3_SCALING)
    expected = np.array(rope._freqs) / ROPE_BASE ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    factors = llama3_rope_factors(ROPE_BASE, HEAD_DIM, LLAMA3_SCALING)
    assert len(set(factors.round(3).tolist())) > 2  # the test spans low, medium and high frequencies
    np.testing.assert_allclose(factors, expected, rtol=1e-5)


def test_sharded_output_loads(tmp_path, tiny_llama_gguf, monkeypatch):
    monkeypatch.setattr(convert_module, "SHARD_BYTES", 64 * 1024)
    out = convert_gguf(tiny_llama_gguf, tmp_path / "out")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    _assert_same_logits(_source_model("llama")[0], out)


def test_dtype_float16_casts_everything(tmp_path, tiny_llama_gguf):
    out = convert_gguf(tiny_llama_gguf, tmp_path / "out", dtype="float16")
    assert {a.dtype for a in mx.load(str(out / "model.safetensors")).values()} == {mx.float16}


@pytest.mark.parametrize(
    "pre, words",
    [
        ("gpt2", ["I", "'m", "Ġ12345", "Ġgo", "!!"]),
        ("smollm", ["I", "'m", "Ġ", "1", "2", "3", "4", "5", "Ġgo", "!!"]),
        ("llama-bpe", ["I", "'m", "Ġ", "123", "45", "Ġgo", "!!"]),
        ("qwen2", ["I", "'m", "Ġ", "1", "2", "3", "4", "5", "Ġgo", "!!"]),
        ("default", ["I", "'", "m", "Ġ", "123", "45", "Ġgo", "!!"]),
    ],
)
def test_pre_tokenizer_splits_as_named(tmp_path, pre, words):
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": byte_level_vocab()}
    metadata["tokenizer.ggml.merges"] = []
    if pre != "default":
        metadata["tokenizer.ggml.pre"] = pre
    tokenizer = build_tokenizer(read_gguf(write_gguf(tmp_path / "t.gguf", metadata, {})))
    assert [w for w, _ in tokenizer.pre_tokenizer.pre_tokenize_str("I'm 12345 go!!")] == words


# --- quantized blocks --------------------------------------------------------------------------


@pytest.mark.parametrize("type_name, bits", [("Q4_0", 4), ("Q4_1", 4), ("Q8_0", 8)])
def test_quantized_blocks_match_mlx_reader_and_spec(tmp_path, type_name, bits):
    shape = (48, 96)
    entry = random_blocks(type_name, shape, np.random.default_rng(1))
    path = write_gguf(tmp_path / "q.gguf", {"general.architecture": "llama"}, {"w.weight": entry})
    gguf = read_gguf(path)
    info = gguf.tensors["w.weight"]
    tensor = to_mlx(gguf.read_tensor_bytes(info), info.shape, info.type_name)
    assert tensor.bits == bits and tensor.weight.shape == (48, 96 * bits // 32)
    reference = mx.load(str(path))  # MLX's own GGUF reader packs these types the same way
    for part in ("weight", "scales", "biases"):
        assert mx.array_equal(getattr(tensor, part), reference[f"w.{part}"]).item(), part
    np.testing.assert_allclose(
        np.array(tensor.dequantize(mx.float32)), dequantize_reference(type_name, shape, entry[2]), rtol=0, atol=1e-6
    )


# --- bad inputs --------------------------------------------------------------------------------


def _minimal_gguf(path: Path, arch: str = "llama", tensor_type: str = "F32") -> Path:
    raw = np.zeros(32, dtype=np.float32).tobytes()
    return write_gguf(path, {"general.architecture": arch}, {"token_embd.weight": (tensor_type, (1, 32), raw)})


def _bytes(data: bytes):
    def make(path: Path, good: Path) -> Path:
        path.write_bytes(data)
        return path

    return make


def _cut(start: int, stop: int | None):
    def make(path: Path, good: Path) -> Path:
        path.write_bytes(good.read_bytes()[start:stop])
        return path

    return make


# case -> (make the bad file from a good one, what the error line must say)
BAD_INPUTS = {
    "not-gguf": (_bytes(b"PK\x03\x04 this is a zip"), "not a GGUF file"),
    "empty": (_bytes(b""), "not a GGUF file"),
    "missing": (lambda path, good: path, "no such file"),
    "version-1": (_bytes(b"GGUF" + struct.pack("<I", 1) + bytes(16)), "GGUF version 1 is not supported"),
    "truncated-header": (_cut(0, 300), "truncated"),
    "truncated-data": (_cut(0, -100), "truncated"),
    "architecture": (lambda path, good: _minimal_gguf(path, arch="mamba"), "architecture 'mamba' is not supported"),
    "tensor-type": (
        lambda path, good: _minimal_gguf(path, tensor_type="I32"),
        "tensor type I32 is not supported (1 tensor, e.g. 'token_embd.weight')",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_clear_line(tmp_path, capsys, tiny_llama_gguf, case):
    make, message = BAD_INPUTS[case]
    bad = make(tmp_path / "bad.gguf", tiny_llama_gguf)
    assert main(["convert", str(bad), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mlxevict: error: ") and message in err, err
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))  # no temporary folder left behind


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_file_is_refused_cleanly(tmp_path, tiny_llama_gguf, data):
    good = tiny_llama_gguf.read_bytes()
    cut = data.draw(st.integers(0, len(good) - 1), label="cut")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good[:cut])
    with pytest.raises(MlxEvictError):
        read_gguf(bad)
    # One corrupt header byte: refused with MlxEvictError or parsed, never another exception.
    at = data.draw(st.integers(0, 600), label="at")
    bad.write_bytes(good[:at] + bytes([good[at] ^ 0xFF]) + good[at + 1 :])
    try:
        read_gguf(bad)
    except MlxEvictError:
        pass


def test_force_replaces_an_earlier_conversion(tmp_path, capsys, tiny_llama_gguf):
    out = tmp_path / "out"
    assert main(["convert", str(tiny_llama_gguf), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        MARKER, "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    capsys.readouterr()
    assert main(["convert", str(tiny_llama_gguf), str(out), "--dtype", "float16"]) == 1
    err = capsys.readouterr().err
    assert "is not empty" in err and "--force" in err and err.count("\n") == 1
    assert main(["convert", str(tiny_llama_gguf), str(out), "--dtype", "float16", "--force"]) == 0
    assert {a.dtype for a in mx.load(str(out / "model.safetensors")).values()} == {mx.float16}
    assert len(list(out.iterdir())) == 5  # replaced, no build folder left inside


def test_force_never_deletes_the_gguf_itself(tmp_path, capsys, tiny_llama_gguf):
    folder = tmp_path / "models"
    folder.mkdir()
    gguf = folder / "m.gguf"
    gguf.write_bytes(tiny_llama_gguf.read_bytes())
    assert main(["convert", str(gguf), str(folder), "--force"]) == 1
    assert "holds the GGUF file" in capsys.readouterr().err and gguf.exists()


def test_help_names_architectures(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    out = capsys.readouterr().out
    assert "llama" in out and "qwen2" in out and "Q4_1" in out and "example" in out


def test_real_subprocess_error_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_text("hello")
    script = Path(sysconfig.get_path("scripts")) / "mlxevict"
    proc = subprocess.run([str(script), "convert", str(bad), str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 1
    expected = f"mlxevict: error: {bad}: not a GGUF file (starts with b'hell', expected b'GGUF')"
    assert proc.stderr.strip().splitlines() == [expected]


def test_demo_model_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXEVICT_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on the discard port
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(MlxEvictError, match="could not download the demo model"):
        demo_model_path("q4")
    assert not any(p.name.endswith(".partial") for p in tmp_path.rglob("*"))


# --- the real SmolLM2-135M-Instruct ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [None, "float32"], ids=["quantized", "float32"])
def test_converted_smollm_answers_paris(smollm_gguf_path, tmp_path, capsys, dtype):
    out = tmp_path / "smollm"
    assert main(["convert", str(smollm_gguf_path), str(out), *(["--dtype", dtype] if dtype else [])]) == 0
    model, tokenizer = mlx_lm.load(str(out))
    messages = [{"role": "user", "content": QUESTION}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=16)  # greedy by default
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_real_gguf_tensors_match_mlx_reader(smollm_gguf_path):
    gguf = read_gguf(smollm_gguf_path)
    reference = mx.load(str(smollm_gguf_path))
    assert {t.type_name for t in gguf.tensors.values()} == {"F32", "Q4_1", "Q8_0"}
    for name, info in gguf.tensors.items():
        tensor = to_mlx(gguf.read_tensor_bytes(info), info.shape, info.type_name)
        base = name.removesuffix(".weight")
        parts = {"weight": tensor.weight}
        if tensor.quantized:
            parts |= {"scales": tensor.scales, "biases": tensor.biases}
        for part, array in parts.items():
            key = f"{base}.{part}" if tensor.quantized else name
            assert mx.array_equal(array, reference[key]).item(), key


@pytest.mark.slow
@pytest.mark.parametrize(
    "text",
    ["Digits 0123456789 and 2024-12-31", "tabs\t\tand   runs of   spaces\n\n\nand newlines", "emoji 👋🏽 🇫🇷 🤖!",
     "<|im_start|>user\nHi<|im_end|>\n", "  leading and trailing  ", "café, naïve, Straße, 東京"],
)  # fmt: skip
def test_tokenizer_round_trips(smollm_path, text):
    tokenizer = load_tokenizer(smollm_path)
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.slow
def test_tokenizer_special_tokens_and_digits(smollm_path):
    tokenizer = load_tokenizer(smollm_path)
    assert tokenizer.encode("<|im_start|>") == [1] and tokenizer.encode("<|im_end|>") == [2]
    assert len(tokenizer.encode("2024")) == 4  # SmolLM's pre-tokenizer splits every digit
    assert tokenizer.eos_token_ids == {2}


@pytest.mark.slow
def test_chat_template_renders_as_in_gguf(smollm_path, smollm_gguf_path):
    _, metadata = mx.load(str(smollm_gguf_path), return_metadata=True)  # an independent GGUF reader
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        metadata["tokenizer.chat_template"]
    )
    tokenizer = load_tokenizer(smollm_path)
    conversations = [
        [{"role": "user", "content": QUESTION}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    ]  # fmt: skip
    for messages in conversations:
        expected = template.render(messages=messages, add_generation_prompt=True)
        assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == expected
    assert expected.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and expected.endswith("assistant\n")


@pytest.mark.slow
def test_quantized_and_float32_logits_agree(smollm_path, smollm_q4_path):
    f32_model, tokenizer = mlx_lm.load(str(smollm_path))
    q4_model, _ = mlx_lm.load(str(smollm_q4_path))
    tokens = mx.array(tokenizer.encode(LOGITS_TEXT))[None]
    assert 190 <= tokens.shape[1] <= 220
    a = f32_model(tokens)[0]
    b = q4_model(tokens)[0].astype(mx.float32)
    assert mx.array_equal(a.argmax(-1), b.argmax(-1)).item()
    assert mx.abs(a - b).max().item() < LOGITS_MAX_DIFF


# --- K-quants and the other types re-packed or re-quantized ----------------------------------------

K_HIDDEN, K_FFN, K_HEADS, K_KV_HEADS = 256, 512, 4, 2  # K-quant rows hold multiples of 256 values
# GGUF matrix -> K-quant type, as llama.cpp's mixes choose them. Q4_K_S: every type repacked with its
# values kept; Q4_K_M: Q6_K (re-quantized to 8 bits) for the embedding, attn_v and ffn_down.
K_MIXES = {
    "Q4_K_S": {"token_embd": "Q4_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q5_K", "attn_output": "Q4_K",
               "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q5_K"},
    "Q4_K_M": {"token_embd": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
               "ffn_gate": "Q4_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K"},
}  # fmt: skip
# rel. RMS error against the gguf package's decoding, measured by scripts/measure_requant.py (docs/faults.md):
# Q4_K/Q5_K 3.4e-4 (float16 scales), Q6_K 4.4e-3 (8 bits); allowed here with a margin of about 2x.
KQUANT_REL_RMS = {"Q4_K": 1e-3, "Q5_K": 1e-3, "Q6_K": 1e-2}


def _kquant_gguf(tmp_path: Path, mix: str) -> tuple[Path, Path]:
    """A tiny llama written by the gguf package's writer with K-quant matrices, and its float32 twin."""
    types, rng = K_MIXES[mix], np.random.default_rng(7)
    quant, floats = {}, {}
    shapes = {"attn_q": (K_HIDDEN, K_HIDDEN), "attn_k": (K_KV_HEADS * 64, K_HIDDEN),
              "attn_v": (K_KV_HEADS * 64, K_HIDDEN), "attn_output": (K_HIDDEN, K_HIDDEN),
              "ffn_gate": (K_FFN, K_HIDDEN), "ffn_up": (K_FFN, K_HIDDEN), "ffn_down": (K_HIDDEN, K_FFN)}  # fmt: skip
    vocab = [*byte_level_vocab(), "Ġt"]  # one merge: the gguf package's writer refuses an empty list
    quant["token_embd.weight"] = random_kquant(types["token_embd"], (len(vocab), K_HIDDEN), rng)
    quant["output_norm.weight"] = f32(1 + 0.1 * rng.standard_normal(K_HIDDEN))
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            quant[f"blk.{layer}.{norm}.weight"] = f32(1 + 0.1 * rng.standard_normal(K_HIDDEN))
        for name, shape in shapes.items():
            quant[f"blk.{layer}.{name}.weight"] = random_kquant(types[name], shape, rng)
    for name, entry in quant.items():
        floats[name] = entry if entry[0] == "F32" else f32(dequantize_gguf(entry))
    metadata = small_model_metadata(
        "llama", layers=LAYERS, hidden=K_HIDDEN, ffn=K_FFN, heads=K_HEADS, kv_heads=K_KV_HEADS,
        rope_base=ROPE_BASE, chat_template=CHATML,
    )  # fmt: skip
    metadata |= {"tokenizer.ggml.tokens": vocab, "tokenizer.ggml.merges": ["Ġ t"]}
    metadata["tokenizer.ggml.token_type"] = [*metadata["tokenizer.ggml.token_type"], 1]
    return (
        write_gguf_package(tmp_path / f"tiny.{mix}.gguf", metadata, quant),
        write_gguf_package(tmp_path / "tiny.F32.gguf", metadata, floats),
    )


def _greedy_tokens(folder: Path, n: int = 24) -> list[int]:
    model, tokenizer = mlx_lm.load(str(folder))
    prompt = mx.array(tokenizer.encode("The capital of France is"))
    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=n)]


def test_kquant_gguf_answers_like_its_float_reference(tmp_path, capsys):
    kquant, reference = _kquant_gguf(tmp_path, "Q4_K_S")
    assert main(["convert", str(kquant), str(tmp_path / "k")]) == 0
    err = capsys.readouterr().err
    assert "mlxevict: note: 11 Q4_K tensors repacked as MLX 4-bit affine (group 32): same values" in err, err
    assert "mlxevict: note: 4 Q5_K tensors repacked as MLX 8-bit affine" in err
    config = json.loads((tmp_path / "k" / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["model.layers.0.mlp.down_proj"]["bits"] == 8
    # The reference computes in float16 too, as a quantized model with float16 scales does.
    assert main(["convert", str(reference), str(tmp_path / "f"), "--dtype", "float16"]) == 0
    tokens = _greedy_tokens(tmp_path / "k")
    assert len(set(tokens)) > 3  # the random model does not just repeat one token
    assert tokens == _greedy_tokens(tmp_path / "f")


def test_q4_k_m_gguf_logits_stay_close_to_its_float_reference(tmp_path, capsys):
    """Q6_K is re-quantized to 8 bits (0.4% RMS error per weight): logits close, not identical."""
    kquant, reference = _kquant_gguf(tmp_path, "Q4_K_M")
    assert main(["convert", str(kquant), str(tmp_path / "k")]) == 0
    assert "mlxevict: note: 5 Q6_K tensors re-quantized to MLX 8-bit affine (group 32)" in capsys.readouterr().err
    assert main(["convert", str(reference), str(tmp_path / "f"), "--dtype", "float16"]) == 0
    tokens = mx.array(np.random.default_rng(0).integers(0, 259, size=(1, 64)))
    a, b = (mlx_lm.load(str(tmp_path / name))[0](tokens)[0].astype(mx.float32) for name in ("k", "f"))
    # Measured: max |difference| 0.21 on logits of std 0.91; argmax equal at 63 of 64 positions.
    assert mx.abs(a - b).max().item() < 0.5
    assert mx.mean(a.argmax(-1) == b.argmax(-1)).item() >= 0.95


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_values_match_the_gguf_decoder(type_name):
    entry = random_kquant(type_name, (8, 512), np.random.default_rng(3))
    tensor = to_mlx(np.frombuffer(entry[2], dtype=np.uint8), entry[1], type_name)
    got, ref = np.array(tensor.dequantize(mx.float32)), dequantize_gguf(entry)
    assert np.sqrt(((got - ref) ** 2).mean() / (ref**2).mean()) < KQUANT_REL_RMS[type_name]


@pytest.mark.parametrize("type_name", sorted(REQUANT_BITS))
def test_every_requantized_type_decodes(type_name):
    """Each type the converter claims is decoded by the gguf package and re-quantized close to it."""
    entry = random_quant_bytes(type_name, (4, 512), np.random.default_rng(5))
    tensor = to_mlx(np.frombuffer(entry[2], dtype=np.uint8), entry[1], type_name)
    got, ref = np.array(tensor.dequantize(mx.float32)), dequantize_gguf(entry)
    assert tensor.bits == REQUANT_BITS[type_name] and np.isfinite(ref).all() and ref.std() > 0
    # 8 bits keep about 0.5% of the values' RMS, 4 bits about 12% (IQ2: codebook grids).
    assert np.sqrt(((got - ref) ** 2).mean() / (ref**2).mean()) < (0.01 if tensor.bits == 8 else 0.15)
