"""``mlxevict serve`` alone and under ``mlx.launch -n N``, side by side: time to first token and decode speed.

Every server serves the same model (by default the demo's shape with 6 KV heads of
:mod:`.distributed`, so 1, 2 and 3 ranks split it); all run at once, and the
streamed greedy requests alternate between them, so a change in the machine's load
touches every server alike: read the ratios. Each request is a new conversation of
``--max-tokens`` tokens (end-of-sequence banned with ``logit_bias``).

    bash scripts/with-openblas python -m mlxevict.benchmarks.serve_sharded --ranks 1,2 --requests 3 --max-tokens 32
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .distributed import LAUNCHER, bench_model

QUESTIONS = ["Why is the sky blue?", "Name three rivers.", "What is 17 times 13?", "Describe a cat.", "Is 221 prime?"]


class Served:
    """One server process (its own process group) and the port it reported."""

    def __init__(self, model: Path, ranks: int, args: argparse.Namespace):
        command = [sys.executable, "-m", "mlxevict.cli", "serve", str(model), "--port", "0", "--temp", "0",
                   "--budget", str(args.budget), "--policy", args.policy, "--conversations", "0"]
        if ranks > 1:
            command = [sys.executable, "-c", LAUNCHER, "-n", str(ranks), "--backend", "ring", "--", *command]
        self.ranks, self.lines = ranks, []
        # stdin stays open: at EOF mlx.launch polls it in a busy loop that takes a core from the ranks.
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     stdout=subprocess.DEVNULL, env=os.environ | {"HF_HUB_OFFLINE": "1"},
                                     start_new_session=True)
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()
        while not (found := [m for line in self.lines if (m := re.search(r"at http://[^:]+:(\d+)/v1", line))]):
            if self.proc.poll() is not None:
                raise SystemExit(f"{ranks} ranks: the server ended\n{''.join(self.lines)[-2000:]}")
            time.sleep(0.2)
        self.port = int(found[0].group(1))

    def ask(self, question: str, max_tokens: int, eos: int) -> dict[str, Any]:
        """One streamed chat request: seconds to the first token, decode tok/s after it, the answer, the usage."""
        body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "logit_bias": {str(eos): -100}}
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        start = time.perf_counter()
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        first = last = None
        text, usage = [], {}
        for line in connection.getresponse():
            data = line.decode().removeprefix("data: ").strip()
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
            if delta.get("content") or delta.get("reasoning_content"):
                last = time.perf_counter()
                first = first or last
                text.append(delta.get("content") or delta.get("reasoning_content"))
        tokens = usage["completion_tokens"]
        return {"ttft": first - start, "decode": (tokens - 1) / (last - first) if last > first else 0.0,
                "answer": "".join(text), "usage": usage}

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="model folder (default: the demo's shape with 6 KV heads)")
    parser.add_argument("--ranks", default="1,2", help="rank counts, comma-separated (1: the server alone)")
    parser.add_argument("--requests", type=int, default=3, help="requests per server")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--policy", default="default")
    args = parser.parse_args()
    model = Path(args.model) if args.model else bench_model()
    eos = json.loads((model / "config.json").read_text()).get("eos_token_id", 0)
    eos = eos[0] if isinstance(eos, list) else eos
    servers: list[Served] = []
    try:
        for n in args.ranks.split(","):
            servers.append(Served(model, int(n), args))
        results: dict[int, list[dict]] = {s.ranks: [] for s in servers}
        for i in range(args.requests):
            for server in servers:  # alternating: every server sees the same load, in turn
                results[server.ranks].append(server.ask(QUESTIONS[i % len(QUESTIONS)], args.max_tokens, eos))
    finally:
        for server in servers:
            server.stop()
    print(f"model {model.name}, policy {args.policy}, budget {args.budget}, {args.requests} streamed requests "
          f"of {args.max_tokens} greedy tokens per server")
    print("| server | decode tok/s (median) | vs alone | time to first token (median) | KV bytes per rank |")
    print("|---|---|---|---|---|")
    base = statistics.median(r["decode"] for r in results[servers[0].ranks])
    for server in servers:
        rows = results[server.ranks]
        decode = statistics.median(r["decode"] for r in rows)
        cache = rows[-1]["usage"]["mlxevict"]
        kv = " / ".join(str(r["kv_bytes"]) for r in cache.get("ranks", [{"kv_bytes": cache["kv_bytes"]}]))
        name = "alone" if server.ranks == 1 else f"{server.ranks} ranks"
        print(f"| {name} | {decode:.2f} | {decode / base:.2f}x | {statistics.median(r['ttft'] for r in rows):.2f} s "
              f"| {kv} |")
    same = all(len({results[s.ranks][i]["answer"] for s in servers}) == 1 for i in range(args.requests))
    print(f"same answers from every server: {same}")


if __name__ == "__main__":
    main()
