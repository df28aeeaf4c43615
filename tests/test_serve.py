"""``mlxevict serve``: the real ``openai`` client against servers on 127.0.0.1 running the demo model.

The servers run in this process (one engine each, sharing the loaded model) on
free ports; the command line itself runs once in a subprocess (API key, Ctrl-C).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from mlx_lm import load
from mlx_lm.utils import load_tokenizer
from forcing import force

from mlxevict.budget import parse_budget
from mlxevict.commands.common import resolve_budget
from mlxevict.demo_model import demo_model_path
from mlxevict.memory import MemoryGuard
from mlxevict.server import ApiServer, ConversationStore, Defaults, Engine
from mlxevict.server.protocol import ApiError, parse_request
from mlxevict.server.stops import StopMatcher

BUDGET = 256
THINK_SCRIPT = "plan</think>\n\ndone"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LONG_TEXT = (
    "The Nile is a major north-flowing river in northeastern Africa. It flows into the Mediterranean Sea. "
    "The Nile is the longest river in Africa and has historically been considered the longest river in the "
    "world, though this has been contested by research suggesting that the Amazon River is slightly longer. "
    "Its drainage basin covers eleven countries. "
) * 2
DEFAULTS = Defaults(max_tokens=16, temperature=0.0, top_p=1.0, policy="default", budget=BUDGET)


class Running:
    """An in-process server on a free port, and its openai client."""

    def __init__(self, model, tokenizer, *, api_key=None, guard=None, logits_processors=tuple, engine=None,
                 store=None):
        self.engine = engine or Engine(
            model,
            tokenizer,
            defaults=DEFAULTS,
            budget_tokens=lambda text: resolve_budget(parse_budget(text), model),
            cache_options={},
            store=ConversationStore(10, 1 << 30) if store is None else store,
            guard=guard or MemoryGuard(),
            logits_processors=logits_processors,
        )
        ids = ("SmolLM2-135M-Instruct", "default")
        self.server = ApiServer(("127.0.0.1", 0), self.engine, defaults=DEFAULTS, model_ids=ids, api_key=api_key)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.port = self.server.server_address[1]
        self.client = openai.OpenAI(base_url=self.server.url, api_key=api_key or "none", max_retries=0, timeout=120)

    def health(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=10) as response:
            return json.loads(response.read())

    def idle(self, timeout: float = 120) -> dict:
        """``/health`` once nothing runs or waits (polled; fails the test after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            health = self.health()
            if not health["busy"] and not health["queued"]:
                return health
            time.sleep(0.1)
        pytest.fail(f"the server was still busy after {timeout} s: {health}")

    def post(self, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        status, payload = response.status, json.loads(response.read())
        connection.close()
        return status, payload

    def close(self, close_engine: bool = True) -> None:
        self.server.shutdown()
        self.server.server_close()
        if close_engine:
            self.engine.close()


@pytest.fixture(scope="module")
def demo():
    path = demo_model_path()
    model, tokenizer = load(str(path))
    return model, tokenizer, path


@pytest.fixture(scope="module")
def served(demo):
    model, tokenizer, _ = demo
    running = Running(model, tokenizer)
    yield running
    running.close()


def extra(usage) -> dict:
    return usage.model_extra["mlxevict"]


# -- the wire format and stop sequences, without a model


def test_stop_sequences_split_across_pieces_are_found():
    stops = StopMatcher(["STOP", "\n\n"])
    sent = [stops.feed(piece) for piece in ("Hello ST", "O", "P and more")]
    assert "".join(sent) == "Hello " and stops.hit
    stops = StopMatcher(["STOP"])
    assert stops.feed("a ST") == "a " and stops.feed("x") == "STx" and not stops.hit
    assert stops.feed("ST") == "" and stops.flush() == "ST"  # a stop that never completed is text


def test_request_defaults_and_bounds():
    request = parse_request("chat", {"messages": QUESTION}, DEFAULTS, ("m",))
    assert (request.max_tokens, request.temperature, request.policy, request.budget) == (16, 0.0, "default", None)
    body = {"messages": QUESTION, "max_tokens": 5, "stop": "x", "budget": 64}
    request = parse_request("chat", body, DEFAULTS, ("m",))
    assert (request.max_tokens, request.stop, request.budget) == (5, ("x",), "64")
    with pytest.raises(ApiError, match="temperature"):
        parse_request("chat", {"messages": QUESTION, "temperature": True}, DEFAULTS, ("m",))


# -- the server, through the openai client


@pytest.mark.slow
def test_chat_completion_and_models(served):
    assert [m.id for m in served.client.models.list().data] == ["SmolLM2-135M-Instruct"]
    reply = served.client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=12)
    choice = reply.choices[0]
    assert choice.message.content.strip() and choice.finish_reason in ("stop", "length")
    assert 0 < reply.usage.completion_tokens <= 12 and reply.usage.prompt_tokens > 0
    cache = extra(reply.usage)
    assert cache["budget"] == BUDGET and cache["evicted"] == 0
    assert cache["kept"] == cache["tokens_seen"] >= reply.usage.prompt_tokens
    assert cache["kv_bytes"] > 0 and cache["peak_memory"] > 0


@pytest.mark.slow
def test_a_stop_sequence_ends_the_answer_before_it(served):
    plain = served.client.chat.completions.create(model="default", messages=QUESTION, max_tokens=12)
    word = plain.choices[0].message.content.split()[-1]  # greedy: the same answer again, cut where its last word first appears
    reply = served.client.chat.completions.create(model="default", messages=QUESTION, max_tokens=12, stop=[word])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == plain.choices[0].message.content.split(word, 1)[0]


@pytest.mark.slow
def test_text_completion(served):
    reply = served.client.completions.create(model="default", prompt="The capital of France is", max_tokens=6)
    assert reply.choices[0].text.strip() and reply.usage.completion_tokens <= 6


@pytest.mark.slow
def test_streamed_reasoning_is_split_from_the_answer(demo):
    """A template that opens <think>; the model writes "plan</think>\\n\\ndone" (forced): both modes split it."""
    model, _, path = demo
    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    )
    running = Running(model, tokenizer, logits_processors=lambda: [force(tokenizer, THINK_SCRIPT, then_eos=True)])
    try:
        stream = running.client.chat.completions.create(
            model="default", messages=QUESTION, max_tokens=30, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        assert (reasoning, content) == ("plan", "done")
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens > 0 and not chunks[-1].choices

        whole = running.client.chat.completions.create(model="default", messages=QUESTION, max_tokens=30)
        message = whole.choices[0].message
        assert (message.model_extra["reasoning_content"], message.content) == ("plan", "done")
    finally:
        running.close()


@pytest.mark.slow
def test_a_continued_conversation_reuses_its_cache(served):
    first = served.client.chat.completions.create(model="default", messages=QUESTION, max_tokens=8)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages = [*QUESTION, {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And of Italy?"}]
    second = served.client.chat.completions.create(model="default", messages=messages, max_tokens=8)
    cached, read = second.usage.prompt_tokens_details.cached_tokens, extra(second.usage)["prompt_tokens_read"]
    assert cached > first.usage.prompt_tokens and read == second.usage.prompt_tokens - cached
    assert read < second.usage.prompt_tokens / 2
    # The same messages again: the conversation moved on (its cache now holds the second answer), so
    # nothing matches and the whole prompt is read.
    again = served.client.chat.completions.create(model="default", messages=messages, max_tokens=8)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert extra(again.usage)["prompt_tokens_read"] == again.usage.prompt_tokens == second.usage.prompt_tokens


def test_a_server_with_a_page_dir_evicts_to_disk_and_continues_a_conversation(demo, tmp_path):
    model, tokenizer, _ = demo
    engine = Engine(model, tokenizer, defaults=DEFAULTS, budget_tokens=lambda text: resolve_budget(parse_budget(text), model),
                    cache_options={"page_dir": str(tmp_path), "pages": 2}, store=ConversationStore(10, 1 << 30),
                    guard=MemoryGuard())  # fmt: skip
    running = Running(model, tokenizer, engine=engine)
    try:
        messages = [{"role": "user", "content": LONG_TEXT + "\nWhich river is this about?"}]
        first = running.client.chat.completions.create(model="default", messages=messages, max_tokens=8,
                                                       extra_body={"budget": 64})  # fmt: skip
        cache = extra(first.usage)
        assert cache["evicted"] > 0 and cache["disk_bytes"] > 0 and cache["read_bytes"] > 0
        assert cache["kept"] <= 64 and os.listdir(tmp_path) == []  # the page files are nameless
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And where does it flow?"}]  # fmt: skip
        second = running.client.chat.completions.create(model="default", messages=messages, max_tokens=8,
                                                        extra_body={"budget": 64})  # fmt: skip
        assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens  # its paged cache, kept
        assert extra(second.usage)["disk_bytes"] > cache["disk_bytes"] and second.choices[0].message.content.strip()
    finally:
        running.close()


@pytest.mark.slow
@pytest.mark.parametrize("count, nbytes, kept", [(1, 1 << 30, 1), (10, 1, 0)], ids=["count", "bytes"])
def test_kept_conversations_are_bounded(demo, count, nbytes, kept):
    model, tokenizer, _ = demo
    running = Running(model, tokenizer, store=ConversationStore(count, nbytes))
    try:
        for question in ("Name a fruit.", "Name a colour."):
            messages = [{"role": "user", "content": question}]
            running.client.chat.completions.create(model="default", messages=messages, max_tokens=2)
        assert running.health()["conversations"] == kept
    finally:
        running.close()


@pytest.mark.slow
def test_a_request_over_its_budget_evicts_and_still_answers(served):
    messages = [{"role": "user", "content": LONG_TEXT + "\nWhich river is this about?"}]
    reply = served.client.chat.completions.create(
        model="default", messages=messages, max_tokens=8, extra_body={"budget": 64, "policy": "entropy"}
    )
    cache = extra(reply.usage)
    assert reply.usage.prompt_tokens > 64 and reply.choices[0].message.content.strip()
    assert cache["budget"] == 64 and cache["policy"] == "entropy"
    assert cache["kept"] <= 64 and cache["evicted"] == cache["tokens_seen"] - cache["kept"] > 0


@pytest.mark.slow
def test_two_concurrent_clients_are_served_in_turn(served):
    before = served.idle()["served"]
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        reply = served.client.chat.completions.create(model="default", messages=QUESTION, max_tokens=8, seed=1)
        answers[i] = reply.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(answers) == 2 and answers[0] == answers[1] and answers[0].strip()  # greedy: the same answer
    assert served.idle()["served"] == before + 2


@pytest.mark.slow
def test_a_client_that_disconnects_stops_its_generation(served):
    before = served.idle()
    stream = served.client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Count from 1 to 500."}], max_tokens=400, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    after = served.idle()
    assert after["cancelled"] == before["cancelled"] + 1 and after["last"]["finish_reason"] == "cancelled"
    assert after["last"]["completion_tokens"] < 400
    assert after["conversations"] == before["conversations"]  # its cache was freed, not kept
    reply = served.client.chat.completions.create(model="default", messages=QUESTION, max_tokens=4)
    assert reply.choices[0].message.content  # and the server still serves


@pytest.mark.slow
def test_a_client_that_hangs_up_before_a_whole_answer_stops_it(served):
    before = served.idle()
    body = json.dumps({"messages": [{"role": "user", "content": "Count from 1 to 500."}], "max_tokens": 400})
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    connection.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 60
    while not served.health()["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    connection.close()  # no response read: the server notices the closed socket while it waits
    after = served.idle()
    assert after["cancelled"] == before["cancelled"] + 1 and after["last"]["completion_tokens"] < 400


@pytest.mark.slow
def test_an_api_key_is_required_when_set(served):
    guarded = Running(None, None, api_key="secret", engine=served.engine)
    try:
        anonymous = openai.OpenAI(base_url=guarded.server.url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as caught:
            anonymous.models.list()
        assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
        assert [m.id for m in guarded.client.models.list().data] == ["SmolLM2-135M-Instruct"]
    finally:
        guarded.close(close_engine=False)


MALFORMED = {
    "not JSON": b'{"messages": [',
    "not an object": b'["hello"]',
    "no messages": b'{"max_tokens": 5}',
    "a number of the wrong type": json.dumps({"messages": QUESTION, "temperature": "hot"}).encode(),
    "a budget that cannot work": json.dumps({"messages": QUESTION, "budget": 2}).encode(),
    "a budget over the server's": json.dumps({"messages": QUESTION, "budget": BUDGET * 2}).encode(),
    "an unknown model": json.dumps({"messages": QUESTION, "model": "gpt-4o"}).encode(),
    "an unknown policy": json.dumps({"messages": QUESTION, "policy": "lru"}).encode(),
}


@pytest.mark.slow
@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_requests_get_an_openai_error(served, body):
    status, payload = served.post("/v1/chat/completions", body)
    assert status == 400
    error = payload["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and "Traceback" not in error["message"]
    assert served.health()["status"] == "ok"


@pytest.mark.slow
def test_the_memory_guard_stops_a_request_with_length(demo):
    """A margin larger than the machine: the guard stops at its first check and the text so far is sent."""
    model, tokenizer, _ = demo
    import psutil

    running = Running(model, tokenizer, guard=MemoryGuard(margin=2 * psutil.virtual_memory().total))
    try:
        reply = running.client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Count from 1 to 100."}], max_tokens=40
        )
        assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content
        assert reply.usage.completion_tokens < 40 and "swap" in extra(reply.usage)["stopped"]
        assert running.health()["conversations"] == 0  # not kept while memory is short
    finally:
        running.close()


def _read_line(stream, pattern: str, timeout: float) -> re.Match:
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        if select.select([stream], [], [], 0.5)[0]:
            line = stream.readline()
            seen.append(line)
            if match := re.search(pattern, line):
                return match
    pytest.fail(f"no line matching {pattern!r} within {timeout} s; got {seen}")


@pytest.mark.slow
def test_the_command_needs_its_key_and_stops_on_ctrl_c(tmp_path):
    env = {**os.environ, "MLXEVICT_API_KEY": "secret"}
    command = [sys.executable, "-m", "mlxevict.cli", "serve", "--port", "0", "--budget", "64"]
    server = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = _read_line(server.stderr, r"at (http://\S+/v1)", 120).group(1)
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(f"{url}/models", timeout=10)
        assert caught.value.code == 401 and json.loads(caught.value.read())["error"]["code"] == "invalid_api_key"
        request = urllib.request.Request(f"{url}/models", headers={"Authorization": "Bearer secret"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.loads(response.read())["data"][0]["id"] == "SmolLM2-135M-Instruct"
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0
        assert "server stopped" in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
