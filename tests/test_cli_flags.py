"""mlx-lm's flags on ``mlxevict``, each parsed and honoured; a light start; unknown flags name the nearest."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from model_files import CHATML, build_tiny_model

from mlxevict.cli import build_parser, main

PROMPT = "What is the capital of France?"
HEAVY = ("mlx", "mlx_lm", "transformers")
# A template with a thinking switch, as Qwen3's: the generation prompt opens <think> unless enable_thinking is false.
SWITCH = CHATML.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("flags") / "tiny", template="chatml")


@pytest.fixture(scope="module")
def switch(tmp_path_factory) -> Path:
    folder = build_tiny_model(tmp_path_factory.mktemp("flags") / "switch", template="chatml")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": SWITCH}))
    return folder


@pytest.fixture(scope="module")
def r1(tmp_path_factory) -> Path:
    """A model that ships DeepSeek-R1's generation_config.json."""
    folder = build_tiny_model(tmp_path_factory.mktemp("flags") / "r1", template="chatml")
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95}))
    return folder


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))


def run(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def generate_json(capsys, *args) -> dict:
    rc, out, err = run(capsys, "generate", *args, "--json")
    assert rc == 0, err
    return json.loads(out)


def tokenizer_of(folder: Path):
    from mlx_lm import load

    return load(str(folder))[1]


# ---- start-up -----------------------------------------------------------------------------------------
def imported_by(code: str) -> set[str]:
    """Top-level packages of HEAVY that ``code`` imports in a fresh interpreter."""
    probe = f"{code}\nimport sys; print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(json.loads(result.stdout.strip().splitlines()[-1].replace("'", '"')))


def test_help_imports_neither_mlx_nor_mlx_lm():
    run_help = "from mlxevict.cli import main\ntry:\n    main({})\nexcept SystemExit:\n    pass"
    assert imported_by(run_help.format(["--help"])) == set()
    assert imported_by("import mlxevict") == set()
    # A command's help imports MLX for the policy names at most, never mlx-lm (transformers).
    assert imported_by(run_help.format(["generate", "--help"])) <= {"mlx"}


def test_a_cache_saved_in_one_process_loads_after_a_bare_import_mlxevict(tmp_path):
    tiny = build_tiny_model(tmp_path / "tiny32", hidden=128, heads=4)  # head dim 32: quantizable in groups of 32
    path = tmp_path / "c.safetensors"
    save = (
        "import mlx.core as mx, mlxevict\nfrom mlx_lm import load\nfrom mlx_lm.models.cache import save_prompt_cache\n"
        f"model, _ = load({str(tiny)!r})\nfor bits in (None, 8):\n"
        "    caches = mlxevict.make_cache(model, budget=32, kv_bits=bits, kv_group_size=32)\n"
        "    model(mx.arange(8, 48)[None], cache=caches)\n"
        f"    save_prompt_cache({str(path)!r}.replace('c.', f'c{{bits}}.'), caches)"
    )
    subprocess.run([sys.executable, "-c", save], check=True)
    for bits, name in ((None, "EvictingKVCache"), (8, "QuantizedEvictingKVCache")):
        load = (
            f"import mlxevict\nfrom mlx_lm.models.cache import load_prompt_cache\n"
            f"caches = load_prompt_cache({str(tmp_path / f'c{bits}.safetensors')!r})\n"
            "print(type(caches[0]).__name__, caches[0].offset)"
        )
        result = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, check=True)
        assert result.stdout.split() == [name, "40"]


def test_loading_is_said_on_a_terminal(capsys, tiny, monkeypatch):
    import os
    import pty

    leader, follower = pty.openpty()
    try:
        with open(follower, "w", closefd=False) as terminal:
            monkeypatch.setattr(sys, "stderr", terminal)
            assert main(["generate", str(tiny), "-p", "hi", "-m", "2", "--json"]) == 0
            terminal.flush()
        said = os.read(leader, 65536).decode()
    finally:
        os.close(leader)
        os.close(follower)
    assert said.startswith(f"mlxevict: loading {tiny} ...")


# ---- unknown flags and commands -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, expected",
    [
        (["generate", "--temperature", "0.5"], "generate: error: unknown option --temperature; did you mean --temp?"),
        (["generate", "--sytem-prompt", "x"], "did you mean --system-prompt?"),
        (["chat", "--budgets", "64"], "mlxevict chat: error: unknown option --budgets; did you mean --budget?"),
        (["genrate", "-p", "hi"], "mlxevict: error: unknown command 'genrate'; did you mean generate?"),
    ],
)
def test_unknown_flag_names_the_nearest(capsys, args, expected):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and expected in err
    if args[0] != "genrate":
        assert err.startswith(f"usage: mlxevict {args[0]}")  # the command's usage, not the top-level one


# ---- --model, --max-kv-size, -m ----------------------------------------------------------------------------
def test_model_flag_and_max_kv_size(capsys, tiny):
    result = generate_json(capsys, "--model", tiny, "-p", PROMPT, "--max-kv-size", "48", "-m", "5")
    assert result["model"] == "tiny" and result["budget"] == result["cache"]["capacity"] == 48
    assert result["generated_tokens"] == 5


@pytest.mark.parametrize(
    "args, message",
    [
        (["OTHER", "--model", "TINY"], "two models given"),
        (["TINY", "--max-kv-size", "64", "--budget", "64"], "--max-kv-size 64 and --budget 64 both set the budget"),
        (["TINY", "--max-kv-size", "0"], "--max-kv-size 0 must be a number of tokens >= 1"),
        (["TINY", "--top-k", "-1"], "--top-k -1 must be >= 0"),
        (["TINY", "--min-p", "2"], "--min-p 2.0 must be in [0, 1]"),
        (["TINY", "--ignore-chat-template", "--system-prompt", "be brief"], "--system-prompt needs the chat template"),
        (["TINY", "--prompt-cache-file", "missing.safetensors"], "no such file; write one with mlxevict cache-prompt"),
    ],
)
def test_bad_values_are_one_line(capsys, tiny, tmp_path, args, message):
    args = [{"TINY": tiny, "OTHER": tmp_path}.get(a, a) for a in args]
    rc, out, err = run(capsys, "generate", *args, "-p", "hello")
    assert rc == 1 and out == "" and err.strip().splitlines() == [err.strip()] and message in err, err


def test_bad_template_json_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--chat-template-args", "{enable_thinking: false}"])
    assert exit_.value.code == 2 and "is not JSON" in capsys.readouterr().err


# ---- sampling ---------------------------------------------------------------------------------------------
def test_top_k_1_and_min_p_1_sample_the_greedy_token(capsys, tiny):
    greedy = generate_json(capsys, tiny, "-p", PROMPT, "-m", "24", "--temp", "0")["answer"]
    hot = ("--temp", "5", "--seed", "3")
    assert generate_json(capsys, tiny, "-p", PROMPT, "-m", "24", *hot)["answer"] != greedy  # the control
    assert generate_json(capsys, tiny, "-p", PROMPT, "-m", "24", *hot, "--top-k", "1")["answer"] == greedy
    assert generate_json(capsys, tiny, "-p", PROMPT, "-m", "24", *hot, "--min-p", "1")["answer"] == greedy


def test_sampling_defaults_come_from_generation_config_else_mlx_lm(capsys, tiny, r1):
    from mlx_lm import generate as _  # noqa: F401  (the module, for its defaults)

    mlx_lm_generate = sys.modules["mlx_lm.generate"]
    assert (mlx_lm_generate.DEFAULT_TEMP, mlx_lm_generate.DEFAULT_TOP_K) == (0.0, 0)  # what the help says
    # No generation_config.json: mlx-lm's defaults (greedy), and nothing said.
    rc, out, err = run(capsys, "generate", tiny, "-p", PROMPT, "-m", "16", "--json")
    assert json.loads(out)["answer"] == generate_json(capsys, tiny, "-p", PROMPT, "-m", "16", "--temp", "0")["answer"]
    assert "sampling" not in err
    # DeepSeek-R1's file: temp 0.6, top-p 0.95, said once; the same tokens as those flags given by hand.
    rc, out, err = run(capsys, "generate", r1, "-p", PROMPT, "-m", "16", "--seed", "1", "--json")
    assert err == "mlxevict: sampling --temp 0.6, --top-p 0.95 from the model's generation_config.json\n"
    by_hand = generate_json(capsys, r1, "-p", PROMPT, "-m", "16", "--seed", "1", "--temp", "0.6", "--top-p", "0.95")
    assert json.loads(out)["answer"] == by_hand["answer"]
    # A flag wins over the file.
    rc, out, err = run(capsys, "generate", r1, "-p", PROMPT, "-m", "16", "--temp", "0", "--json")
    assert err == "mlxevict: sampling --top-p 0.95 from the model's generation_config.json\n"
    assert json.loads(out)["answer"] == generate_json(capsys, tiny, "-p", PROMPT, "-m", "16", "--temp", "0")["answer"]


def test_generation_config_without_do_sample_is_greedy(tmp_path):
    from mlxevict.commands.sampling import model_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "bos_token_id": 1}))
    assert model_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_k": 20, "min_p": 0.05}))
    assert model_defaults(tmp_path) == {"top_k": 20, "min_p": 0.05}


# ---- the prompt: system, template arguments, raw text ------------------------------------------------------
def test_system_prompt_and_raw_text_feed_the_tokens_mlx_lm_would(capsys, tiny):
    tok = tokenizer_of(tiny)
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    with_system = tok.apply_chat_template(system, add_generation_prompt=True)
    result = generate_json(capsys, tiny, "-p", PROMPT, "-m", "2", "--system-prompt", "Be brief.")
    assert result["prompt_tokens"] == len(with_system)
    raw = generate_json(capsys, tiny, "-p", PROMPT, "-m", "2", "--ignore-chat-template")
    assert raw["prompt_tokens"] == len(tok.encode(PROMPT))
    assert build_parser("chat").parse_args(["chat", "--system-prompt", "x"]).system == "x"  # chat: both spellings


def test_chat_template_args_reach_the_template(capsys, switch):
    thinking = generate_json(capsys, switch, "-p", PROMPT, "-m", "8", "--temp", "0")
    assert thinking["answer"] == "" and thinking["reasoning"]  # the template opened <think>
    for flag in ("--chat-template-args", "--chat-template-config"):
        off = '{"enable_thinking": false}'
        plain = generate_json(capsys, switch, "-p", PROMPT, "-m", "8", "--temp", "0", flag, off)
        assert plain["reasoning"] == "" and plain["answer"] and plain["prompt_tokens"] == thinking["prompt_tokens"] - 2


# ---- --prompt-cache-file and cache-prompt ---------------------------------------------------------------------
def test_cache_prompt_then_generate_continues_it(capsys, tiny, tmp_path):
    from mlxevict import make_cache
    from mlxevict.commands.prompt import cache_prompt_ids, prompt_ids
    from mlxevict.generate import stream_events

    saved = tmp_path / "doc.safetensors"
    head, question = "Notes: the fox counts to nine. " * 6, " What does the fox count to?"
    rc, _, err = run(capsys, "cache-prompt", tiny, "--prompt-cache-file", saved, "-p", head, "--budget", "40")
    assert rc == 0 and f"to {saved}" in err and saved.is_file()
    resumed = generate_json(capsys, "--prompt-cache-file", saved, "-p", question, "-m", "12", "--temp", "0")
    assert resumed["model"] == "tiny"  # taken from the file
    assert resumed["budget"] == 40 and resumed["cache"]["evicted"] > 0

    # The same tokens fed in one process, into one cache never saved: the same answer.
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tok = load(str(tiny))
    args = build_parser("generate").parse_args(["generate", "-p", "x"])
    caches = make_cache(model, budget=40)
    for _ in generate_step(mx.array(cache_prompt_ids(args, tok, head)), model, max_tokens=0, prompt_cache=caches):
        pass
    suffix = prompt_ids(args, tok, question, cached=True)
    events = list(stream_events(model, tok, suffix, caches=caches, max_tokens=12, temp=0))
    assert resumed["prompt_tokens"] == len(suffix) and resumed["answer"] == events[-1].answer

    # Another model, or a budget the saved cache would ignore: one line each.
    other = build_tiny_model(tmp_path / "other")
    rc, _, err = run(capsys, "generate", other, "--prompt-cache-file", saved, "-p", question)
    assert rc == 1 and "was written with the model in" in err
    rc, _, err = run(capsys, "generate", "--prompt-cache-file", saved, "-p", question, "--budget", "64")
    assert rc == 1 and "a saved cache keeps its own settings; drop --budget" in err


# ---- the demo model ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_demo_model_answers_greedily_by_default(capsys):
    """No generation_config.json: mlx-lm's greedy default, so the README's question stops with the answer."""
    result = generate_json(capsys, "-p", PROMPT, "--budget", "96")
    assert result["finish_reason"] == "stop" and "Paris" in result["answer"] and result["generated_tokens"] < 40


@pytest.mark.slow
def test_demo_model_continues_a_saved_prompt(capsys, tmp_path, smollm_path):
    from mlx_lm.models.cache import load_prompt_cache

    saved = tmp_path / "facts.safetensors"
    facts = "Remember these facts. The pass key is 4721. The sky is green today."
    rc, _, err = run(
        capsys, "cache-prompt", smollm_path, "--prompt-cache-file", saved, "-p", facts, "--max-kv-size", "256"
    )
    assert rc == 0, err
    _, meta = load_prompt_cache(str(saved), return_metadata=True)  # mlx-lm's reader, mlx-lm's keys
    assert meta["model"] == str(smollm_path) and meta["tokenizer_config"] == "{}"
    result = generate_json(capsys, "--prompt-cache-file", saved, "-p", " What is the pass key?", "-m", "30")
    assert result["finish_reason"] == "stop" and "4721" in result["answer"]
