"""Run every listed policy greedily on one model, alone or as one rank of ``mlx.launch``; rank 0 writes JSON.

Used by tests/test_distributed.py: ``python distributed_worker.py MODEL OUT.json BUDGET TOKENS N SPEC...``
where a SPEC is a policy name or ``policy:kv_bits`` (``5,3``). For each spec the output holds the greedy
tokens and, rank by rank, the KV bytes, the most entries any layer held after any token, the evictions,
a checksum of the tokens that rank decoded and one of the positions its caches kept. Run alone, the
rows are the ``N`` blocks of KV heads that ``N`` ranks would hold (``N`` is ignored under mlx.launch).
"""

from __future__ import annotations

import json
import sys
import zlib

import mlx.core as mx

from mlxevict import make_cache
from mlxevict.distributed import gather_values, world
from mlxevict.events import TextChunk
from mlxevict.generate import stream_events
from mlxevict.launch import load_sharded
from mlxevict.resolve import load_model, resolve_model

PROMPT = "Let me think step by step about the capital of France, then write the answer down."


def kept_positions_crc(caches, block: int, blocks: int) -> int:
    """Checksum of the positions every layer keeps for KV-head block ``block`` of ``blocks``."""
    crc = 0
    for cache in caches:
        positions = cache.positions  # B, H, C
        H = positions.shape[1] // blocks
        crc = zlib.crc32(json.dumps(positions[:, block * H : (block + 1) * H].tolist()).encode(), crc)
    return crc


def run(model, tokenizer, spec: str, budget: int, tokens: int, blocks: int) -> tuple[list[int], list[list[int]]]:
    policy, _, bits = spec.partition(":")
    storage = {}
    if bits:
        parsed = tuple(int(b) for b in bits.split(","))
        storage = {"kv_bits": parsed[0] if len(parsed) == 1 else parsed, "kv_group_size": 32}
    caches = make_cache(model, policy, budget, **storage)
    most = 0
    finished = None
    for event in stream_events(model, tokenizer, PROMPT, caches=caches, max_tokens=tokens, temp=0.0):
        if isinstance(event, TextChunk):
            most = max(most, *(c.size() for c in caches))
        finished = event
    most = max(most, *(c.size() for c in caches))
    generated = list(finished.tokens)
    evictions = sum(c.evictions for c in caches)
    nbytes = sum(c.nbytes for c in caches)
    checksum = zlib.crc32(json.dumps(generated).encode())
    # Alone: one row per block of heads a rank would hold (bytes split evenly); a rank: its own block.
    rows = [[nbytes // blocks, most, evictions, checksum, kept_positions_crc(caches, b, blocks)] for b in range(blocks)]
    return generated, rows


def main() -> None:
    model_path, out, budget, tokens, blocks, *specs = sys.argv[1:]
    group = world()
    blocks = 1 if group is not None else int(blocks)
    resolved = resolve_model(model_path)
    model, tokenizer = load_model(resolved) if group is None else load_sharded(resolved, group)
    result = {"ranks": 1 if group is None else group.size(), "policies": {}}
    for spec in specs:
        generated, mine = run(model, tokenizer, spec, int(budget), int(tokens), blocks)
        rows = mine if group is None else gather_values(mine[0], group)
        keys = ("kv_nbytes", "most_entries", "evictions", "tokens_crc", "positions_crc")
        result["policies"][spec] = {"tokens": generated, "ranks": [dict(zip(keys, row)) for row in rows]}
        mx.clear_cache()
    if group is None or group.rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
