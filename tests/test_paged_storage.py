"""The paged cache (``mlxevict.paged_storage``): evicted entries in a page store on disk, read back by page."""

from __future__ import annotations

import io
import os
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import save_prompt_cache
from tiny_models import random_tokens, run_chunks, tiny_model

import mlxevict
from mlxevict.benchmarks import caches as bcaches
from mlxevict.errors import MlxEvictError
from mlxevict.page_store import PAGE, PageStore
from mlxevict.paged_storage import PagedStorage
from mlxevict.plan import paged_tokens, parse_budget

CHUNKS = [32] * 12 + [1] * 16  # 400 tokens streamed into 128 entries, then single steps


def run(model, tmp_path, pages: int, budget="128", **kwargs):
    caches = mlxevict.make_cache(model, "default", budget, page_dir=tmp_path, pages=pages, **kwargs)
    return run_chunks(model, caches, random_tokens(sum(CHUNKS)), CHUNKS), caches


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_a_page_comes_back_as_it_was_written(tmp_path, dtype):
    entries = mx.random.normal((6, 3 * PAGE, 40)).astype(dtype)
    store = PageStore(tmp_path, 6, 40, dtype)
    store.append(entries[:, :PAGE])
    store.append(entries[:, PAGE:])
    index = np.array([[2, 0]] * 3 + [[1, 1]] * 3)  # head h reads its pages index[h]
    got = store.read(index)
    want = mx.stack([mx.concatenate([entries[h, p * PAGE : (p + 1) * PAGE] for p in index[h]]) for h in range(6)])
    assert got.dtype == dtype and mx.array_equal(got, want)
    assert store.disk_bytes == os.fstat(store._file.fileno()).st_size == 3 * 6 * PAGE * 40 * dtype.size
    assert os.listdir(tmp_path) == []  # nameless from the start: nothing to leave behind
    with pytest.raises(IndexError):
        store.read(np.array([[3]] * 6))
    store.close()
    with pytest.raises(ValueError):
        store.append(entries[:, :PAGE])


def test_every_page_read_back_is_the_full_cache_and_none_is_the_evicting_cache(tmp_path):
    model = tiny_model(head_dim=64)  # the sketch quantizes 64 (or 32) channels a group
    tokens = random_tokens(sum(CHUNKS))
    full = run_chunks(model, bcaches.make_caches(model, "kvcache", None, bcaches.CacheSettings()), tokens, CHUNKS)
    plain = run_chunks(model, mlxevict.make_cache(model, "default", 128), tokens, CHUNKS)
    every, caches = run(model, tmp_path, 1000)
    none, _ = run(model, tmp_path, 0)
    some, _ = run(model, tmp_path, 2)
    s = caches[0].storage
    assert caches[0].evictions > 0 and s.evicted + caches[0].size() == caches[0].offset  # nothing lost
    assert s.store.pages == s.evicted // PAGE and s.tail.shape[2] == s.evicted % PAGE
    assert mx.allclose(every, full, atol=1e-4) and not mx.allclose(plain, full, atol=1e-3)
    gap = lambda x: mx.abs(x - full).max().item()  # noqa: E731
    # Reading nothing back still attends to the unfinished page, so it is not the plain cache either.
    assert gap(every) < gap(some) < gap(plain) and gap(some) < gap(none)
    assert s.bytes_read > 0


def test_its_logits_are_the_pilots_that_chose_the_storage(tmp_path):
    model = tiny_model(head_dim=64)
    pilot = run_chunks(model, bcaches.make_caches(model, "shared-2s2", 128, bcaches.CacheSettings()),
                       random_tokens(sum(CHUNKS)), CHUNKS)  # fmt: skip
    assert mx.allclose(run(model, tmp_path, 2, kv_rotate=False)[0], pilot, atol=1e-5)  # the pilot's unrotated sketch
    assert not mx.allclose(run(model, tmp_path, 2)[0], pilot, atol=1e-5)  # the default rotates it: other pages


def exact_page_scores(queries, keys, scale):
    """What the sketch approximates: per kv-head, the most over its query heads of logsumexp over a page."""
    B, H, S, D = keys.shape
    q = (scale * queries).reshape(B, H, -1, queries.shape[2], D)
    s = (q @ keys[:, :, None].swapaxes(-1, -2)).reshape(B, H, q.shape[2], q.shape[3], S // PAGE, PAGE)
    return mx.logsumexp(s, axis=-1).max(axis=2)


def test_page_scores_are_the_keys_own_with_the_sketch_rotated_or_not(tmp_path):
    mx.random.seed(3)
    B, H, S, D = 1, 2, 8 * PAGE, 64
    keys = mx.random.normal((B, H, S, D)) * mx.where(mx.arange(D) == 5, 12.0, 1.0)  # one outlier channel
    queries = mx.random.normal((B, 2 * H, 3, D))
    want = exact_page_scores(queries, keys, 0.125)
    for rotate in (False, True):
        storage = PagedStorage(tmp_path, 2, bits=8, rotate=rotate)
        storage._spill(keys, mx.zeros_like(keys))
        assert mx.abs(storage.page_scores(queries, 0.125, S // PAGE) - want).max().item() < 0.05  # (qR)·(kR) = q·k


def test_a_memory_budget_holds_the_entries_the_sketch_and_the_pages_within_it(tmp_path):
    model = tiny_model(head_dim=64)
    budget = 400_000  # bytes; a float32 full cache of 400 tokens takes 819,200
    tokens = paged_tokens(parse_budget(f"{budget}B"), model, sum(CHUNKS), pages=2)
    fewer = paged_tokens(parse_budget(f"{budget}B"), model, 2 * sum(CHUNKS), pages=2)
    assert 0 < fewer < tokens < sum(CHUNKS)  # more tokens expected: a larger sketch, fewer entries held
    _, caches = run(model, tmp_path, 2, f"{budget}B", expected_tokens=sum(CHUNKS))
    assert caches[0].budget == tokens and caches[0].evictions > 0
    entry = 2 * 64 * 4 * 2  # one layer's keys and values of one token, float32, 2 kv-heads
    assert sum(c.nbytes for c in caches) + 2 * PAGE * entry <= budget  # the pages read: one layer's
    # Fed twice the tokens it was sized for, it stays within the budget: the oldest pages lose their sketch.
    _, caches = run(model, tmp_path, 2, f"{budget}B", expected_tokens=sum(CHUNKS) // 2)
    s = caches[0].storage
    assert s.first_page > 0 and s.sketch[0].shape[2] <= s.sketch_limit
    assert sum(c.nbytes for c in caches) + 2 * PAGE * entry <= budget
    with pytest.raises(MlxEvictError, match="holds no token with a page store"):
        paged_tokens(parse_budget("20KB"), model, 4096, pages=2)


@pytest.mark.parametrize("pages_on_disk", [True, False], ids=["pages", "tail-only"])
def test_a_saved_paged_cache_loads_and_continues_as_the_one_it_was(tmp_path, pages_on_disk):
    model = tiny_model(head_dim=64)
    tokens = random_tokens(sum(CHUNKS) + 8)
    chunks = CHUNKS if pages_on_disk else [32] * 4 + [1] * 4  # 136 tokens into 128: 8 evicted, no whole page
    caches = mlxevict.make_cache(model, "default", 128, page_dir=tmp_path / "a", pages=2)
    n = sum(chunks)
    run_chunks(model, caches, tokens[:n], chunks)
    assert (caches[0].storage.store is not None) == pages_on_disk and caches[0].storage.evicted > 0
    saved = tmp_path / "saved.safetensors"
    save_prompt_cache(str(saved), caches)
    loaded = mlxevict.load_cache(saved, model)
    assert isinstance(loaded[0].storage, PagedStorage) and loaded[0].storage.folder == tmp_path / "a"
    assert loaded[0].storage.evicted == caches[0].storage.evicted and loaded[0].storage.rotate
    rest = tokens[n : n + 8]
    want = run_chunks(model, caches, rest, [1] * 8)
    assert mx.array_equal(run_chunks(model, loaded, rest, [1] * 8), want)  # the same pages, scored the same
    assert loaded[0].storage.disk_bytes == caches[0].storage.disk_bytes


def test_a_cache_saved_before_pages_were_saved_is_refused_in_one_line():
    from mlxevict.cache_state import storage_from_meta

    with pytest.raises(MlxEvictError, match="saved with a page store .* cannot be loaded"):
        storage_from_meta({"paged": 32})


def test_the_page_files_go_with_the_cache_and_bad_settings_are_one_line(tmp_path):
    model = tiny_model(head_dim=64)
    _, caches = run(model, tmp_path, 2)
    assert sum(c.storage.disk_bytes for c in caches) > 0 and os.listdir(tmp_path) == []
    mlxevict.make_cache(model, "default", 128, page_dir=tmp_path / "new" / "pages")
    assert (tmp_path / "new" / "pages").is_dir()  # made, as an output folder is
    (tmp_path / "file").write_text("")
    with pytest.raises(MlxEvictError, match="cannot make page folder"):
        mlxevict.make_cache(model, "default", 128, page_dir=tmp_path / "file" / "pages")
    with pytest.raises(ValueError, match="leave kv_bits out"):
        mlxevict.make_cache(model, "default", 128, page_dir=tmp_path, kv_bits=4)
    with pytest.raises(MlxEvictError, match="head dim that 32 divides"):
        run(tiny_model(head_dim=16), tmp_path, 2)


# ---- the command line: --page-dir, --pages -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):
    from model_files import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("paged") / "tiny32", hidden=128)  # head dim 32


def generate(capsys, *args):
    from mlxevict.cli import main

    rc = main(["generate", *map(str, args)])
    return rc, *capsys.readouterr()


def test_generate_with_a_page_dir_evicts_to_disk_and_says_what_it_read(capsys, tiny32, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, out, err = generate(capsys, tiny32, "-p", "hello " * 40, "--budget", "48", "--page-dir", tmp_path,
                            "--pages", "2", "-m", "40", "--temp", "0")  # fmt: skip
    assert rc == 0, err
    stats = err.strip().splitlines()[-1]
    assert re.search(r"KV kept \d+/48, evicted [1-9]\d*, .* \| pages [0-9.]+ KiB on disk, [0-9.]+ [KM]iB read", stats)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--page-dir", "none", "--pages", "4"], "--pages needs a page store: drop --page-dir none"),
        (["--pages", "4", "--kv-bits", "4"], "--pages keeps entries in the model's dtype"),
        (["--pages", "0"], "--pages 0: read at least one page"),
        (["--page-dir", "DIR", "--kv-bits", "4"], "--page-dir keeps entries in the model's dtype"),
        (["--page-dir", "DIR/file/pages"], "cannot make page folder"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_bad_page_settings_are_one_line(capsys, tiny32, tmp_path, monkeypatch, args, message, command):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "file").write_text("")
    args = [a.replace("DIR", str(tmp_path)) for a in args]
    if command == "generate":
        rc, out, err = generate(capsys, tiny32, "-p", "hello", "-m", "2", *args)
    elif command == "chat":
        rc, out, err = chat(capsys, monkeypatch, "", tiny32, "--plain", "-m", "2", *args)
    else:  # every one fails before the server listens
        from mlxevict.cli import main

        rc, (out, err) = main(["serve", str(tiny32), "--port", "0", *args]), capsys.readouterr()
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1 and message in err, err


def test_a_prompt_cached_with_a_page_dir_is_continued_from_its_file(capsys, tiny32, tmp_path, monkeypatch):
    from mlxevict.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    saved = tmp_path / "facts.safetensors"
    rc = main(["cache-prompt", str(tiny32), "-p", "The pass key is 4721. " * 12, "--budget", "48", "--page-dir",
               str(tmp_path / "pages"), "--pages", "2", "--prompt-cache-file", str(saved)])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    rc, out, err = generate(capsys, "--prompt-cache-file", saved, "-p", " What is the pass key?", "-m", "8",
                            "--temp", "0")  # fmt: skip
    assert rc == 0 and re.search(r"KV kept \d+/48, evicted \d+, .* \| pages [0-9.]+ KiB on disk", err), err
    rc, out, err = generate(capsys, "--prompt-cache-file", saved, "-p", "?", "--page-dir", tmp_path)
    assert rc == 1 and "a saved cache keeps its own settings; drop --page-dir" in err and len(err.splitlines()) == 1


def chat(capsys, monkeypatch, lines: str, *args):
    from mlxevict.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    rc = main(["chat", *map(str, args)])
    return rc, *capsys.readouterr()


def test_plain_chat_with_a_page_dir_holds_what_the_paged_plan_holds_at_every_budget(capsys, tiny32, tmp_path,
                                                                                    monkeypatch):  # fmt: skip
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lines = "Hello there, tell me more\n/stats\n/budget 300KB\nand again\n/budget 40\nonce more\n/quit\n"
    rc, out, err = chat(capsys, monkeypatch, lines, tiny32, "--plain", "--budget", "200KB", "--page-dir", tmp_path,
                        "--pages", "2", "-m", "40", "--temp", "0")  # fmt: skip
    assert rc == 0, err
    held = [paged_tokens(parse_budget(b), tiny32, None, pages=2) for b in ("200KB", "300KB")]  # a chat: the context
    assert err.startswith(f"chatting with tiny32 (policy default, budget {held[0]}, evicted entries to {tmp_path} "
                          "(200KB)); /help")  # fmt: skip
    assert f"budget {held[1]} tokens from the next turn" in err and "budget 40 tokens from the next turn" in err
    stats = [line for line in err.splitlines() if line.startswith("[")]
    capacities = [int(re.search(r"KV kept \d+/(\d+)", line).group(1)) for line in stats]
    evicting = [line for line in stats if not re.search(r"evicted 0,", line)]
    assert capacities == [*held, 40] and len(evicting) >= 2 and all(" on disk, " in line for line in evicting), stats
    assert re.search(r"^KV cache \(default\): .*; evicted entries: [0-9.]+ KiB on disk, [0-9.]+ KiB read back$", err,
                     re.M)  # fmt: skip
    assert os.listdir(tmp_path) == []


def test_a_paged_chat_session_refuses_kv_bits_and_keeps_its_settings(tiny32, tmp_path):
    from mlx_lm import load

    from mlxevict.chat_session import ChatSession
    from mlxevict.kvstorage import KVStorage

    model, tokenizer = load(str(tiny32))
    session = ChatSession(model, tokenizer, budget="200KB", page_dir=tmp_path, pages=2, max_tokens=4, temp=0.0)
    held = paged_tokens(parse_budget("200KB"), model, None, pages=2)
    storage = session.caches[0].storage
    assert isinstance(storage, PagedStorage) and session.budget == held and session.page_budget == "200KB"
    assert storage.sketch_limit == 2048 - held  # the model's context: what a chat expects
    with pytest.raises(ValueError, match="no --kv-bits"):
        session.replan("300KB", KVStorage.parse("8"))
    assert (session.budget, session.page_budget) == (held, "200KB")
    session.configure(budget=50)  # a budget in tokens: no memory to hold the sketch within
    assert session.page_budget is None and session.caches[0].storage.sketch_limit is None
    assert session.caches[0].budget == 50


def test_a_disk_row_of_the_long_suite_counts_the_sketch_in_its_share_of_memory():
    from mlxevict.benchmarks.long_feed import budget_for, kv_fraction
    from mlxevict.benchmarks.long_runs import Run

    model, n, settings = tiny_model(head_dim=64), sum(CHUNKS), bcaches.CacheSettings()
    budget = budget_for(model, Run("disk-2", "memory", 0.5), n, settings)
    assert budget < 0.5 * n * 0.9  # fewer entries held than the share's tokens: the sketch and pages take the rest
    caches = bcaches.make_caches(model, "disk-2", budget, settings)
    run_chunks(model, caches, random_tokens(n), CHUNKS)
    assert caches[0].evictions > 0 and kv_fraction(model, caches, n) <= 0.5


@pytest.mark.parametrize("budget", [64, 256])
def test_its_memory_with_the_sketch_is_never_above_a_full_cache(tmp_path, budget):
    from mlxevict.stats import cache_stats

    model, tokens = tiny_model(head_dim=64), random_tokens(520)
    caches = mlxevict.make_cache(model, "default", budget, page_dir=tmp_path, pages=2)
    for i in range(tokens.shape[0]):  # token by token: the full cache's steps of 256 are crossed twice
        model(tokens[None, i : i + 1], cache=caches)
        stats = cache_stats(caches)
        assert stats.nbytes <= stats.full_nbytes, (i, stats.nbytes, stats.full_nbytes)
    assert stats.evicted > 0 and caches[0].storage.sketch is not None


def test_a_page_scored_by_its_best_key_outranks_a_page_of_middling_ones(tmp_path):
    """``page_score="max"`` (the eval's ``disk-Km``): one strong key outranks sixteen middling ones, which
    outrank it by their mass (the default). Keys on one channel, so the 2-bit sketch holds them exactly."""
    D = 64
    first = np.zeros((1, 1, 2 * PAGE, D), np.float32)
    first[..., :PAGE, 0] = 3.0  # page 0: sixteen keys of 3
    first[..., PAGE, 0], first[..., PAGE + 1 :, 0] = 5.0, -20.0  # page 1: one key of 5, the rest far away
    keys = mx.array(first)
    query = mx.array(np.eye(1, D, dtype=np.float32).reshape(1, 1, 1, D))
    storage = PagedStorage(tmp_path, pages=1, rotate=False)
    storage._spill(keys, mx.zeros_like(keys))
    mass = np.array(storage.page_scores(query, 1.0, 2))[0, 0, 0]
    assert mass.argmax() == 0 and np.allclose(mass, [3.0 + np.log(PAGE), 5.0], atol=1e-4)
    storage.page_score = "max"
    best = np.array(storage.page_scores(query, 1.0, 2))[0, 0, 0]
    assert best.argmax() == 1 and np.allclose(best, [3.0, 5.0], atol=1e-4)
    with pytest.raises(MlxEvictError, match="page_score one of logsumexp, max"):
        PagedStorage(tmp_path, page_score="sum")
