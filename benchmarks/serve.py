"""``python -m mlxevict.benchmarks.serve``: ``mlxevict serve`` beside ``mlx_lm.server`` on the same model.

Both servers run at once, in subprocesses started the same way (same environment,
OpenBLAS preloaded on Linux for both), and get the same requests over HTTP:

- speed: ``--requests`` streamed chat requests per server, each a new
  conversation of ``--max-tokens`` tokens (end-of-sequence banned with
  ``logit_bias``, so every answer has the same length). The requests alternate
  between the servers, so a busy neighbour on the machine slows both alike:
  requests per minute and the median time to the first token.
- memory: one answer of ``--long-tokens`` tokens per server, one server at a
  time: its process's peak resident memory, sampled every 50 ms, and the growth
  over the idle server (weights loaded, warm-up and speed requests done).

mlxevict runs with ``--budget``; mlx-lm's server has no KV bound to set.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import psutil

from ..openblas import preload_env

SERVERS = ("mlxevict", "mlx-lm")
TOPICS = ("the sea", "a mountain", "a city at night", "an old library", "a long train ride", "a garden in spring",
          "a storm", "a market", "a snowy forest", "a lighthouse", "a desert road", "a quiet harbour")


def server_command(name: str, model: str, port: int, budget: int) -> list[str]:
    if name == "mlxevict":
        return [sys.executable, "-m", "mlxevict.cli", "serve", model, "--port", str(port), "--budget", str(budget),
                "--temp", "0"]
    return [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--port", str(port), "--temp", "0"]


def request(port: int, body: dict, timeout: float = 3600) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
    return connection.getresponse()


def wait_ready(port: int, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server on port {port} was not ready within {timeout} s")


def streamed(port: int, body: dict) -> tuple[float, float, int]:
    """``(seconds to the first text, seconds in all, text chunks)`` of one streamed request."""
    start = time.perf_counter()
    response = request(port, {**body, "stream": True})
    first, chunks = None, 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            delta = choice.get("delta", {})
            if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
                chunks += 1
                first = first or time.perf_counter() - start
    return first or float("nan"), time.perf_counter() - start, chunks


class PeakRss:
    """The most resident memory a process (and its children) held while this was running."""

    def __init__(self, pid: int, every: float = 0.05):
        self.process, self.every, self.peak = psutil.Process(pid), every, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def rss(self) -> int:
        return sum(p.memory_info().rss for p in [self.process, *self.process.children(recursive=True)])

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.every)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def start_server(name: str, args: argparse.Namespace, port: int) -> tuple[subprocess.Popen, list[str]]:
    env = preload_env(os.environ) or dict(os.environ)
    command = server_command(name, args.model, port, args.budget)
    log = open(Path(args.log_dir) / f"serve-{name}.log", "w") if args.log_dir else subprocess.DEVNULL
    return subprocess.Popen(command, env=env, stdout=log, stderr=log), command


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def chat_body(i: int, tokens: int, banned: dict, distinct_system: bool) -> dict:
    """Request ``i``: a new conversation. No "model" field: each server's default."""
    messages = [{"role": "user", "content": f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}."}]
    if distinct_system:
        messages.insert(0, {"role": "system", "content": f"Story {i}: you write vivid stories."})
    return {"max_tokens": tokens, "temperature": 0.0, "logit_bias": banned, "messages": messages}


def long_answer(port: int, pid: int, body: dict) -> dict:
    """Peak and idle RSS around one non-streamed answer, and its usage."""
    sampler = PeakRss(pid)
    idle = sampler.rss()
    start = time.perf_counter()
    with sampler:
        answer = json.loads(request(port, body).read())
    usage = answer.get("usage", {})
    seconds = time.perf_counter() - start
    return {
        "long_completion_tokens": usage.get("completion_tokens"),
        "long_tokens_per_s": (usage.get("completion_tokens") or 0) / seconds,
        "long_peak_rss": sampler.peak,
        "long_rss_growth": sampler.peak - idle,
        "idle_rss": idle,
        "long_mlx_peak": usage.get("mlxevict", {}).get("peak_memory"),
        "long_kv_bytes": usage.get("mlxevict", {}).get("kv_bytes"),
    }


def run(args: argparse.Namespace, banned: dict) -> list[dict]:
    """Both servers up; the speed requests alternate between them; then one long answer each."""
    names = args.servers.split(",")
    started = {name: start_server(name, args, args.port + i) for i, name in enumerate(names)}
    ports = {name: args.port + i for i, name in enumerate(names)}
    try:
        for name, (process, _) in started.items():
            wait_ready(ports[name], process)
            streamed(ports[name], chat_body(len(TOPICS) - 1, 8, banned, True))  # warm-up
        runs: dict[str, list] = {name: [] for name in names}
        for i in range(args.requests):
            order = names if i % 2 == 0 else names[::-1]  # neither always goes first
            for name in order:
                runs[name].append(streamed(ports[name], chat_body(i, args.max_tokens, banned, args.distinct_system)))
        rows = []
        for name in names:
            process, command = started[name]
            row = {
                "server": name,
                "command": " ".join(command[1:]),
                "requests_per_minute": 60 * len(runs[name]) / sum(r[1] for r in runs[name]),
                "ttft_s_median": statistics.median(r[0] for r in runs[name]),
            }
            if args.long_tokens:
                row.update(long_answer(ports[name], process.pid, chat_body(0, args.long_tokens, banned, True)))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        return rows
    finally:
        for process, _ in started.values():
            stop_server(process)


def mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def table(rows: list[dict]) -> str:
    lines = ["| server | requests/min | time to first token (median) | long answer: tokens, tok/s | peak RSS | "
             "RSS growth | MLX peak | KV held |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        long = f"{r.get('long_completion_tokens')}, {r.get('long_tokens_per_s', 0):.1f}"
        lines.append(
            f"| {r['server']} | {r['requests_per_minute']:.1f} | {r['ttft_s_median']:.2f} s | {long} "
            f"| {mib(r.get('long_peak_rss'))} | {mib(r.get('long_rss_growth'))} | {mib(r.get('long_mlx_peak'))} "
            f"| {mib(r.get('long_kv_bytes'))} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    from ..demo_model import demo_model_path

    parser = argparse.ArgumentParser(prog="python -m mlxevict.benchmarks.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="an MLX model folder (default: the demo model, float32)")
    parser.add_argument("--budget", type=int, default=256, help="mlxevict's KV budget in tokens (default %(default)s)")
    parser.add_argument("--requests", type=int, default=6, help="streamed requests per server (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per streamed request (default %(default)s)")
    parser.add_argument("--long-tokens", type=int, default=2000, help="tokens of the long answer (default %(default)s)")
    parser.add_argument("--port", type=int, default=8391, help="first port used (default %(default)s)")
    parser.add_argument("--servers", default=",".join(SERVERS), help="which servers, in order (default %(default)s)")
    parser.add_argument("--distinct-system", action="store_true",
                        help="give every request its own system message (no prompt prefix to share)")
    parser.add_argument("--log-dir", default=None, help="write each server's log here")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    args.model = args.model or str(demo_model_path())
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(args.model))
    banned = {str(t): -100.0 for t in sorted(tokenizer.eos_token_ids)}
    rows = run(args, banned)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
