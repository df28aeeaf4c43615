"""The ``mlxevict`` commands as a user runs them: output, stats, JSON, every bad input, Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from model_files import build_tiny_model, write_hub_repo

from mlxevict.budget import parse_size
from mlxevict.cli import main
from mlxevict.geometry import kv_bytes_per_token
from mlxevict.openblas import REEXEC_GUARD, openblas_library, preload_env

PROMPT = "Tell me a long story about a fox who learns to count."
STATS = re.compile(
    r"^\[(\d+) tokens, [\d.]+ tok/s \(prompt (\d+) tokens, [\d.]+ tok/s\) \| KV kept (\d+)/(\d+), evicted (\d+), "
    r"[\d.]+ \w?i?B vs [\d.]+ \w?i?B full \| peak [\d.]+ \w?i?B \| (stop|length|memory|interrupted)\]$"
)
QWEN_1_5B = "mlx-community/DeepSeek-R1-Distill-Qwen-1.5B-4bit"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("cli") / "tiny", template="chatml")


@pytest.fixture(scope="module")
def tiny_think(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("cli") / "think", template="think")


@pytest.fixture(scope="module")
def tiny_short(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("cli") / "short", max_position_embeddings=64)


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))


def cli(capsys, *args: str, stdin: str | None = None) -> tuple[int, str, str]:
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def stats_of(err: str) -> re.Match:
    last = err.rstrip("\n").splitlines()[-1]
    match = STATS.match(last)
    assert match, f"no stats line: {last!r}"
    return match


def one_error_line(err: str, expected: str) -> None:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxevict: error: "), err
    assert expected in lines[0], lines[0]


# ---- help and version -------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "chat", "info"])
def test_help_has_examples(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "examples:" in out and f"mlxevict {command}" in out
    if command != "info":
        for option in ("--policy", "--budget", "--max-tokens", "--temp", "--top-p", "--seed", "--window", "--sinks"):
            assert option in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("mlxevict 0.1.0")


# ---- generate -----------------------------------------------------------------------------------
def test_generate_streams_text_and_ends_with_stats(capsys, tiny):
    rc, out, err = cli(
        capsys,
        "generate",
        tiny,
        "-p",
        PROMPT,
        "--policy",
        "entropy",
        "--budget",
        "64",
        "--max-tokens",
        "100",
        "--seed",
        "0",
    )
    assert rc == 0 and len(out.strip()) > 50
    stats = stats_of(err)
    tokens, prompt, kept, capacity, evicted, reason = stats.groups()
    assert (int(tokens), reason) == (100, "length")
    assert int(kept) <= int(capacity) == 64 and int(evicted) == int(prompt) + 100 - int(kept) > 0


def test_warnings_are_one_line_for_people(capsys, tiny):
    long_prompt = "Count the apples and the pears. " * 20  # longer than the default can pin at 64
    rc, _, err = cli(capsys, "generate", tiny, "-p", long_prompt, "--budget", "64", "--max-tokens", "4")
    assert rc == 0
    assert "mlxevict: warning: the prompt" in err and "not pinned" in err
    assert "UserWarning" not in err and ".py:" not in err


def test_generate_json(capsys, tiny):
    rc, out, err = cli(
        capsys, "generate", tiny, "-p", PROMPT, "--budget", "64", "--max-tokens", "30", "--json", "--temp", "0"
    )
    result = json.loads(out)
    assert rc == 0 and out.count("\n") == 1
    # Nothing but warnings on stderr (here: the 48-token prompt is too long to pin at budget 64).
    assert all(line.startswith("mlxevict: warning: ") for line in err.splitlines())
    assert result["finish_reason"] == "length" and result["generated_tokens"] == 30 and result["answer"]
    assert result["cache"]["kept"] <= result["cache"]["capacity"] == result["budget"] == 64
    assert result["cache"]["tokens_seen"] == result["prompt_tokens"] + 30
    assert result["memory"]["system_total"] > 0 and result["model"] == "tiny"


def test_generate_reads_the_prompt_from_stdin(capsys, tiny):
    rc, out, err = cli(capsys, "generate", tiny, "--max-tokens", "5", "--json", stdin="Why is the sky blue?\n")
    assert rc == 0 and json.loads(out)["prompt_tokens"] > 8


def test_generate_on_a_terminal_without_prompt_uses_the_demo_prompt(capsys, tiny):
    leader, follower = pty.openpty()
    try:
        with open(follower, "r", closefd=False) as terminal:
            sys.stdin = terminal
            rc, out, err = cli(capsys, "generate", tiny, "--max-tokens", "5")
    finally:
        os.close(leader)
        os.close(follower)
    assert rc == 0 and "using the demo prompt" in err.splitlines()[0]


def test_reasoning_goes_to_stderr_or_nowhere(capsys, tiny_think):
    rc, out, err = cli(capsys, "generate", tiny_think, "-p", PROMPT, "--max-tokens", "20", "--temp", "0")
    reasoning = err.splitlines()[0]
    assert rc == 0 and out == "" and len(reasoning) > 10  # the template opened <think>: all of it is reasoning
    rc, out, err = cli(
        capsys, "generate", tiny_think, "-p", PROMPT, "--max-tokens", "20", "--temp", "0", "--hide-reasoning"
    )
    assert rc == 0 and out == "" and len(err.splitlines()) == 1 and stats_of(err)
    rc, out, _ = cli(capsys, "generate", tiny_think, "-p", PROMPT, "--max-tokens", "20", "--temp", "0", "--json")
    assert json.loads(out)["reasoning"].startswith(reasoning)


def test_budget_as_memory_and_auto(capsys, tiny):
    per_token = 2 * 2 * 16 * 2 * 4
    rc, out, _ = cli(
        capsys, "generate", tiny, "-p", "hi", "--max-tokens", "2", "--json", "--budget", f"{per_token * 100 / 1000}KB"
    )
    assert rc == 0 and json.loads(out)["budget"] == 100
    rc, out, _ = cli(capsys, "generate", tiny, "-p", "hi", "--max-tokens", "2", "--json", "--budget", "auto")
    assert rc == 0 and json.loads(out)["budget"] == 2048  # free memory is plenty: the model's context limit


def test_budget_beyond_the_context_is_capped_and_said(capsys, tiny):
    rc, out, err = cli(capsys, "generate", tiny, "-p", "hi", "--max-tokens", "2", "--json", "--budget", "1GB")
    assert rc == 0 and json.loads(out)["budget"] == 2048
    assert err == "mlxevict: --budget 1GB is 1953125 tokens, more than the model's context of 2048; using 2048\n"


# ---- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (["zzzqqq"], "unknown model 'zzzqqq'"),
        (["deepseek-r1-distil"], "(did you mean mlx-community/DeepSeek-R1-Distill?)"),
        (["mlx-community/DeepSeek-R1-Distil"], "(did you mean mlx-community/DeepSeek-R1-Distill?)"),
        (["someone/missing"], "someone/missing is not in the local hub cache"),
        (["./no/such/dir"], "./no/such/dir: no such file or folder"),
        (["TINY", "--budget", "abc"], "bad --budget 'abc': give tokens (2048), KV memory (1.5GB, 800MB) or auto"),
        (["TINY", "--budget", "1.5"], "bad --budget '1.5'"),
        (["TINY", "--budget", "0"], "bad --budget '0': the budget must be a positive number of tokens"),
        (["TINY", "--budget=-3"], "bad --budget '-3'"),
        (["TINY", "--budget", "12XB"], "bad --budget '12XB'"),
        (["TINY", "--budget", "100B"], "--budget 100B holds no token of this model's KV (512 bytes per token)"),
        (["TINY", "--budget", "3"], "budget=3 leaves no room to evict"),
        (["TINY", "--budget", "2KB"], "(--budget 2KB = 3 tokens)"),
        (["TINY", "--budget", "16", "--window", "20"], "budget=16 leaves no room to evict"),
        (["TINY", "-p", ""], "empty prompt: give some text with -p or on stdin"),
        (["TINY", "-p", "   \n "], "empty prompt"),
        (["TINY", "--max-tokens", "0"], "--max-tokens 0 must be at least 1"),
        (["TINY", "--temp", "-1"], "--temp -1.0 must be >= 0"),
        (["TINY", "--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
        (["SHORT", "-p", "word " * 80], "but the model's context limit is 64; shorten the prompt"),
    ],
)
def test_generate_bad_input_is_one_line_and_exit_1(capsys, tiny, tiny_short, args, message):
    args = [{"TINY": tiny, "SHORT": tiny_short}.get(a, a) for a in args]
    if "-p" not in args:
        args += ["-p", "hello"]
    rc, out, err = cli(capsys, "generate", *args)
    assert rc == 1 and out == ""
    one_error_line(err, message)


def test_empty_stdin_is_an_empty_prompt(capsys, tiny):
    rc, _, err = cli(capsys, "generate", tiny, stdin="  \n")
    assert rc == 1
    one_error_line(err, "empty prompt")


def test_unsupported_architecture(capsys, tiny, tmp_path):
    folder = tmp_path / "gemma"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(json.loads((tiny / "config.json").read_text()) | {"model_type": "gemma3"})
    )
    for command in (["generate", folder, "-p", "hi"], ["info", folder], ["chat", folder, "--plain"]):
        rc, _, err = cli(capsys, *command)
        assert rc == 1
        one_error_line(err, "architecture 'gemma3'")


def test_unknown_policy_is_refused_by_the_parser(capsys, tiny):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", str(tiny), "-p", "hi", "--policy", "entropie"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "invalid choice: 'entropie'" in err


@pytest.mark.parametrize("args", [["--debug", "generate", "zzzqqq"], ["generate", "zzzqqq", "--debug"]])
def test_debug_shows_the_traceback(capsys, args):
    rc = main([*args, "-p", "hi"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" in err and err.strip().endswith("or mlx-community/DeepSeek-R1-Distill")


# ---- info ---------------------------------------------------------------------------------------------
def test_info_plan(capsys, tiny):
    rc, out, _ = cli(capsys, "info", tiny, "--json")
    plan = json.loads(out)
    config = json.loads((tiny / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    expected = config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * 4  # float32 weights
    assert rc == 0 and plan["kv_bytes_per_token"] == expected == 512
    assert plan["full_kv_nbytes"] == {"8192": expected * 8192, "32768": expected * 32768, "131072": expected * 131072}
    assert plan["weights_nbytes"] == (tiny / "model.safetensors").stat().st_size
    assert plan["auto_budget"] == plan["budget"] == 2048  # capped at the context limit
    assert plan["saved_nbytes"] == 0  # a budget as large as the context saves nothing
    rc, out, _ = cli(capsys, "info", tiny)
    assert rc == 0 and "KV per token  512 bytes = 2 layers x 2 kv-heads x 16 head-dim x 2 x 4 bytes" in out
    assert "8k: 4.0 MiB" in out and "32k: 16.0 MiB (beyond the context limit)" in out


def test_info_with_a_budget(capsys, tiny):
    rc, out, _ = cli(capsys, "info", tiny, "--json", "--budget", "256")
    plan = json.loads(out)
    assert plan["budget"] == 256 and plan["budget_kv_nbytes"] == 256 * 512
    assert plan["saved_nbytes"] == (2048 - 256) * 512 and plan["saved_fraction"] == pytest.approx(1 - 256 / 2048)
    rc, _, err = cli(capsys, "info", tiny, "--budget", "lots")
    assert rc == 1
    one_error_line(err, "bad --budget 'lots'")


def test_info_family_name_offline(capsys, tiny, tmp_path):
    write_hub_repo(tmp_path / "hf" / "hub", QWEN_1_5B, tiny)
    rc, out, err = cli(capsys, "info", "mlx-community/DeepSeek-R1-Distill", "--json")
    plan = json.loads(out)
    assert rc == 0 and plan["model"] == QWEN_1_5B and plan["source"] == "family"
    assert plan["reason"].startswith(f"chose {QWEN_1_5B}")


def test_info_plans_the_family_offline_without_a_hub_cache(capsys, offline):
    # HF_HUB_OFFLINE=1 and an empty HF_HOME (the offline fixture): nothing downloaded, still a plan
    rc, out, err = cli(capsys, "info", "mlx-community/DeepSeek-R1-Distill")
    assert rc == 0 and err == "" and "not downloaded" in out
    assert re.search(r"8 GiB: 1\.5B +16 GiB: 8B +32 GiB: 14B +64 GiB: 32B +this machine", out)
    rc, out, _ = cli(capsys, "info", "mlx-community/DeepSeek-R1-Distill", "--json", "--budget", "30GB")
    plan = json.loads(out)["family"]
    assert rc == 0 and [m["params"] for m in plan["members"]] == ["1.5B", "7B", "8B", "14B", "32B"]
    assert plan["members"][0]["kv_bytes_per_token"] == {"16-bit": 28672, "8-bit": 15232, "4-bit": 8064, "5/3-bit": 8064}
    assert plan["fits"]["64 GiB"] == "14B"  # 30 GB of KV leave less room for weights


# ---- chat --plain ------------------------------------------------------------------------------------
def test_plain_chat(capsys, tiny):
    lines = [
        "Hello there",
        "/stats",
        "/policy window",
        "/budget 128",
        "and again",
        "/policy bogus",
        "/nope",
        "/reset",
        "third",
        "/quit",
        "never",
    ]
    rc, out, err = cli(
        capsys, "chat", tiny, "--plain", "--budget", "64", "--max-tokens", "12", stdin="\n".join(lines) + "\n"
    )
    assert rc == 0
    assert err.startswith("chatting with tiny (policy default, budget 64)")
    assert "policy window from the next turn" in err and "budget 128 tokens from the next turn" in err
    assert "mlxevict: error: unknown policy 'bogus'" in err and "mlxevict: error: unknown command '/nope'" in err
    assert "conversation cleared, cache freed" in err and "CacheStats(" not in err
    assert re.search(r"^KV cache \(default\): \d+ of \d+ tokens kept, \d+ evicted, budget 64; .* vs .* for a full cache$", err, re.M)
    stats = [STATS.match(line) for line in err.splitlines() if line.startswith("[")]
    assert len(stats) == 3 and all(stats)
    assert stats[1].group(4) == "128"  # the new budget is the new capacity
    assert len(out.strip().splitlines()) == 3


def test_plain_chat_with_a_memory_budget_keeps_its_storage_for_budget_changes(capsys, tiny32):
    lines = ["Hello there", "/budget 60KB", "and again", "/quit"]
    args = ("chat", tiny32, "--plain", "--budget", "100KB", "--max-tokens", "4")
    rc, _, err = cli(capsys, *args, stdin="\n".join(lines) + "\n")
    stats = [line for line in err.splitlines() if line.startswith("[")]
    assert rc == 0 and len(stats) == 2 and all("(5/3-bit)" in line for line in stats)
    assert err.startswith("chatting with tiny32 (policy default, budget 432, KV in 5/3-bit KIVI-64, 4/3-bit below); /help")
    capacities = [int(re.search(r"KV kept \d+/(\d+)", line).group(1)) for line in stats]
    # precision tiers over keys per channel: 168 B a token in the low tier (4/3 bits: 100 KB is under 14% of a
    # 16-bit cache of the model's context, which a chat expects), the window (min(32, budget/8)) and a 64-token
    # key group at 320 B, and 2 reserved scale-table rows (512 B per kv-head)
    fixed = 4 * 512
    assert capacities[0] == (100_000 - 96 * 320 - fixed) // 168 + 32
    window = min(32, capacities[1] // 8)
    assert capacities[1] == (60_000 - (window + 64) * 320 - fixed) // 168 + window


def test_plain_chat_budget_command_stores_as_the_budget_flag_does(capsys, tiny32):
    # /budget 100KB in a chat begun in tokens gets the storage --budget 100KB gets: one planner for both (a chat
    # expects its model's whole context; `generate` expects its prompt and answer, so may pick another low tier)
    start = cli(capsys, "chat", tiny32, "--plain", "--budget", "100KB", "--max-tokens", "2", stdin="/quit\n")[2]
    flag = {"budget": int(re.search(r"budget (\d+), KV in", start).group(1))}
    lines = ["/budget 100KB", "Hello there", "/quit"]
    rc, _, err = cli(capsys, "chat", tiny32, "--plain", "--budget", "64", "--max-tokens", "4", stdin="\n".join(lines) + "\n")
    stats = [line for line in err.splitlines() if line.startswith("[")]
    assert rc == 0 and f"budget {flag['budget']} tokens, KV in 5/3-bit KIVI-64, 4/3-bit below from the next turn" in err
    assert len(stats) == 1 and re.search(rf"KV kept \d+/{flag['budget']},", stats[0]) and "(5/3-bit)" in stats[0]


def test_chat_without_a_terminal_is_plain(capsys, tiny):
    rc, out, err = cli(capsys, "chat", tiny, "--max-tokens", "4", stdin="hi\n")
    assert rc == 0 and err.startswith("chatting with tiny") and stats_of(err).group(1) == "4"


# ---- the real process: Ctrl-C, OpenBLAS --------------------------------------------------------------------
def process_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", REEXEC_GUARD)}
    return env | {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def test_ctrl_c_keeps_the_text_and_exits_130(tmp_path):
    model = build_tiny_model(tmp_path / "long", max_position_embeddings=1_000_000)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlxevict.cli",
            "generate",
            str(model),
            "-p",
            "go",
            "--max-tokens",
            "1000000",
            "--budget",
            "64",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=process_env() | {"PYTHONFAULTHANDLER": "1"},
        # As a terminal starts it. A suite run in the background (`pytest &` in a script) ignores
        # SIGINT, its children inherit that and Python then never installs its handler: that was
        # this test's "flake" (README).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    first = proc.stdout.read(40)  # text is streaming
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        # Show the signal masks and where it ran.
        status = Path(f"/proc/{proc.pid}/status")
        masks = [line for line in status.read_text().splitlines() if line.startswith("Sig")] if status.exists() else []
        proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
        _, err = proc.communicate(timeout=30)
        # The head shows anything it printed after SIGINT (an "Exception ignored" would be there).
        text = err.decode()
        shown = text if len(text) <= 8000 else text[:2000] + "\n[...]\n" + text[-6000:]
        pytest.fail(f"generate ignored Ctrl-C for 60 s; {masks}; its stderr and stacks:\n{shown}")
    assert proc.returncode == 130 and len(first) == 40
    assert "Traceback" not in err.decode()
    last = err.decode().strip().splitlines()[-1]
    assert last == "interrupted" or last.endswith("| interrupted]")


def test_closed_pipe_stops_quietly(tmp_path):
    """`mlxevict generate ... | head -c 20`: the reader leaves, no traceback, exit 141."""
    model = build_tiny_model(tmp_path / "long", max_position_embeddings=1_000_000)
    command = [sys.executable, "-m", "mlxevict.cli", "generate", str(model), "-p", "go", "--max-tokens", "100000"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=process_env())
    first = proc.stdout.read(20)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and len(first) == 20
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_preload_env():
    assert preload_env({"LD_PRELOAD": "/x.so"}) is None
    assert preload_env({REEXEC_GUARD: "1"}) is None
    assert preload_env({"MLXEVICT_NO_OPENBLAS": "1"}) is None
    assert preload_env({}, platform="darwin") is None
    env = preload_env({"A": "b"}, platform="linux")
    if openblas_library() is None:
        assert env is None
    else:
        assert env == {"A": "b", "LD_PRELOAD": str(openblas_library()), REEXEC_GUARD: "1"}


@pytest.mark.skipif(openblas_library() is None, reason="no OpenBLAS on this machine")
def test_command_reexecs_with_openblas(tiny):
    done = subprocess.run(
        [sys.executable, "-m", "mlxevict.cli", "info", str(tiny), "--json"],
        capture_output=True,
        env=process_env(),
        timeout=120,
    )
    assert done.returncode == 0 and json.loads(done.stdout)["openblas"] is True


# ---- acceptance with the real model ------------------------------------------------------------------------
@pytest.mark.slow
def test_acceptance_generate_with_eviction(capsys, smollm_path):
    args = ["generate", smollm_path, "-p", "Write a story about a robot who learns to paint.", "--policy", "entropy"]
    rc, out, err = cli(capsys, *args, "--budget", "64", "--max-tokens", "300", "--seed", "0")
    tokens, prompt, kept, capacity, evicted, reason = stats_of(err).groups()
    assert rc == 0 and len(out.split()) > 20
    assert int(kept) <= int(capacity) == 64 and int(evicted) > 0 and int(tokens) <= 300
    rc, out, _ = cli(capsys, *args, "--budget", "64", "--max-tokens", "40", "--json")
    result = json.loads(out)
    assert rc == 0 and result["cache"]["kept"] <= result["cache"]["capacity"] and result["cache"]["evicted"] > 0


@pytest.mark.slow
def test_acceptance_a_memory_budget_answers_in_5_3_bits_within_its_bytes(capsys, smollm_path):
    question = "What is the capital of France?"
    args = ["generate", smollm_path, "-p", question, "--max-tokens", "12", "--temp", "0", "--json"]
    rc, out, _ = cli(capsys, *args, "--budget", "1MB")
    result = json.loads(out)
    assert rc == 0 and "Paris" in result["answer"]
    assert result["cache"]["kv_bits"] == [5, 3] and result["cache"]["nbytes"] <= 1_000_000
    plain = json.loads(cli(capsys, *args, "--budget", "1MB", "--kv-bits", "none")[1])["cache"]
    assert plain["kv_bits"] is None and plain["nbytes"] <= 1_000_000
    assert result["cache"]["budget"] > 4 * plain["budget"]  # float32 model: 46,080 vs 7,200 B a token


# ---- quantized storage (--kv-bits) ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny32(tmp_path_factory) -> Path:
    """head_dim 32: mx.quantize's smallest group size divides it."""
    return build_tiny_model(tmp_path_factory.mktemp("cli") / "tiny32", hidden=128)


def test_generate_with_kv_bits(capsys, tiny32):
    args = ("generate", tiny32, "-p", PROMPT, "--budget", "64", "--max-tokens", "40", "--temp", "0")
    rc, out, err = cli(capsys, *args, "--kv-bits", "8", "--kv-group-size", "32")
    last = err.rstrip("\n").splitlines()[-1]
    assert rc == 0 and out.strip() and "full (8-bit) | peak" in last
    rc, _, err = cli(capsys, *args, "--kv-bits", "5,3", "--kv-group-size", "32")
    assert rc == 0 and "full (5/3-bit) | peak" in err.rstrip("\n").splitlines()[-1]
    results = {}
    for bits in (None, "8", "4", "5,3"):
        rc, out, _ = cli(capsys, *args, "--json", *(("--kv-bits", bits, "--kv-group-size", "32") if bits else ()))
        results[bits] = json.loads(out)["cache"]
        assert rc == 0 and results[bits]["kv_bits"] == {None: None, "8": 8, "4": 4, "5,3": [5, 3]}[bits]
        assert results[bits]["kept"] <= results[bits]["budget"] == 64 and results[bits]["evicted"] > 0
    assert results[None]["nbytes"] > results["8"]["nbytes"] > results["4"]["nbytes"] == results["5,3"]["nbytes"]


def test_a_memory_budget_stores_in_precision_tiers_and_holds_to_its_bytes(capsys, tiny32):
    args = ("generate", tiny32, "-p", "hi", "--budget", "100KB", "--max-tokens", "2", "--json")
    caches = {}
    for bits in (None, "none", "4", "5,3"):
        extra = ("--kv-bits", bits) + (("--kv-group-size", "32") if bits in ("4", "5,3") else ()) if bits else ()
        caches[bits] = json.loads(cli(capsys, *args, *extra)[1])["cache"]
        assert caches[bits]["nbytes"] <= 100_000, bits  # the window counted at its own size
    assert caches[None]["kv_bits"] == [5, 4] and caches["none"]["kv_bits"] is None  # the high tier
    assert caches["none"]["budget"] == 100_000 // 1024  # 2 layers x 2 kv-heads x 32 x 2 x float32
    # precision tiers, an entry counted in the low tier (keys 3 bits per channel): codes 12 B + row 2 + their
    # share of the scale table 4, values 8 + scale and bias 8: 34 B a kv-head, 136 B a token; the newest 32
    # and a 64-token key group in 8 bits (320 B); 2 reserved scale-table rows (512 B per kv-head)
    assert caches[None]["budget"] == (100_000 - 96 * 320 - 4 * 512) // 136 + 32
    # --kv-bits 4 keeps its window in full precision (1024 B), so fewer tokens fit than under the default
    assert caches["none"]["budget"] < caches["4"]["budget"] < caches[None]["budget"]


@pytest.mark.parametrize("memory, bits", [("3MB", None), ("1MB", 8), ("100KB", [5, 4])])  # 100 KB: the tiers, evicting
def test_a_memory_budget_that_holds_the_whole_context_keeps_the_finest_storage(capsys, tiny32, memory, bits):
    # 2,048 tokens of context: 2 MiB in float32 (1,024 B a token), 0.66 MiB in 8 bits
    args = ("generate", tiny32, "-p", "hi", "--budget", memory, "--max-tokens", "2", "--json")
    cache = json.loads(cli(capsys, *args)[1])["cache"]
    assert cache["kv_bits"] == bits and cache["nbytes"] <= parse_size(memory)
    assert (cache["budget"] == 2048) == (bits != [5, 4])


def test_a_memory_budget_too_small_for_one_token_says_what_a_token_costs(capsys, tiny32):
    rc, _, err = cli(capsys, "generate", tiny32, "-p", "hi", "--budget", "100B")
    assert rc == 1
    one_error_line(err, "--budget 100B holds no token of this model's KV (192 bytes per token)")  # in 5/3 bits


def test_a_budget_in_tokens_stays_in_the_model_dtype_unless_told(capsys, tiny32):
    args = ("generate", tiny32, "-p", "hi", "--budget", "64", "--max-tokens", "2", "--json")
    assert json.loads(cli(capsys, *args)[1])["cache"]["kv_bits"] is None
    cache = json.loads(cli(capsys, *args, "--kv-bits", "5,3", "--kv-group-size", "32")[1])["cache"]
    assert cache["kv_bits"] == [5, 3] and cache["budget"] == 64


def test_info_plans_a_memory_budget_as_chat_runs_it_and_generate_holds_less(capsys, tiny32):
    plan = json.loads(cli(capsys, "info", tiny32, "--json", "--budget", "100KB")[1])
    run = ("generate", tiny32, "-p", "hi", "--budget", "100KB", "--max-tokens", "2", "--json")
    cache = json.loads(cli(capsys, *run)[1])
    # info, like chat, expects the model's whole context (generate expects its prompt and answer)
    start = cli(capsys, "chat", tiny32, "--plain", "--budget", "100KB", "--max-tokens", "2", stdin="/quit\n")[2]
    assert f"budget {plan['budget']}, KV in {plan['budget_storage']})" in start
    # storage grows to the planned bytes: a 2-token answer holds less
    assert 0 < cache["cache"]["nbytes"] <= plan["budget_kv_nbytes"]
    assert plan["budget_kv_bits"] == [5, 3] and plan["auto_kv_bits"] is None  # auto holds the context in float32
    text = cli(capsys, "info", tiny32, "--budget", "100KB")[1]
    assert f"--budget {plan['budget']} tokens holds 97.6 KiB of KV (5/3-bit KIVI-64, 4/3-bit below);" in text
    assert plan["planned_for_tokens"] == plan["context_limit"] == 2048
    assert "planned for 2,048 tokens (the context), as chat and serve plan it; generate plans for" in text
    tokens = json.loads(cli(capsys, "info", tiny32, "--json", "--budget", "64")[1])
    assert tokens["budget_kv_bits"] is None and tokens["planned_for_tokens"] is None  # tokens: no share to plan by
    # precision tiers count a budget past the 2,048-token context at the low tier's bytes: not capped, and the
    # bytes a full context's low-tier entries leave keep entries in the high tier
    # (without a page store: 340KB is 32% of a 16-bit full cache of the context, where the rule would page)
    tiers = ("--budget", "340KB", "--page-dir", "none")
    plan = json.loads(cli(capsys, "info", tiny32, "--json", *tiers)[1])
    cache = json.loads(cli(capsys, *run[:4], *tiers, *run[6:])[1])["cache"]
    assert plan["budget"] == cache["budget"] > plan["context_limit"] == 2048 and "3/2-bit below" in plan["budget_storage"]
    assert plan["saved_nbytes"] == 2048 * 1024 - plan["budget_kv_nbytes"] and cache["nbytes"] <= 340_000
    assert "the context's 2,048 fit, and the rest keeps entries high" in cli(capsys, "info", tiny32, *tiers)[1]


@pytest.mark.parametrize(
    "args, expected",
    [
        (("eval", "--variants", "default:k5v3w8c64l44"),
         "--variants default:k5v3w8c64l44: low_bits=(4, 4) must take fewer bits than kv_bits=(5, 3)"),
        (("eval", "--variants", "default:zz"), "--variants default:zz: ':zz' is not a storage suffix"),
        (("eval", "--policies", "nope"), "--policies nope: unknown cache or policy; choose from: kvcache"),
        (("eval", "--compress-policies", "quantized4:q4"), "--compress-policies quantized4:q4: unknown cache or policy"),
        (("eval", "--baselines", "snapkv"), "--baselines snapkv: choose from kvcache"),
        (("eval", "--parts", "policy"), "--parts policy: choose from baselines, policies"),
        (("eval", "--kinds", "passkey,needle"), "--kinds needle: choose from passkey"),
        (("eval", "--long", "--quick"), "--long and --quick: choose one"),
        (("eval", "--suite", "short", "--policies", "nope"), "unknown cache or policy nope"),
        (("bench", "--policies", "default:k5v3w8c64l44"), "default:k5v3w8c64l44: low_bits=(4, 4) must take fewer"),
    ],
)
def test_eval_and_bench_name_a_bad_cache_in_one_line_before_loading(capsys, tmp_path, args, expected):
    """A name the benchmarks cannot run is one error line, before any model loads (a folder that holds none)."""
    rc, _, err = cli(capsys, args[0], tmp_path / "no-model", *args[1:], "--out", tmp_path / "out")
    assert rc == 1
    one_error_line(err, expected)


def test_kv_bits_none_takes_no_storage_options(capsys, tiny):
    rc, _, err = cli(capsys, "generate", tiny, "-p", "hi", "--budget", "1MB", "--kv-bits", "none", "--fp-window", "8")
    assert rc == 1
    one_error_line(err, "--fp-window 8 needs --kv-bits 8, 4 or 5,3")


@pytest.mark.parametrize(
    "extra, expected",
    [
        (("--kv-group-size", "32"), "--kv-group-size 32 needs --kv-bits 8, 4 or 5,3"),
        (("--kv-bits", "8"), "kv_group_size=64 does not divide the head dim 16; store this model's KV unquantized"),
        (("--fp-window", "16"), "--fp-window 16 needs --kv-bits 8, 4 or 5,3"),
        (("--kv-bits", "8", "--fp-window", "-1"), "--fp-window -1 must be a number of tokens >= 0"),
        # one rule, one message: an 8-bit window needs storage under 8 bits
        (("--window-bits", "8"), "--window-bits 8 needs --kv-bits under 8, such as 4 or 5,3"),
        (("--kv-bits", "8", "--window-bits", "8"), "--window-bits 8 needs --kv-bits under 8 (not --kv-bits 8), such"),
    ],
)
def test_bad_kv_bits_options_are_one_error_line(capsys, tiny, extra, expected):
    rc, _, err = cli(capsys, "generate", tiny, "-p", "hi", "--max-tokens", "2", *extra)
    assert rc == 1
    one_error_line(err, expected)


def test_fp_window_sets_the_full_precision_window(capsys, tiny32):
    args = ("generate", tiny32, "-p", PROMPT, "--budget", "64", "--max-tokens", "40", "--temp", "0", "--json")
    quantized = (*args, "--kv-bits", "8", "--kv-group-size", "32")
    caches = {}
    for n in (None, "0", "16"):
        caches[n] = json.loads(cli(capsys, *quantized, *(("--fp-window", n) if n else ()))[1])["cache"]
    # default: --window, min(32, budget/8) = 8; full-precision slots cost more bytes than quantized ones
    assert [caches[n]["full_precision_window"] for n in (None, "0", "16")] == [8, 0, 16]
    assert caches["0"]["nbytes"] < caches[None]["nbytes"] < caches["16"]["nbytes"]
    assert all(c["evicted"] > 0 for c in caches.values())
    assert json.loads(cli(capsys, *args)[1])["cache"]["full_precision_window"] is None
    rc, _, err = cli(capsys, *quantized, "--fp-window", "60")
    assert rc == 1
    one_error_line(err, "full_precision_window=60 leaves no room to evict at budget=64")


def test_window_bits_stores_the_recent_window_in_8_bits(capsys, tiny32):
    args = ("generate", tiny32, "-p", PROMPT, "--budget", "64", "--max-tokens", "40", "--temp", "0", "--json")
    quantized = (*args, "--kv-bits", "4", "--kv-group-size", "32", "--fp-window", "16")
    full = json.loads(cli(capsys, *quantized)[1])["cache"]
    eight = json.loads(cli(capsys, *quantized, "--window-bits", "8")[1])["cache"]
    assert (full["window_bits"], eight["window_bits"]) == (None, 8)
    assert eight["nbytes"] < full["nbytes"] and eight["evicted"] > 0


def test_chat_takes_fp_window(capsys, tiny32):
    options = ("--budget", "64", "--max-tokens", "4", "--kv-bits", "4", "--kv-group-size", "32", "--fp-window", "12")
    rc, _, err = cli(capsys, "chat", tiny32, "--plain", *options, stdin="hi\n/stats\n")
    assert rc == 0 and "full cache, stored in 4-bit, the newest 12 in full precision" in err


@pytest.mark.parametrize("bits", ["3", "7,3", "5,3,2", "five"])
def test_unsupported_kv_bits_are_refused_by_the_parser(capsys, tiny, bits):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", str(tiny), "-p", "hi", "--kv-bits", bits])
    err = capsys.readouterr().err
    message = f"--kv-bits: {bits} is not supported; use 8 or 4, key and value bits of 2, 3, 4, 5, 6 or 8 such as 5,3, or none"
    assert exit_.value.code == 2 and message in err


def test_info_shows_bytes_per_token_per_storage_mode(capsys, tiny32, tiny):
    rc, out, _ = cli(capsys, "info", tiny32, "--json")
    *plain, tiers = json.loads(out)["storage_modes"]
    modes = {(tuple(b) if isinstance(b := m["kv_bits"], list) else b): m for m in plain}
    # keys in 5 bits and values in 3 cost what 4 bits cost; the memory rule's tiers count an entry at 3/2 bits
    assert rc == 0 and {b: m["bytes_per_token"] for b, m in modes.items()} == {None: 1024, 8: 320, 4: 192, (5, 3): 192}
    assert tiers["flags"].endswith("--key-group 64 --low-bits 3,2") and tiers["bytes_per_token"] == 136
    assert modes[4]["fits_tokens"] > modes[8]["fits_tokens"] > modes[None]["fits_tokens"] > 0
    rc, out, _ = cli(capsys, "info", tiny32)
    # each storage by the flags that ask for it (this head dim needs group size 32)
    assert rc == 0 and re.search(r"--kv-bits 8 --kv-group-size 32 +320 B", out)
    assert re.search(r"--kv-bits 4 --kv-group-size 32 +192 B", out)
    assert re.search(r"--kv-bits 5,3 --kv-group-size 32 +192 B", out)
    rc, out, _ = cli(capsys, "info", tiny)
    assert rc == 0 and "--kv-bits needs a head dim divisible by 32, 64, 128" in out


@pytest.mark.slow
def test_acceptance_no_model_is_the_offline_demo(capsys, smollm_path):
    rc, out, err = cli(capsys, "generate", "-p", "What is the capital of France?", "--max-tokens", "30", "--temp", "0")
    assert rc == 0 and "Paris" in out and stats_of(err)


@pytest.mark.slow
def test_acceptance_info_bytes_per_token(capsys, smollm_path):
    rc, out, _ = cli(capsys, "info", smollm_path, "--json")
    plan = json.loads(out)
    assert rc == 0 and plan["kv_bytes_per_token"] == 30 * 3 * 64 * 2 * 4 == kv_bytes_per_token(smollm_path)
    assert (plan["layers"], plan["kv_heads"], plan["head_dim"], plan["dtype_size"]) == (30, 3, 64, 4)


def test_info_says_what_a_page_store_holds_as_a_paged_chat_holds_it(capsys, tiny32, tmp_path):
    plan = json.loads(cli(capsys, "info", tiny32, "--json", "--budget", "600KB")[1])["page_store"]
    start = cli(capsys, "chat", tiny32, "--plain", "--budget", "600KB", "--page-dir", tmp_path, "-m", "2",
                stdin="/quit\n")[2]  # fmt: skip
    assert plan["budget_held"] > 0 and f"(policy default, budget {plan['budget_held']}, evicted entries" in start
    assert plan["sketch_bytes_per_token"] <= plan["entry_bytes_16bit"] / 8  # 2 bits a channel and its scales
    text = cli(capsys, "info", tiny32, "--budget", "100KB")[1]  # the sketch of the context alone is more
    assert re.search(r"^page store +--page-dir keeps .*; --budget 100KB holds no token with a page store: .*raise it$",
                     text, re.M)  # fmt: skip
