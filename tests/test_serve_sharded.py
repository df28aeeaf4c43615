"""``mlxevict serve`` under real ``mlx.launch --backend ring`` processes, against the single-process server.

The random-weight llama of tests/test_distributed.py (4 query heads, 2 KV heads) serves on 2 ranks
and alone, both on free ports of 127.0.0.1; a real HTTP client asks both the same things, greedily.
``default`` is documented as exact under sharding (docs/distributed.md), so the answers are equal.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time

import psutil
import pytest
from model_files import build_tiny_model
from test_distributed import HANG_GUARD_S, cli_command, end, env, launch_command

BUDGET, MAX_TOKENS = 24, 12
FLAGS = ["--port", "0", "--temp", "0", "--budget", str(BUDGET), "--max-tokens", str(MAX_TOKENS)]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Server:
    """``mlxevict serve`` in its own process group (so Ctrl-C reaches every rank, as from a terminal)."""

    def __init__(self, command: list[str]):
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env(), start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.port = int(re.search(r"at http://127\.0\.0\.1:(\d+)/v1", self.wait_for("serving ")).group(1))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str) -> str:
        """The first stderr line holding ``text`` (fails once the process ends or the hang guard passes)."""
        deadline = time.monotonic() + HANG_GUARD_S
        while time.monotonic() < deadline:
            found = [line for line in self.lines if text in line]
            if found:
                return found[0]
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.05)
        pytest.fail(f"no {text!r} from the server: {''.join(self.lines)[-3000:]}")

    def request(self, path: str, body: dict) -> http.client.HTTPResponse:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HANG_GUARD_S)
        connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        return connection.getresponse()

    def post(self, path: str, body: dict) -> dict:
        response = self.request(path, body)
        assert response.status == 200, response.read()
        return json.loads(response.read())

    def stream(self, path: str, body: dict) -> tuple[str, dict]:
        """The streamed text and the last chunk's usage."""
        response = self.request(path, {**body, "stream": True})
        text, usage = [], {}
        for line in response:
            data = line.decode().removeprefix("data: ").strip()
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            choice = chunk["choices"][0]
            text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
            usage = chunk.get("usage") or usage
        return "".join(text), usage

    def health(self) -> dict:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HANG_GUARD_S)
        connection.request("GET", "/health")
        return json.loads(connection.getresponse().read())

    def interrupt(self) -> str:
        """Ctrl-C to the whole process group; its stderr once every process ended."""
        os.killpg(self.proc.pid, signal.SIGINT)
        self.proc.wait(timeout=HANG_GUARD_S)
        self.reader.join(HANG_GUARD_S)
        return "".join(self.lines)

    def ranks(self) -> list[psutil.Process]:
        return [p for p in psutil.Process(self.proc.pid).children(recursive=True) if "MLX_RANK" in p.environ()]


def test_a_request_crosses_to_the_other_ranks_unchanged():
    from mlxevict.server.protocol import Defaults, parse_request
    from mlxevict.server.ranks import STOP, envelope, request_of

    defaults = Defaults(max_tokens=16, temperature=0.0, top_p=1.0, policy="default", budget=64)
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ü"}],
            "stop": ["\n\n", "END"], "logit_bias": {"7": -100, "12": 2.5}, "budget": "1MB", "seed": 3,
            "stream": True, "stream_options": {"include_usage": True}}
    for kind, extra in (("chat", {}), ("text", {"prompt": "Once upon"})):
        request = parse_request(kind, {**body, **extra}, defaults, ("m",))
        assert request_of(envelope(request)) == request and envelope(request) != STOP


def _events(response: http.client.HTTPResponse, count: int) -> list[bytes]:
    """The first ``count`` server-sent events of a stream (blank lines between them skipped)."""
    events: list[bytes] = []
    while len(events) < count and (line := response.readline()):
        if line.strip():
            events.append(line)
    return events if all(e.startswith(b"data: {") for e in events) and len(events) == count else []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("serve") / "tiny", hidden=128, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def servers(tiny):
    """The sharded server (2 ranks) and the single-process one, started side by side."""
    started: dict = {}

    def start(name: str, command: list[str]) -> None:
        started[name] = Server(command)

    threads = [threading.Thread(target=start, args=("alone", cli_command("serve", str(tiny), *FLAGS)))]
    threads[0].start()
    sharded = Server(launch_command(2, *cli_command("serve", str(tiny), *FLAGS)))
    threads[0].join()
    alone = started["alone"]
    yield sharded, alone
    for server in (sharded, alone):
        end(server.proc)


def test_greedy_answers_equal_the_single_process_servers(servers):
    sharded, alone = servers
    chat = {"messages": QUESTION, "max_tokens": MAX_TOKENS}
    one, many = alone.post("/v1/chat/completions", chat), sharded.post("/v1/chat/completions", chat)
    answer = one["choices"][0]["message"]["content"]
    assert many["choices"][0]["message"]["content"] == answer and answer
    cache = many["usage"]["mlxevict"]
    assert [r["rank"] for r in cache["ranks"]] == [0, 1]
    assert all(2 * r["kv_bytes"] == one["usage"]["mlxevict"]["kv_bytes"] for r in cache["ranks"])
    assert cache["evicted"] == one["usage"]["mlxevict"]["evicted"] > 0  # the budget evicted on both

    # A second request in a row, streamed; then the conversation's next turn, from the kept caches.
    text = {"prompt": "Let me think step by step", "max_tokens": 8}
    (one_text, one_usage), (many_text, many_usage) = alone.stream("/v1/completions", text), sharded.stream(
        "/v1/completions", text)
    assert many_text == one_text and many_usage["completion_tokens"] == one_usage["completion_tokens"] == 8
    assert [2 * r["kv_bytes"] for r in many_usage["mlxevict"]["ranks"]] == [one_usage["mlxevict"]["kv_bytes"]] * 2
    # A stop sequence ends the answer at the same token on every rank: the same text and token count.
    stopped = {**text, "stop": one_text[5:7]}
    one, many = alone.post("/v1/completions", stopped), sharded.post("/v1/completions", stopped)
    assert many["choices"][0]["text"] == one["choices"][0]["text"] == one_text[: one_text.find(one_text[5:7])]
    assert many["usage"]["completion_tokens"] == one["usage"]["completion_tokens"] < 8
    follow_up = {"messages": [*QUESTION, {"role": "assistant", "content": answer},
                              {"role": "user", "content": "And of Italy?"}], "max_tokens": MAX_TOKENS}
    one, many = alone.post("/v1/chat/completions", follow_up), sharded.post("/v1/chat/completions", follow_up)
    assert many["choices"][0]["message"]["content"] == one["choices"][0]["message"]["content"]
    assert many["usage"]["prompt_tokens_details"]["cached_tokens"] == one["usage"]["prompt_tokens_details"][
        "cached_tokens"] > 0
    assert sharded.health()["ranks"] == 2 and "ranks" not in alone.health()


def test_a_client_that_leaves_mid_stream_stops_every_rank_and_the_next_request_is_served(servers):
    sharded, alone = servers
    response = sharded.request("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1900, "stream": True})
    assert _events(response, 3)  # mid-generation
    response.close()
    deadline = time.monotonic() + HANG_GUARD_S
    while (health := sharded.health())["cancelled"] < 1 or health["busy"]:
        assert time.monotonic() < deadline, health
        time.sleep(0.1)
    assert health["last"]["completion_tokens"] < 1900
    chat = {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": MAX_TOKENS}
    one, many = alone.post("/v1/chat/completions", chat), sharded.post("/v1/chat/completions", chat)
    assert many["choices"][0]["message"]["content"] == one["choices"][0]["message"]["content"]


def test_ctrl_c_ends_every_rank_cleanly(servers):
    sharded, _ = servers
    ranks = sharded.ranks()
    assert len(ranks) == 2
    err = sharded.interrupt()
    # mlx.launch itself stops on Ctrl-C (its KeyboardInterrupt) and then forwards no more of the ranks'
    # output, but it still waits for them and warns about every rank that exits other than with 0.
    assert "exited with code" not in err and "was killed" not in err and "mlxevict: error" not in err, err[-3000:]
    assert not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks)


@pytest.mark.parametrize("when", ["generating", "idle"])
def test_a_killed_rank_ends_the_server_with_one_error_line(tiny, when):
    server = Server(launch_command(2, *cli_command("serve", str(tiny), *FLAGS)))
    try:
        if when == "generating":
            response = server.request("/v1/completions", {"prompt": "Go on.", "max_tokens": 1900, "stream": True})
            assert _events(response, 2)
        rank = [r for r in server.ranks() if r.environ()["MLX_RANK"] == "1"]
        rank[0].kill()
        server.proc.wait(timeout=HANG_GUARD_S)
        server.reader.join(HANG_GUARD_S)
    finally:
        end(server.proc)
    err = "".join(server.lines)
    errors = [line for line in err.splitlines() if line.startswith("mlxevict: error: rank 0 of 2")]
    assert len(errors) == 1, err[-3000:]
    assert "Traceback" not in err and "server stopped" not in err
