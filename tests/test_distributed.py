"""Sharded runs under real ``mlx.launch --backend ring`` processes on this machine, against one process.

A random-weight llama with 2 KV heads runs on 2 ranks, the demo model (3 KV heads) on 3: for every
policy documented as exact (docs/distributed.md) the greedy tokens and the positions each block of
heads keeps equal the single process's, each rank holds 1/N of its KV bytes, and the budget holds on
every rank. The commands print once, and a killed rank ends the others with one error line.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from model_files import build_tiny_model

from mlxevict.distributed import HostPlan, Shard, check_shardable, plan_hosts, replicated_fraction
from mlxevict.policies import POLICIES

WORKER = Path(__file__).with_name("distributed_worker.py")
# Every registered policy is exact (docs/distributed.md). Quantized storage is not: its codes can round
# the other way when the ranks' all_sum rounds the hidden state differently; it must still hold the
# budget and 1/N of the bytes on every rank, in step.
EXACT = list(POLICIES)
QUANTIZED = ["default:8", "default:5,3"]
HANG_GUARD_S = 600  # a bound so a hung launch fails the test instead of the suite; not a speed assertion


def free_port(count: int) -> int:
    """A first port with ``count`` free ports after it (the ring listens on one per rank), below the
    ephemeral range, so a connection's own local port (the ranks' too) cannot take it before a rank binds."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low, high = (int(n) for n in ranges.read_text().split()) if ranges.exists() else (49152, 65535)  # macOS's
    top = low - count if low > 20000 + count else 65535 - count
    bottom = 20000 if low > 20000 + count else high + 1
    for _ in range(200):
        base = random.randrange(bottom, top)
        if all(_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launch_command(ranks: int, *command: str) -> list[str]:
    launcher = "from mlx._distributed_utils.launch import main; main()"
    port = str(free_port(ranks))
    return [sys.executable, "-c", launcher, "-n", str(ranks), "--backend", "ring", "-p", port, "--", *command]


def env() -> dict[str, str]:
    return os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def run(command: list[str], stdin: str = "", tries: int = 3) -> subprocess.CompletedProcess:
    """Run to the end; stdin stays open (at EOF mlx.launch polls it in a busy loop that takes a core).
    A launch whose port another program bound after ``free_port`` looked is run again on new ports."""
    read, write = os.pipe()
    os.write(write, stdin.encode())
    proc = subprocess.Popen(command, stdin=read, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        end(proc)
        os.close(read)
        os.close(write)
    if "Couldn't bind socket" in err and "-p" in command and tries > 1:
        at = command.index("-p") + 1
        ranks = int(command[command.index("-n") + 1])
        return run([*command[:at], str(free_port(ranks)), *command[at + 1 :]], stdin, tries - 1)
    # mlx.launch exits 0 even when a rank fails, so its output says whether every rank finished.
    assert "exited with code" not in err and "mlxevict: error" not in err, err[-3000:]
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def end(proc: subprocess.Popen) -> None:
    """Kill what is left of a launch: the ranks first (killing mlx.launch alone orphans them)."""
    if proc.poll() is None:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()


def worker(tmp_path: Path, model: Path, ranks: int, budget: int, tokens: int, specs: list[str], blocks: int) -> dict:
    """Run tests/distributed_worker.py alone (``ranks`` 1, reporting ``blocks`` blocks of heads) or on ranks."""
    out = tmp_path / f"worker{ranks}.json"
    command = [sys.executable, str(WORKER), str(model), str(out), str(budget), str(tokens), str(blocks), *specs]
    run(command if ranks == 1 else launch_command(ranks, *command))
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    # head_dim 32, so 8-bit and 5/3-bit storage (group size 32) apply too.
    return build_tiny_model(tmp_path_factory.mktemp("dist") / "tiny", hidden=128, heads=4, kv_heads=2)


def check_sharded(alone: dict, sharded: dict, budget: int, exact: list[str]) -> None:
    """Every spec: 1/N of the bytes, the budget held and evictions on every rank, all ranks in step;
    the ``exact`` ones: also one process's greedy tokens and, per block of heads, its kept positions."""
    assert alone["policies"].keys() == sharded["policies"].keys()
    for spec, one in alone["policies"].items():
        many = sharded["policies"][spec]
        assert len({rank["tokens_crc"] for rank in many["ranks"]}) == 1, spec  # every rank decoded the same
        for block, (rank, single) in enumerate(zip(many["ranks"], one["ranks"])):
            assert rank["kv_nbytes"] == single["kv_nbytes"], (spec, block)  # 1/N of one process's bytes
            if not spec.startswith("full"):
                assert rank["evictions"] > 0 and rank["most_entries"] <= budget, (spec, rank)
            if spec in exact:
                assert rank["tokens_crc"] == single["tokens_crc"], (spec, block)
                assert rank["positions_crc"] == single["positions_crc"], (spec, block)  # same entries per head
        if spec in exact:
            assert many["tokens"] == one["tokens"], spec


def test_every_exact_policy_equals_one_process_on_two_ranks(tiny, tmp_path):
    budget, tokens = 24, 12
    alone = worker(tmp_path, tiny, 1, budget, tokens, EXACT + QUANTIZED, blocks=2)
    sharded = worker(tmp_path, tiny, 2, budget, tokens, EXACT + QUANTIZED, blocks=2)
    assert sharded["ranks"] == 2 and len(alone["policies"]["window"]["ranks"]) == 2
    check_sharded(alone, sharded, budget, EXACT)


@pytest.mark.slow
def test_demo_model_on_three_ranks_equals_one_process(smollm_path, tmp_path):
    # Few tokens and specs: 3 ranks on this 2-core machine wait on each other at every layer's all_sum.
    budget, tokens = 48, 6
    specs = ["default", "random", "uncertainty"]
    alone = worker(tmp_path, smollm_path, 1, budget, tokens, specs, blocks=3)
    sharded = worker(tmp_path, smollm_path, 3, budget, tokens, specs, blocks=3)
    assert sharded["ranks"] == 3
    check_sharded(alone, sharded, budget, specs)


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "mlxevict.cli", *args]


def test_generate_prints_once_with_every_ranks_memory(tiny):
    args = ["generate", str(tiny), "-p", "Count to ten.", "--temp", "0", "--max-tokens", "12", "--budget", "24"]
    args.append("--json")
    alone = json.loads(run(cli_command(*args)).stdout)
    done = run(launch_command(2, *cli_command(*args)))
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1  # rank 0 prints, rank 1 is quiet
    sharded = json.loads(lines[0])
    assert sharded["answer"] == alone["answer"] and sharded["generated_tokens"] == 12
    ranks = sharded["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert 2 * r["kv_nbytes"] == alone["cache"]["nbytes"]
        assert r["kept"] <= r["capacity"] == 24 and r["evicted"] > 0
        assert r["tokens_seen"] == alone["cache"]["tokens_seen"] and r["mlx_peak"] > 0
    assert "rank" not in done.stderr


def test_chat_plain_reads_on_rank_zero_and_prints_rank_stats(tiny):
    args = ["chat", str(tiny), "--plain", "--temp", "0", "--max-tokens", "8", "--budget", "24"]
    lines = "Hi there!\nWhat did I say?\n/quit\n"
    alone = run(cli_command(*args), stdin=lines)
    done = run(launch_command(2, *cli_command(*args)), stdin=lines)
    assert done.stdout == alone.stdout and len(done.stdout.strip().splitlines()) == 2
    stats = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert len(stats) == 2 and all("| 2 ranks: KV " in line for line in stats)


def test_pipeline_holds_half_the_layers_per_rank_and_equals_one_process(tmp_path):
    # qwen2 has mlx-lm's pipeline (llama does not, in 0.32.2); 4 layers: 2 per rank, the last rank the first two.
    model = build_tiny_model(tmp_path / "qwen", model_type="qwen2", layers=4, hidden=128, heads=4, kv_heads=2)
    args = ["generate", str(model), "-p", "Count to ten.", "--temp", "0", "--max-tokens", "12", "--budget", "24",
            "--json"]
    alone = json.loads(run(cli_command(*args)).stdout)
    sharded = json.loads(run(launch_command(2, *cli_command(*args, "--pipeline"))).stdout)
    assert sharded["answer"] == alone["answer"] and sharded["generated_tokens"] == 12
    for r in sharded["ranks"]:
        assert 2 * r["kv_nbytes"] == alone["cache"]["nbytes"]  # caches for its own 2 layers only
        assert r["kept"] == alone["cache"]["kept"] and r["evicted"] == alone["cache"]["evicted"] > 0


@pytest.mark.parametrize("stopped", ["killed", "terminated"])
def test_a_killed_rank_ends_the_others_with_one_error_line(tiny, stopped):
    # "killed": rank 1 is SIGKILLed; rank 0 learns it from the ring or from mlx.launch's SIGTERM,
    # whichever comes first. "terminated": rank 0 gets mlx.launch's SIGTERM before the ring fails.
    args = ["generate", str(tiny), "-p", "Go on.", "--temp", "0", "--max-tokens", "1900", "--budget", "24"]
    proc = subprocess.Popen(
        launch_command(2, *cli_command(*args)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env(),
    )
    try:
        assert proc.stdout.read(4)  # rank 0 is streaming the answer: mid-generation
        rank = "1" if stopped == "killed" else "0"
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("MLX_RANK") == rank]
        ranks[-1].send_signal(signal.SIGKILL if stopped == "killed" else signal.SIGTERM)
        _, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        end(proc)
    errors = [line for line in err.decode().splitlines() if line.startswith("mlxevict: error: rank 0 of 2")]
    assert len(errors) == 1, err.decode()[-3000:]
    if stopped == "terminated":
        assert "stopped by mlx.launch" in errors[0]
    assert "Traceback" not in err.decode()
    assert "rank 1 of 2: rank 1 of 2" not in err.decode()


BLOCKED_IN_MLX = """
import signal, sys
import mlx.core as mx
from mlxevict import launch
launch.watch_stops(grace=1.0)
x = mx.random.normal((1024, 1024)) / 32
for _ in range(int(sys.argv[1])):  # one graph: the main thread stays inside mx.eval until it is done
    x = mx.tanh(x @ x) + x
print("ready", flush=True)
try:
    mx.eval(x)
    print("finished", flush=True)
except launch.Stopped as e:  # the handler ran on the main thread: between bytecodes, not inside the eval
    print("handled by the main thread", flush=True)
    sys.exit(f"mlxevict: error: {e}")
"""


def test_a_sigterm_ends_a_rank_whose_main_thread_is_inside_mlx():
    """Python runs a signal handler between bytecodes only: a rank inside one long mx.eval (as one blocked
    on a peer that is gone) must still end on mlx.launch's SIGTERM, with the one line, not after the eval."""
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED_IN_MLX, "20000"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env())  # fmt: skip
    try:
        assert proc.stdout.readline() == b"ready\n"
        time.sleep(1.0)  # let it enter the eval (minutes long), so the signal comes while MLX holds the main thread
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        end(proc)
    assert proc.returncode == 1
    assert out == b"" and b"Traceback" not in err  # neither finished nor handled after the eval
    lines = err.decode().splitlines()
    assert lines == ["mlxevict: error: this rank was stopped by mlx.launch because another rank exited "
                     "(its error, or mlx.launch's warning, names it)"], err.decode()[-2000:]  # fmt: skip


ENDING_WHILE_TERMINATED = """
import os, signal, sys, time
from mlxevict import errors, launch
launch.watch_stops(grace=1.0)
if sys.argv[1] == "lost peer":
    launch.stopping()  # as the CLI does on the ring's error, before its line
    os.kill(os.getpid(), signal.SIGTERM)  # mlx.launch's SIGTERM lands before the line is out
else:
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    except errors.Stopped as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM while it unwinds
        time.sleep(0.5)
        errors.say_error(str(stop))
        sys.exit(1)
time.sleep(0.5)
errors.say_error("rank 0 of 2 lost the connection to another rank")
sys.exit(1)
"""


@pytest.mark.parametrize("path", ["lost peer", "handler"])
def test_a_sigterm_while_a_rank_ends_lets_its_one_line_out(path):
    """A rank that is ending (it met a lost peer, or ran the SIGTERM handler) says its own line
    once, whatever SIGTERMs come meanwhile: one killed it silently with -15 in a CI run."""
    environ = env() | {"MLX_RANK": "0"}  # a rank as mlx.launch starts it: its error line is its last word
    done = subprocess.run([sys.executable, "-c", ENDING_WHILE_TERMINATED, path], capture_output=True,
                          env=environ, timeout=HANG_GUARD_S)  # fmt: skip
    said = "lost the connection" if path == "lost peer" else "stopped by mlx.launch"
    lines = done.stderr.decode().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and said in lines[0], done.stderr.decode()[-2000:]


def test_info_plans_a_model_over_hosts(tiny, capsys):
    from mlxevict.cli import main

    assert main(["info", str(tiny), "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["hosts"] is None
    assert main(["info", str(tiny), "--hosts", "2", "--memory", "16GB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["hosts"]
    assert plan["hosts"] == 2 and plan["shardable"] and plan["min_hosts"] == 1
    assert plan["kv_bytes_per_token"] * 2 == alone["kv_bytes_per_token"]
    assert plan["weights_per_host"] < alone["weights_nbytes"]
    assert main(["info", str(tiny), "--hosts", "3", "--memory", "16GB"]) == 0
    assert "do not split over 3 ranks" in capsys.readouterr().out
    assert main(["info", str(tiny), "--memory", "16GB"]) == 1
    assert "--memory needs --hosts" in capsys.readouterr().err
    assert main(["info", str(tiny), "--hosts", "2", "--pipeline"]) == 1  # llama: mlx-lm has no pipeline for it
    assert "no pipeline parallelism for llama" in capsys.readouterr().err


def test_plan_hosts_splits_the_sharded_weights_and_keeps_the_embedding_on_each():
    config = dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        num_hidden_layers=2, vocab_size=100, tie_word_embeddings=False,
    )
    # Per layer: q,o 2*64*64, k,v 2*64*32, MLP 3*64*128; replicated: 2*100*64 embeddings + 5*64 norms.
    per_layer, replicated = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128, 2 * 100 * 64 + 5 * 64
    assert replicated_fraction(config) == pytest.approx(replicated / (replicated + 2 * per_layer))
    weights = 4 * (replicated + 2 * per_layer)
    plan = plan_hosts(config, weights, 1024, hosts=2, memory=10**6, margin=1000)
    assert isinstance(plan, HostPlan) and plan.shardable
    assert plan.weights_per_host == 4 * replicated + 4 * per_layer
    assert plan.kv_bytes_per_token == 512 and plan.full_tokens == (10**6 - plan.weights_per_host - 1000) // 512
    assert plan_hosts(config, weights, 1024, hosts=3, memory=10**6, margin=0).shardable is False
    # Too small for the weights on one host, enough on two.
    small = plan_hosts(config, weights, 1024, hosts=1, memory=weights - 2 * per_layer, margin=0)
    assert small.min_hosts == 2 and small.kv_memory == 0


def test_plan_hosts_with_a_pipeline_takes_the_largest_block_of_layers():
    config = dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        num_hidden_layers=3, vocab_size=100, tie_word_embeddings=False,
    )
    per_layer, replicated = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128, 2 * 100 * 64 + 7 * 64
    weights = 4 * (replicated + 3 * per_layer)
    # 3 layers over 2 hosts: blocks of 2 and 1 (mlx-lm's split); the block of 2 sets the numbers.
    plan = plan_hosts(config, weights, 3000, hosts=2, memory=10**6, margin=0, pipeline=True)
    assert plan.shardable and plan.weights_per_host == 4 * replicated + 4 * 2 * per_layer
    assert plan.kv_bytes_per_token == 2000
    # 3 hosts: a layer each, though the 2 KV heads do not split 3 ways.
    assert plan_hosts(config, weights, 3000, hosts=3, memory=10**6, margin=0, pipeline=True).shardable
    too_many = plan_hosts(config, weights, 3000, hosts=4, memory=10**6, margin=0, pipeline=True)
    assert not too_many.shardable and "3 layers, fewer than 4 ranks" in too_many.reason
    # Too small for all layers on one host; a block of 2 of the 3 fits.
    small = plan_hosts(config, weights, 3000, hosts=1, memory=4 * replicated + 4 * 2 * per_layer + 1, margin=0,
                       pipeline=True)
    assert small.min_hosts == 2


def test_shards_that_do_not_divide_the_heads_are_refused_naming_the_counts_that_do():
    config = dict(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    check_shardable(config, 3)
    with pytest.raises(ValueError, match="3 KV heads, which do not split over 2 ranks; run mlx.launch with -n 1 or 3"):
        check_shardable(config, 2)


def test_random_draws_on_a_rank_are_its_block_of_the_single_process_draws():
    import mlx.core as mx

    from mlxevict.cache import EvictingKVCache

    def scores(shard: Shard, heads: int) -> mx.array:
        cache = EvictingKVCache("random", 16, window=2)
        cache.shard = shard
        cache.model_patched = True  # driven here without a model
        keys = mx.zeros((1, heads, 3, 8))
        cache.update_and_fetch(keys, keys)
        return cache.policy.score(cache)

    alone = scores(Shard(), 4)
    for rank in range(2):
        assert mx.array_equal(scores(Shard(rank, 2), 2), alone[:, 2 * rank : 2 * rank + 2])
    assert not mx.array_equal(alone[:, :2], alone[:, 2:])
