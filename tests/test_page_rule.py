"""The memory rule's page store: a budget in memory that would evict keeps what it evicts on disk, in every caller."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

import mlx.core as mx
import pytest
from model_files import build_tiny_model
from test_cli import cli
from test_serve import _read_line
from tiny_models import random_tokens, run_chunks, tiny_model

from mlxevict import make_cache
from mlxevict.budget import parse_budget
from mlxevict.chat_session import ChatSession
from mlxevict.geometry import kv_shape
from mlxevict.paged_storage import PagedStorage
from mlxevict.plan import PAGED_SHARE, page_folder, paged_tokens, rule_pages
from mlxevict.stats import cache_stats

CONTEXT = 8192


@pytest.fixture(scope="module")
def model():
    """16-bit, a head dim of 64 (the sketch's group), 8,192 tokens of context: 1,024 B a token."""
    m = tiny_model(head_dim=64, hidden_size=128, max_position_embeddings=CONTEXT)
    m.set_dtype(mx.float16)
    return m


def share(model, fraction: float, tokens: int = CONTEXT) -> str:
    """A budget in memory of ``fraction`` of a 16-bit full cache of ``tokens``."""
    return f"{int(fraction * kv_shape(model, 2).bytes_per_token * tokens)}B"


def paged(caches) -> bool:
    return all(isinstance(c.storage, PagedStorage) for c in caches)


@pytest.mark.parametrize("fraction", [0.125, 0.25])
def test_a_memory_budget_that_would_evict_keeps_the_evicted_entries_in_the_temp_folder(model, fraction):
    budget = share(model, fraction)
    caches = make_cache(model, "default", budget)
    assert paged(caches) and all(str(c.storage.folder) == tempfile.gettempdir() for c in caches)
    assert caches[0].budget == paged_tokens(parse_budget(budget), model) and caches[0].kv_bits is None
    tokens = random_tokens(caches[0].budget + 136)
    run_chunks(model, caches, tokens, [128] * (tokens.size // 128) + [1] * (tokens.size % 128))
    stats = cache_stats(caches)
    assert stats.evicted > 0 and stats.disk_nbytes > 0  # what it evicted is on disk, not gone
    assert stats.nbytes <= parse_budget(budget).nbytes
    # opted out, the same budget stores in precision tiers and loses what it evicts
    tiers = make_cache(model, "default", budget, page_dir=False)
    assert not any(isinstance(c.storage, PagedStorage) for c in tiers) and tiers[0].kv_bits is not None


def test_the_rule_keeps_its_other_storages_where_a_page_store_is_not_for_it(model):
    low = share(model, PAGED_SHARE * 0.9)  # under the share measured: the sketch would leave too little to hold
    assert not rule_pages(model, low) and not paged(make_cache(model, "default", low))
    whole = share(model, 1.0)  # the whole context fits in the dtype: nothing is evicted, nothing to page
    caches = make_cache(model, "default", whole)
    assert not rule_pages(model, whole) and not paged(caches) and caches[0].kv_bits is None
    budget = share(model, 0.25)
    assert rule_pages(model, budget) and not rule_pages(model, 512)  # a budget in tokens is entries, as asked
    asked = make_cache(model, "default", budget, kv_bits=(5, 3), window_bits=8)  # a storage asked for wins
    assert not paged(asked) and asked[0].kv_bits == (5, 3)
    assert page_folder(None, model, budget, storage_asked=True) is None
    assert page_folder("/elsewhere", model, 512) == "/elsewhere" and page_folder(False, model, budget) is None
    # the share is of the tokens expected: 20% of half the context is 10% of all of it
    twenty = share(model, 0.2, CONTEXT // 2)
    assert rule_pages(model, twenty, expected_tokens=CONTEXT // 2) and not rule_pages(model, twenty)


@pytest.fixture(scope="module")
def tiny16(tmp_path_factory):
    """A float16 model folder, head dim 64, 8,192 tokens of context (1,024 B a token)."""
    path = tmp_path_factory.mktemp("rule") / "tiny16"
    return build_tiny_model(path, hidden=128, heads=2, kv_heads=2, max_position_embeddings=CONTEXT, dtype=mx.float16)


def test_the_cli_pages_by_the_rule_and_none_opts_out(capsys, tiny16):
    # 2MB is 24% of a 16-bit full cache of the 8,192-token context, where 5/3 bits would evict: the rule pages
    plan = json.loads(cli(capsys, "info", tiny16, "--json", "--budget", "2MB")[1])
    assert plan["budget_paged"] and plan["budget_page_rule"] and plan["budget_storage"].endswith("evicted entries to disk")
    text = cli(capsys, "info", tiny16, "--budget", "2MB")[1]
    assert "uses it without --page-dir (the memory rule" in text and "--page-dir none: precision tiers instead" in text
    start = cli(capsys, "chat", tiny16, "--plain", "--budget", "2MB", "-m", "2", stdin="/quit\n")[2]
    assert f"budget {plan['budget']}, evicted entries to {tempfile.gettempdir()} (2MB)" in start
    opted = json.loads(cli(capsys, "info", tiny16, "--json", "--budget", "2MB", "--page-dir", "none")[1])
    assert not opted["budget_paged"] and opted["budget_kv_bits"] is not None
    rc, _, err = cli(capsys, "generate", tiny16, "-p", "hi", "--budget", "2MB", "--page-dir", "none", "--pages", "4")
    assert rc == 1 and "--pages needs a page store: drop --page-dir none" in err


def test_a_chat_lets_the_rule_choose_again_at_each_new_budget(tiny16):
    from mlx_lm import load

    model, tokenizer = load(str(tiny16))
    session = ChatSession(model, tokenizer, budget=512, page_rule=True, max_tokens=4, temp=0.0)
    assert not session.paged
    session.replan(share(model, 0.25))
    assert session.paged and session.cache_options["page_dir"] == tempfile.gettempdir() and paged(session.caches)
    assert session.page_budget == share(model, 0.25)
    list(session.send("Hello there"))  # a turn runs on the paged caches
    session.replan(256)  # tokens: entries in the dtype, evicted ones gone
    assert not session.paged and not paged(session.caches) and session.budget == 256
    session.replan(share(model, 0.25), policy="window")
    assert session.paged and session.policy == "window"
    fixed = ChatSession(model, tokenizer, budget=512, page_dir=False, max_tokens=2, temp=0.0)
    fixed.replan(share(model, 0.25))  # opted out (--page-dir none): the tiers
    assert not fixed.paged and fixed.caches[0].kv_bits is not None


def test_a_server_started_with_a_memory_budget_pages_by_the_rule(tiny16):
    """``mlxevict serve`` as people start it: no ``--page-dir``, a budget in memory that would evict."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "mlxevict.cli", "serve", str(tiny16), "--port", "0", "--budget", "2MB"]
    server = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = _read_line(server.stderr, r"at (http://\S+/v1) \(.*evicted entries to (\S+)\)", 120)
        url, folder = line.group(1), line.group(2).rstrip(",")
        assert folder == tempfile.gettempdir()
        text = " ".join(f"word{i % 50} river stone" for i in range(100))  # ~1,600 tokens: more than 2MB holds
        body = {"model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
        request = urllib.request.Request(f"{url}/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                cache = json.loads(response.read())["usage"]["mlxevict"]
        except urllib.error.HTTPError as err:
            pytest.fail(f"{err.code}: {err.read().decode()}")
        assert cache["evicted"] > 0 and cache["disk_bytes"] > 0 and cache["read_bytes"] > 0
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
