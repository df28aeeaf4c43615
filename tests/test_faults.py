"""The faults mlxevict survives, one test each: what a user does wrong or what the machine does to them.

Every fault ends in one line on stderr (``mlxevict: error: ...``) that names the file or
value and says what to do, a non-zero exit, no traceback, and nothing half-written left
behind. Faults are real: a truncated file, a tmpfs that fills up, a read-only bind mount,
a closed stdout. Mounting needs root; without it those tests are skipped, saying why.
"""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from model_files import build_tiny_model, write_tiny_gguf

from mlxevict.cli import main
from mlxevict.convert.convert import MARKER

MLXEVICT = Path(sysconfig.get_path("scripts")) / "mlxevict"
TINY_CONVERSION_BYTES = 60_000  # the tiny GGUF's conversion is about 69 KiB: a tmpfs this size fills up


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def run(capsys, *args: str | Path, stdin: str | None = None) -> tuple[int, str, str]:
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(rc: int, err: str, *expected: str) -> None:
    """The contract: exit 1, one ``mlxevict: error:`` line holding every expected phrase, no traceback."""
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("mlxevict: error: "), err
    for phrase in expected:
        assert phrase in lines[0], lines[0]


def _mount(*args: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs or a read-only bind mount needs root")
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount here: {proc.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs too small for a conversion."""
    disk = tmp_path / "small"
    disk.mkdir()
    _mount("-t", "tmpfs", "-o", f"size={TINY_CONVERSION_BYTES}", "tmpfs", str(disk))
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder on a read-only bind mount (root cannot write it either, unlike a chmod)."""
    source, target = tmp_path / "source", tmp_path / "read-only"
    source.mkdir()
    target.mkdir()
    _mount("--bind", "-o", "ro", str(source), str(target))
    yield target
    subprocess.run(["umount", str(target)], check=True)


# ---- convert --force never deletes a user's files ----------------------------------------------
def test_force_refuses_a_folder_with_unrelated_files(capsys, tmp_path, tiny_gguf):
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "important.txt").write_text("keep")
    rc, _, err = run(capsys, "convert", tiny_gguf, folder, "--force")
    one_error_line(rc, err, "'important.txt'", "no conversion wrote", "deletes nothing else")
    assert [p.name for p in folder.iterdir()] == ["important.txt"]


def test_force_refuses_an_earlier_conversion_the_user_added_to(capsys, tmp_path, tiny_gguf):
    out = tmp_path / "model"
    assert run(capsys, "convert", tiny_gguf, out)[0] == 0
    (out / "notes.md").write_text("mine")
    rc, _, err = run(capsys, "convert", tiny_gguf, out, "--force")
    one_error_line(rc, err, "'notes.md'")
    assert (out / "notes.md").read_text() == "mine" and (out / "model.safetensors").is_file()


def test_force_refuses_a_model_folder_it_did_not_write(capsys, tmp_path, tiny, tiny_gguf):
    folder = tmp_path / "theirs"
    shutil.copytree(tiny, folder)
    for extra in set(p.name for p in folder.iterdir()) - {"config.json", "model.safetensors", "tokenizer.json"}:
        (folder / extra).unlink()
    rc, _, err = run(capsys, "convert", tiny_gguf, folder, "--force")
    one_error_line(rc, err, "is not an earlier mlxevict conversion", MARKER)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_force_into_the_working_folder(capsys, tmp_path, tiny_gguf, monkeypatch):
    """`cd d && mlxevict convert ../x.gguf . --force`: replaced in place, the folder itself kept."""
    out = tmp_path / "d"
    assert run(capsys, "convert", tiny_gguf, out)[0] == 0
    inode = out.stat().st_ino
    monkeypatch.chdir(out)
    assert run(capsys, "convert", tiny_gguf, ".", "--force", "--dtype", "float16")[0] == 0
    assert out.stat().st_ino == inode and json.loads((out / MARKER).read_text())["dtype"] == "float16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no ..xxxx.old/ beside it
    assert len(list(out.iterdir())) == 5


# ---- file-system faults ------------------------------------------------------------------------------
def test_truncated_safetensors(capsys, tmp_path, tiny):
    """The common interrupted download: MLX says only `[load_safetensors]`."""
    folder = shutil.copytree(tiny, tmp_path / "cut")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    rc, _, err = run(capsys, "generate", folder, "-p", "hi", "--max-tokens", "2")
    one_error_line(rc, err, f"{weights} is truncated", "copy, download or convert the model again")


def test_missing_tokenizer_file(capsys, tmp_path, tiny):
    folder = shutil.copytree(tiny, tmp_path / "no-tokenizer")
    (folder / "tokenizer.json").unlink()
    rc, _, err = run(capsys, "generate", folder, "-p", "hi", "--max-tokens", "2")
    one_error_line(rc, err, f"{folder} has no tokenizer file (tokenizer.json or tokenizer.model): the model folder is")
    assert "sentencepiece" not in err


def test_disk_full_during_conversion(capsys, small_disk, tiny_gguf):
    rc, _, err = run(capsys, "convert", tiny_gguf, small_disk / "out")
    one_error_line(rc, err, f"cannot write {small_disk / 'out'}", "no space left on the device", "free some space")
    assert list(small_disk.iterdir()) == []  # nothing half-written left on the full disk


def test_read_only_out_dir(capsys, read_only_dir, tiny_gguf):
    rc, _, err = run(capsys, "convert", tiny_gguf, read_only_dir / "out")
    one_error_line(rc, err, str(read_only_dir / "out"), "read-only file system", "choose another OUT_DIR")


def test_read_only_cache_folder(capsys, read_only_dir, tiny_gguf, monkeypatch):
    monkeypatch.setenv("MLXEVICT_CACHE", str(read_only_dir))
    rc, _, err = run(capsys, "generate", tiny_gguf, "-p", "hi", "--max-tokens", "2")
    assert err.startswith("mlxevict: converting tiny.gguf once")  # said before trying
    one_error_line(rc, err.split("\n", 1)[1], "read-only file system", "set MLXEVICT_CACHE to another folder")


def test_out_dir_under_a_file(capsys, tmp_path, tiny_gguf):
    (tmp_path / "notes.txt").write_text("a file")
    rc, _, err = run(capsys, "convert", tiny_gguf, tmp_path / "notes.txt" / "out")
    one_error_line(rc, err, "is inside", "notes.txt, which is a file", "choose another OUT_DIR")


def _real_command(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(MLXEVICT), *args], text=True, timeout=60, **kwargs)


def test_stdout_closed(tiny):
    proc = _real_command(
        "generate", str(tiny), "-p", "hi", "--max-tokens", "2", stderr=subprocess.PIPE, preexec_fn=lambda: os.close(1)
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "mlxevict: error: stdout is closed; redirect it to a file (> out.txt) or to /dev/null"
    ]


def test_stdout_on_a_full_device(tiny):
    with open("/dev/full", "w") as full:
        proc = _real_command(
            "generate", str(tiny), "-p", "hi", "--max-tokens", "2", stdout=full, stderr=subprocess.PIPE
        )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "mlxevict: error: cannot write stdout: no space left on the device; free some space or write somewhere else"
    )


def test_address_space_limit_too_small_for_the_model(tiny):
    """`ulimit -v` below what loading needs: without the check OpenBLAS spins forever (measured: killed at 30 s)."""

    def limit_address_space():
        resource.setrlimit(resource.RLIMIT_AS, (800 * 1024**2, resource.getrlimit(resource.RLIMIT_AS)[1]))

    proc = _real_command(
        "generate", str(tiny), "-p", "hi", "--max-tokens", "2", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        preexec_fn=limit_address_space,
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("mlxevict: error: the address-space limit (ulimit -v 819200) is 800.0 MiB, below")
    assert "raise it (ulimit -v unlimited)" in lines[0]


# ---- bad values, caught before a model loads ------------------------------------------------------
@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_seed_out_of_range(capsys, tmp_path, seed):
    # The model does not exist: the seed is refused first, so nothing was loaded for nothing.
    rc, _, err = run(capsys, "generate", tmp_path / "not-loaded", "-p", "hi", "--seed", seed)
    one_error_line(rc, err, f"--seed {seed} must be an integer from 0 to 2**64 - 1")


def test_prompt_dash_reads_stdin(capsys, tiny):
    question = "Why is the sea salty?"
    rc, out, _ = run(capsys, "generate", tiny, "-p", "-", "--max-tokens", "2", "--temp", "0", "--json", stdin=question)
    from_stdin = json.loads(out)
    rc2, out2, _ = run(capsys, "generate", tiny, "-p", question, "--max-tokens", "2", "--temp", "0", "--json")
    assert rc == rc2 == 0 and from_stdin["prompt_tokens"] == json.loads(out2)["prompt_tokens"]
    assert from_stdin["answer"] == json.loads(out2)["answer"]


def test_prompt_longer_than_the_context(capsys, tmp_path):
    short = build_tiny_model(tmp_path / "short", max_position_embeddings=32)
    rc, _, err = run(capsys, "generate", short, "-p", "word " * 40, "--no-chat-template")
    one_error_line(rc, err, "the prompt takes ", "but the model's context limit is 32; shorten the prompt")
