"""Model resolution against folders, GGUF files and a hub cache laid out as huggingface_hub lays it out."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from huggingface_hub import snapshot_download
from model_files import build_tiny_model, write_hub_repo, write_tiny_gguf

from mlxevict.cli import main
from mlxevict.errors import MlxEvictError
from mlxevict.family import HEADROOM, IN_USE, room
from mlxevict.gguf_cache import list_conversions
from mlxevict.resolve import (
    DEEPSEEK_R1_DISTILL,
    FAMILY_NAME,
    check_architecture,
    choose_family_member,
    hub_cache_dir,
    load_model,
    resolve_model,
)

GiB = 1024**3
QWEN_1_5B = "mlx-community/DeepSeek-R1-Distill-Qwen-1.5B-4bit"
QWEN_32B = "mlx-community/DeepSeek-R1-Distill-Qwen-32B-4bit"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-model")


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty offline hub cache under ``HF_HOME``."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = tmp_path / "hf" / "hub"
    root.mkdir(parents=True)
    return root


# ---- folders and files ---------------------------------------------------------------------
def test_local_folder(tiny_folder):
    resolved = resolve_model(str(tiny_folder))
    assert (resolved.path, resolved.name, resolved.source) == (tiny_folder, "tiny-model", "folder")
    model, tokenizer = load_model(resolved)
    assert model.model_type == "llama" and tokenizer.encode("hi")


def test_folder_without_config(tmp_path):
    with pytest.raises(MlxEvictError, match="is a folder but not an MLX model \\(no config.json\\)"):
        resolve_model(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(MlxEvictError, match="is a file but not a .gguf model"):
        resolve_model(str(tmp_path / "notes.txt"))


@pytest.mark.parametrize("name", ["./missing", "/no/such/folder", "missing.gguf", "~/nope/model"])
def test_missing_path(name):
    with pytest.raises(MlxEvictError, match="no such file or folder"):
        resolve_model(name)


def test_gguf_is_converted_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXEVICT_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    said: list[str] = []
    first = resolve_model(str(gguf), report=said.append)
    assert first.source == "gguf" and first.name == "tiny.gguf"
    assert first.path.parent == tmp_path / "cache" / "gguf" and (first.path / "config.json").is_file()
    assert len(said) == 1 and said[0].startswith(f"converting tiny.gguf once into {first.path} (about ")
    stamp = (first.path / "model.safetensors").stat().st_mtime_ns
    second = resolve_model(str(gguf), report=said.append)
    assert second.path == first.path and len(said) == 1  # no second conversion
    assert (second.path / "model.safetensors").stat().st_mtime_ns == stamp
    float32 = resolve_model(str(gguf), gguf_dtype="float32")
    assert float32.path != first.path  # another dtype is another conversion
    model, _ = load_model(second)
    assert model.model_type == "llama"


def test_unsupported_architecture(tmp_path, tiny_folder):
    folder = tmp_path / "gemma"
    folder.mkdir()
    config = json.loads((tiny_folder / "config.json").read_text()) | {"model_type": "gemma3"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(MlxEvictError, match="architecture 'gemma3' .* is not supported by mlxevict; supported: llama"):
        load_model(resolve_model(str(folder)))
    with pytest.raises(MlxEvictError, match="gemma3"):
        check_architecture(folder)


# ---- the hub cache ---------------------------------------------------------------------------
def test_hub_cache_location_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == tmp_path / "elsewhere"


def test_repo_from_the_offline_hub_cache(hub, tiny_folder):
    snapshot = write_hub_repo(hub, "someone/tiny-chat", tiny_folder)
    # The layout is the one huggingface_hub itself reads.
    assert Path(snapshot_download("someone/tiny-chat", cache_dir=hub, local_files_only=True)) == snapshot
    resolved = resolve_model("someone/tiny-chat")
    assert (resolved.path, resolved.name, resolved.source) == (snapshot, "someone/tiny-chat", "hub")
    model, tokenizer = load_model(resolved)
    assert model.model_type == "llama"


def test_offline_and_not_cached_names_the_repo_and_how_to_fetch_it(hub):
    with pytest.raises(MlxEvictError) as err:
        resolve_model("someone/not-here")
    message = str(err.value)
    assert message.startswith(f"someone/not-here is not in the local hub cache ({hub}) and HF_HUB_OFFLINE is set")
    assert "`hf download someone/not-here`" in message


def test_config_only_snapshot_is_not_a_model(hub, tiny_folder, tmp_path):
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    (only_config / "config.json").write_text((tiny_folder / "config.json").read_text())
    write_hub_repo(hub, "someone/half", only_config)
    assert resolve_model("someone/half", weights=False).source == "hub"  # enough for `info`
    with pytest.raises(MlxEvictError, match="someone/half is not in the local hub cache"):
        resolve_model("someone/half")


@pytest.mark.parametrize(
    "name, suggestion",
    [
        ("mlx-community/DeepSeek-R1-Distil", FAMILY_NAME),
        ("mlx-comunity/DeepSeek-R1-Distill-Qwen-7B-4bit", "mlx-community/DeepSeek-R1-Distill-Qwen-7B-4bit"),
        ("someone/tiny-chta", "someone/tiny-chat"),
    ],
)
def test_misspelt_repo_suggests_the_closest(hub, tiny_folder, name, suggestion):
    write_hub_repo(hub, "someone/tiny-chat", tiny_folder)
    with pytest.raises(MlxEvictError, match=f"\\(did you mean {suggestion}\\?\\)"):
        resolve_model(name)


@pytest.mark.parametrize("name, suggestion", [("deepseek-r1-distil", FAMILY_NAME), ("dmeo", "demo")])
def test_unknown_bare_name_suggests_the_closest(hub, name, suggestion):
    with pytest.raises(MlxEvictError) as err:
        resolve_model(name)
    assert str(err.value).startswith(f"unknown model {name!r} (did you mean {suggestion}?)")


def test_unknown_name_without_a_close_match(hub):
    with pytest.raises(MlxEvictError, match="unknown model 'zzzqqq': give an MLX folder, a .gguf file"):
        resolve_model("zzzqqq")


# ---- the family name ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "gib, repo",
    [
        (8, "mlx-community/DeepSeek-R1-Distill-Qwen-1.5B-4bit"),
        # 14B and 32B left 0.5 GiB here before: too little for a laptop with a browser open
        (16, "mlx-community/DeepSeek-R1-Distill-Llama-8B-4bit"),
        (32, "mlx-community/DeepSeek-R1-Distill-Qwen-14B-4bit"),
        (64, "mlx-community/DeepSeek-R1-Distill-Qwen-32B-4bit"),
    ],
)
def test_family_choice_for_memory(gib, repo):
    member, reason = choose_family_member(gib * GiB)
    assert member.repo == repo
    assert reason.startswith(f"chose {repo}: ") and f"of {gib}.0 GiB" in reason
    gpu_share = gib * GiB * (2 / 3 if gib <= 36 else 3 / 4)
    assert member.need_nbytes + HEADROOM <= min(gpu_share, gib * GiB - IN_USE)


def test_family_choice_is_the_largest_that_fits():
    for gib in range(8, 80, 2):
        member, _ = choose_family_member(gib * GiB)
        usable = room(gib * GiB)
        larger = DEEPSEEK_R1_DISTILL[DEEPSEEK_R1_DISTILL.index(member) + 1 :]
        assert member.need_nbytes <= usable and all(m.need_nbytes > usable for m in larger)


def test_family_choice_counts_the_budget_the_run_uses_and_the_memory_free_now():
    # a bigger KV budget leaves less for weights; memory in use by other apps is not the model's
    assert choose_family_member(64 * GiB, budget="2048")[0].params == "32B"
    assert choose_family_member(64 * GiB, budget="40GB")[0].params == "8B"
    assert choose_family_member(64 * GiB, available=8 * GiB)[0].params == "8B"
    assert "+ 953.7 MiB KV for --budget 1GB +" in choose_family_member(64 * GiB, budget="1GB")[1]


def test_family_data_is_real_repos_with_plausible_sizes():
    assert [m.params for m in DEEPSEEK_R1_DISTILL] == ["1.5B", "7B", "8B", "14B", "32B"]
    for m in DEEPSEEK_R1_DISTILL:
        assert m.repo == f"mlx-community/DeepSeek-R1-Distill-{m.base}-{m.params}-4bit"
        params = float(m.params[:-1]) * 1e9
        assert 0.5 * params * 0.5 < m.weights_nbytes < 0.75 * params  # ~4.5 bits per weight


def test_family_too_small_a_machine():
    with pytest.raises(MlxEvictError, match="no DeepSeek-R1-Distill model fits 2.0 GiB of memory"):
        choose_family_member(2 * GiB)


def test_family_name_offline_uses_the_largest_cached_fit(hub, tiny_folder):
    write_hub_repo(hub, QWEN_1_5B, tiny_folder)
    said: list[str] = []
    resolved = resolve_model(FAMILY_NAME, memory=64 * GiB, report=said.append)
    assert (resolved.name, resolved.source) == (QWEN_1_5B, "family")
    assert said == [resolved.reason]
    assert "32B would fit but is not cached and HF_HUB_OFFLINE is set" in resolved.reason
    load_model(resolved)


def test_family_name_offline_with_the_best_cached(hub, tiny_folder):
    write_hub_repo(hub, QWEN_1_5B, tiny_folder)
    write_hub_repo(hub, QWEN_32B, tiny_folder)
    assert resolve_model("mlx-community/deepseek-r1-distill", memory=64 * GiB).name == QWEN_32B
    assert resolve_model(FAMILY_NAME, memory=8 * GiB).name == QWEN_1_5B


def test_family_name_offline_with_nothing_cached(hub):
    with pytest.raises(MlxEvictError) as err:
        resolve_model(FAMILY_NAME, memory=16 * GiB)
    assert str(err.value).startswith("mlx-community/DeepSeek-R1-Distill-Llama-8B-4bit is not in the local hub cache")
    assert "hf download mlx-community/DeepSeek-R1-Distill-Llama-8B-4bit" in str(err.value)


# ---- the demo model ------------------------------------------------------------------------------
@pytest.mark.slow
def test_no_model_is_the_demo_model(hub, smollm_path):
    for name in (None, "", "demo"):
        resolved = resolve_model(name)
        assert resolved.source == "demo" and resolved.path == smollm_path


# ---- the GGUF conversion cache ---------------------------------------------------------------
@pytest.fixture
def gguf_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MLXEVICT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def test_touched_or_moved_gguf_finds_its_conversion(tmp_path, gguf_cache):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    first = resolve_model(str(gguf), report=lambda line: None)
    os.utime(gguf, (1, 1))
    moved = gguf.rename(tmp_path / "elsewhere.gguf")
    said: list[str] = []
    again = resolve_model(str(moved), report=said.append)
    assert again.path == first.path and said == []  # keyed on content: no second conversion
    assert [c.path for c in list_conversions()] == [first.path]


def test_changed_gguf_replaces_its_older_conversion(tmp_path, gguf_cache):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    first = resolve_model(str(gguf), report=lambda line: None)
    data = bytearray(gguf.read_bytes())
    data[-4:] = b"\x00\x00\x80\x3f"  # the last weight becomes 1.0: same header, other content
    gguf.write_bytes(bytes(data))
    said: list[str] = []
    second = resolve_model(str(gguf), report=said.append)
    assert second.path != first.path and not first.path.exists()
    assert said[0].startswith("converting tiny.gguf once") and said[-1].startswith("removed the older conversion")
    assert [c.path for c in list_conversions()] == [second.path]


def test_conversions_list_and_remove(tmp_path, gguf_cache, capsys):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    resolved = resolve_model(str(gguf), report=lambda line: None)
    assert main(["conversions", "list"]) == 0
    out = capsys.readouterr().out
    assert resolved.path.name in out and str(gguf) in out and "1 conversion," in out
    assert main(["conversions", "remove", "nope"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no cached conversion 'nope'" in err and resolved.path.exists()
    assert main(["conversions", "remove", str(gguf)]) == 0
    assert "removed 1 conversion" in capsys.readouterr().out and not resolved.path.exists()
    assert main(["conversions"]) == 0 and "no cached conversions" in capsys.readouterr().out


def test_info_plans_a_gguf_without_converting_it(tmp_path, gguf_cache, capsys):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    assert main(["info", str(gguf)]) == 0
    out = capsys.readouterr().out
    assert "not converted yet" in out and "after conversion" in out
    assert list_conversions() == []
