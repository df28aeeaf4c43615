"""Long-context tasks on natural prose: facts hidden inside the streamed text, asked at the end.

Each row is exactly ``length`` tokens: a short instruction, then prose from
:mod:`.prose` with fact sentences inserted at sentence ends at spread depths, then the
question and its answer (teacher-forced). Nothing but the first few tokens could be
pinned as a prompt: the facts arrive as a long context or a chain of thought grows.

Kinds (one row each per length and instance):

- ``passkey``: one 5-digit pass key at one depth (depths cycle over :data:`DEPTHS`);
- ``passkeys``: three pass keys (red, blue, green door) at spread depths, all asked;
- ``keyvalue``: four word codes at spread depths, two asked;
- ``reasoning``: the user's document, then the assistant's reasoning (teacher-forced
  generated text) which states a result code; a new user turn asks for it.

Fidelity rows are plain prose of the same half, scored over their last tokens. Recall rows
(:func:`make_recall_texts`) are prose whose scored tail restates, token for token, a passage
1-2k tokens back, as a chain of thought goes back over its own earlier steps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from . import prose
from .tasks import KV_WORDS, PASSKEY_DIGITS, _assistant_open, _user_open, encode, next_turn, reasoning_text

KINDS = ("passkey", "passkeys", "keyvalue", "reasoning")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
DOORS = ("red", "blue", "green")
FIRST_FACT_AFTER = 80  # tokens: facts come after the first streamed chunk (which a policy may pin)
RECALL_CUE = "\n\nLet me go back and restate an earlier passage word for word:\n\n"
RECALL_FROM = (0.1, 0.3)  # where the restated passage starts, as a share of the text (cycled over the texts)
INSTRUCTION = "Read the text below carefully. I will ask you about details in it afterwards.\n\n"


@dataclass(frozen=True)
class LongRow:
    """One long retrieval row: ``tokens``, and the absolute ``(start, end)`` span of each scored answer."""

    kind: str
    tokens: list[int]
    answers: list[tuple[int, int]]
    question_start: int
    facts: dict[str, str] = field(default_factory=dict)
    depths: list[float] = field(default_factory=list)  # where each fact starts, as a share of the row

    def correct(self, predicted: list[int]) -> list[bool]:
        """Per answer: was every answer token the greedy prediction of the position before it?"""
        return [all(predicted[p - 1] == self.tokens[p] for p in range(a, b)) for a, b in self.answers]


def _code(rng: random.Random) -> str:
    return str(rng.randint(10 ** (PASSKEY_DIGITS - 1), 10**PASSKEY_DIGITS - 1))


def _sentence_ends(tokenizer: Any, tokens: list[int]) -> list[int]:
    """Indices ``i`` such that ``tokens[i - 1]`` ends a sentence (a fact may go before ``tokens[i]``)."""
    return [i for i in range(1, len(tokens)) if tokenizer.decode([tokens[i - 1]]).rstrip().endswith((".", "\n"))]


def _insert(tokenizer: Any, filler: list[int], facts: list[list[int]], depths: list[float], room: int) -> list[int]:
    """``room`` tokens: ``filler`` with each fact inserted at the first sentence end past its depth."""
    ends = _sentence_ends(tokenizer, filler)
    out, cursor = [], 0
    for j, (fact, depth) in enumerate(zip(facts, depths)):
        target = max(FIRST_FACT_AFTER, int(depth * room))
        cut = next((e for e in ends if e >= cursor and len(out) + e - cursor >= target), None)
        if cut is None:
            raise ValueError(f"the prose ran out before depth {depth:g} of {room} tokens; use a longer text")
        if len(out) + cut - cursor + sum(map(len, facts[j:])) > room:
            # A long last sentence: the sentence end before the target, else the target itself.
            exact = cursor + target - len(out)
            cut = max((e for e in ends if cursor < e <= exact), default=exact)
        out += filler[cursor:cut] + fact
        cursor = cut
    rest = room - len(out)
    if rest < 0 or cursor + rest > len(filler):
        raise ValueError(f"{room} tokens cannot hold these facts at these depths; raise the context")
    return out + filler[cursor : cursor + rest]


def _question(tokenizer: Any, kind: str, facts: dict[str, str], asked: list[str]) -> tuple[list[int], list[tuple[int, int]]]:
    """The question tokens and each answer's ``(start, end)`` inside them."""
    tokens: list[int] = []
    spans = []
    for j, name in enumerate(asked):
        if kind == "reasoning":
            text = next_turn(tokenizer, "What result code did you write down while thinking?", "The result code I wrote down is")
        elif j == 0:
            what = {
                "passkey": "What is the pass key?",
                "passkeys": "What are the pass keys of the red, blue and green doors?",
                "keyvalue": f"What are the codes for {' and '.join(asked)}?",
            }[kind]
            text = f"\n\nNow answer from the text. {what}{_assistant_open(tokenizer)}{_label(kind, name)} is"
        else:
            text = f". {_label(kind, name)} is"
        tokens += encode(tokenizer, text)
        start = len(tokens)
        tokens += encode(tokenizer, " " + facts[name])
        spans.append((start, len(tokens)))
    return tokens, spans


def _label(kind: str, name: str) -> str:
    if kind == "passkey":
        return "The pass key"
    if kind == "passkeys":
        return f"The pass key of the {name} door"
    return f"The code for {name}"


def _facts(kind: str, rng: random.Random, index: int) -> tuple[dict[str, str], list[str], list[str], list[float]]:
    """``(facts, sentences in order, asked names, depths)`` of one row."""
    if kind == "passkey":
        facts = {"pass key": _code(rng)}
        sentences = [f"The pass key is {facts['pass key']}. Remember it."]
        return facts, sentences, ["pass key"], [DEPTHS[index % len(DEPTHS)]]
    if kind == "passkeys":
        facts = {door: _code(rng) for door in DOORS}
        sentences = [f"The pass key of the {d} door is {c}." for d, c in facts.items()]
        return facts, sentences, list(DOORS), [0.15, 0.5, 0.85]
    if kind == "keyvalue":
        words = rng.sample(KV_WORDS, 4)
        facts = {w: _code(rng) for w in words}
        sentences = [f"The code for {w} is {c}." for w, c in facts.items()]
        return facts, sentences, sorted(rng.sample(words, 2), key=words.index), [0.1, 0.35, 0.6, 0.85]
    facts = {"result": _code(rng)}
    sentences = [f"Let me write this down: the result code is {facts['result']}."]
    return facts, sentences, ["result"], [0.4 + 0.1 * (index % 4)]


def make_long_rows(tokenizer: Any, length: int, split: str, seed: int, kinds=KINDS, instances: int = 1) -> list[LongRow]:
    """Retrieval rows of exactly ``length`` tokens from the ``split`` half of the prose.

    Args:
        tokenizer: mlx-lm's tokenizer wrapper or :class:`~.tasks.ByteTokenizer`.
        length: tokens per row.
        split: ``"tuning"`` or ``"test"`` (:mod:`.prose`).
        seed: codes, depths and texts.
        kinds: which of :data:`KINDS`.
        instances: rows of each kind.

    Raises:
        ValueError: a length too short for the facts and the question.
    """
    rows = []
    header = encode(tokenizer, _user_open(tokenizer) + INSTRUCTION)
    for k, kind in enumerate(kinds):
        for i in range(instances):
            rng = random.Random(f"long-{split}-{seed}-{length}-{kind}-{i}")
            facts, sentences, asked, depths = _facts(kind, rng, i + seed + length // 1024)
            question, spans = _question(tokenizer, kind, facts, asked)
            room = length - len(header) - len(question)
            filler = encode(tokenizer, prose.stream(split, seed * 1000 + k * 10 + i, room * 8, first_source=i + k))
            fact_tokens = [encode(tokenizer, " " + s) for s in sentences]
            if kind == "reasoning":
                # The document takes the first third; then the assistant's reasoning carries the fact.
                turn = encode(tokenizer, _assistant_open(tokenizer) + "Let me think step by step.")
                doc = filler[: next(e for e in _sentence_ends(tokenizer, filler) if e >= room // 3)]
                thought = encode(tokenizer, " " + reasoning_text(rng, room // 4 + 8))
                filler = doc + turn + thought
            body = _insert(tokenizer, filler, fact_tokens, depths, room)
            base = len(header) + len(body)
            tokens = header + body + question
            starts = [_find(tokens, f) for f in fact_tokens]
            rows.append(
                LongRow(kind, tokens, [(base + a, base + b) for a, b in spans], base, facts, [s / length for s in starts])
            )
    return rows


def _find(tokens: list[int], part: list[int]) -> int:
    n = len(part)
    return next(i for i in range(len(tokens) - n + 1) if tokens[i : i + n] == part)


def text_leads(n: int, split: str) -> list[str]:
    """The source leading each of ``n`` natural texts (:func:`make_long_texts`, :func:`make_recall_texts`):
    the sources in turn."""
    names = prose.sources(split)
    return [names[i % len(names)] for i in range(n)]


def _natural(tokenizer: Any, length: int, split: str, seed: int, first_source: int, lead: int | None = None) -> list[int]:
    """Exactly ``length`` tokens of :func:`.prose.stream`'s prose of ``split``."""
    tokens = encode(tokenizer, prose.stream(split, seed, length * 8, first_source=first_source, lead=lead))
    if len(tokens) < length:
        raise ValueError(f"natural text has {len(tokens)} tokens, fewer than the {length} needed")
    return tokens[:length]


def make_long_texts(tokenizer: Any, n: int, length: int, split: str, seed: int) -> list[list[int]]:
    """``n`` natural texts of exactly ``length`` tokens from ``split``, no two led by the same part.

    The sources take turns leading; the text after the lead part is seeded.
    """
    names = prose.sources(split)
    return [
        _natural(tokenizer, length, split, seed * 1000 + 500 + i, names.index(source), lead=i // len(names))
        for i, source in enumerate(text_leads(n, split))
    ]


def make_recall_texts(tokenizer: Any, n: int, length: int, scored: int, split: str, seed: int) -> tuple[list[list[int]], list[int]]:
    """``n`` texts of exactly ``length`` tokens whose last ``scored`` tokens restate an earlier passage.

    Each text is natural prose of ``split`` (the sources in turn, seeded apart from the fidelity
    texts), then :data:`RECALL_CUE`, then a copy of the ``scored`` prose tokens that start at the
    first sentence end past a share :data:`RECALL_FROM` of the text: at 2k tokens the passage
    restated is 1.1k-1.6k tokens back. Scored like fidelity, the tail asks whether the cache
    still holds what a long chain of thought goes back to.

    Returns:
        The texts, and the position where each restated passage starts.

    Raises:
        ValueError: ``length`` too short to hold a passage of ``scored`` tokens and its copy.
    """
    cue = encode(tokenizer, RECALL_CUE)
    room = length - scored - len(cue)
    names = prose.sources(split)
    texts, starts = [], []
    for i, source in enumerate(text_leads(n, split)):
        filler = _natural(tokenizer, room, split, seed * 1000 + 700 + i, names.index(source))
        depth = max(FIRST_FACT_AFTER, int(RECALL_FROM[i % len(RECALL_FROM)] * length))
        start = next((e for e in _sentence_ends(tokenizer, filler) if e >= depth), depth)
        if start + scored > room:
            raise ValueError(f"{length} tokens cannot hold a {scored}-token passage and its restatement; raise the length")
        texts.append(filler + cue + filler[start : start + scored])
        starts.append(start)
    return texts, starts
