"""Seeded, deterministic tasks for the evaluation, built at the token level.

Every instance of a task has exactly the same number of tokens, so instances run
as one batch and every cache sees the same shapes. Three families:

- retrieval after reasoning: a fact early in the prompt (a pass key, or several
  key–value codes), then a long stretch of reasoning-like text that the harness
  feeds in decode-sized steps (as a chain of thought grows), then the question;
  the answer is scored token by token under teacher forcing;
- fidelity: a long natural English text (Python's own documentation, shipped with
  every Python as ``pydoc_data.topics``), teacher-forced;
- generation: reasoning-style prompts that the model answers greedily.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

PASSKEY_DIGITS = 5
KV_FACTS = 4  # codes stated per key–value instance
KV_QUESTIONS = 2  # of which this many are asked
KV_WORDS = (
    "apple", "river", "lamp", "garden", "violin", "harbor", "pencil", "meadow",
    "candle", "bridge", "falcon", "marble", "orchid", "canyon", "saddle", "lantern",
)  # fmt: skip
NAMES = ("Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivo", "Jun")
ITEMS = ("apples", "coins", "books", "marbles", "stamps", "shells", "cards", "pens")


class Tokenizer(Protocol):
    """What the tasks need: mlx-lm's ``TokenizerWrapper`` or :class:`ByteTokenizer`."""

    eos_token_ids: set[int]

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class RetrievalTask:
    """One retrieval instance; every span is a list of token ids.

    ``prompt`` (the user turn with the fact) is prefilled, ``reasoning`` is fed in
    decode-sized steps, then ``question`` and ``answers`` go in as one chunk.
    ``answers`` holds ``(start, end)`` offsets into ``question`` of each scored answer.
    """

    kind: str
    prompt: list[int]
    reasoning: list[int]
    question: list[int]
    answers: list[tuple[int, int]]
    facts: dict[str, str] = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.reasoning + self.question

    def answer_positions(self) -> list[list[int]]:
        """Absolute positions of each answer's tokens in :attr:`tokens`."""
        base = len(self.prompt) + len(self.reasoning)
        return [list(range(base + a, base + b)) for a, b in self.answers]


@dataclass(frozen=True)
class GenerationTask:
    """A reasoning-style prompt of a fixed token length, answered greedily."""

    prompt: list[int]
    question: str


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256 + EOS); for random-weight test models."""

    eos_token_ids = {256}
    vocab_size = 257

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def chat(tokenizer: Any, user: str, assistant_prefix: str = "") -> str:
    """The chat-formatted text of one user turn, opening the assistant's reply."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
        )
    else:
        text = f"User: {user}\nAssistant: "
    return text + assistant_prefix


def next_turn(tokenizer: Any, user: str, assistant_prefix: str) -> str:
    """Close the assistant's turn and open a new user turn and reply (ChatML or plain)."""
    if getattr(tokenizer, "chat_template", None):
        return f"<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant_prefix}"
    return f"\nUser: {user}\nAssistant: {assistant_prefix}"


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def reasoning_text(rng: random.Random, n_sentences: int) -> str:
    """Chain-of-thought-like filler: small sums, checks and hesitations (no 5-digit numbers)."""
    total = rng.randint(1, 20)
    out = ["Let me think about this step by step."]
    for step in range(1, n_sentences + 1):
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        who, item = rng.choice(NAMES), rng.choice(ITEMS)
        kind = rng.randrange(6)
        if kind == 0:
            total += a
            out.append(f"Step {step}: {who} adds {a} {item}, so the running total is {total}.")
        elif kind == 1:
            out.append(f"Wait, let me check: {a} plus {b} is {a + b}, and {a + b} minus {b} is {a}. Good.")
        elif kind == 2:
            out.append(f"Hmm, {who} has {a} {item} and gives {min(a, b)} away, leaving {a - min(a, b)}.")
        elif kind == 3:
            out.append(f"So far this is consistent, but I should double-check the {item}.")
        elif kind == 4:
            out.append(f"Next, {a} times {b % 10} equals {a * (b % 10)}.")
        else:
            out.append(f"Alternatively, maybe {who} counted the {item} twice; no, {a} is right.")
    return " ".join(out)


def _fit(tokens: list[int], length: int, what: str) -> list[int]:
    if len(tokens) < length:
        raise ValueError(f"generated {what} has {len(tokens)} tokens, fewer than the {length} needed")
    return tokens[:length]


def _reasoning_tokens(tokenizer: Any, rng: random.Random, length: int) -> list[int]:
    # ~12 tokens a sentence; generate generously, then cut to the exact length.
    text = reasoning_text(rng, length // 4 + 8)
    return _fit(encode(tokenizer, " " + text), length, "reasoning")


def make_retrieval_tasks(tokenizer: Any, n: int, length: int, seed: int = 0) -> list[RetrievalTask]:
    """``n`` retrieval instances of exactly ``length`` tokens, alternating pass key and key–value.

    Raises:
        ValueError: ``length`` leaves no room for the reasoning stretch.
    """
    tasks = []
    for i in range(n):
        rng = random.Random(f"retrieval-{seed}-{i}")
        if i % 2 == 0:
            key = str(rng.randint(10 ** (PASSKEY_DIGITS - 1), 10**PASSKEY_DIGITS - 1))
            facts = {"pass key": key}
            user = (
                f"The pass key is {key}. Remember it: I will ask for the pass key after you think "
                "through a long problem. The pass key is " + key + "."
            )
            asked = ["pass key"]
            kind = "passkey"
        else:
            words = rng.sample(KV_WORDS, KV_FACTS)
            facts = {w: str(rng.randint(10 ** (PASSKEY_DIGITS - 1), 10**PASSKEY_DIGITS - 1)) for w in words}
            listed = " ".join(f"The code for {w} is {c}." for w, c in facts.items())
            user = f"Remember these codes: {listed} I will ask for some of them later."
            asked = rng.sample(words, KV_QUESTIONS)
            kind = "keyvalue"
        prompt = encode(tokenizer, chat(tokenizer, user, "Let me think."))
        question, answers = [], []
        for j, name in enumerate(asked):
            label = "the pass key" if name == "pass key" else f"the code for {name}"
            text = (
                next_turn(tokenizer, f"What is {label}?", f"{label[0].upper()}{label[1:]} is")
                if j == 0
                else f". And {label} is"
            )
            question += encode(tokenizer, text)
            start = len(question)
            question += encode(tokenizer, " " + facts[name])
            answers.append((start, len(question)))
        room = length - len(prompt) - len(question)
        if room < 16:
            raise ValueError(
                f"retrieval context of {length} tokens is too short: the fact and question take "
                f"{len(prompt) + len(question)}; raise --context"
            )
        reasoning = _reasoning_tokens(tokenizer, rng, room)
        tasks.append(RetrievalTask(kind, prompt, reasoning, question, answers, facts))
    return tasks


def natural_text(min_chars: int, seed: int = 0) -> str:
    """English prose from Python's documentation (ships with Python as ``pydoc_data``)."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    random.Random(f"natural-{seed}").shuffle(names)
    parts, size = [], 0
    for name in names:
        # Keep prose paragraphs; code samples and tables are indented.
        paras = [p.strip() for p in topics[name].split("\n\n") if p and not p.startswith((" ", "\t"))]
        text = " ".join(" ".join(p.split()) for p in paras if len(p) > 200)
        if text:
            parts.append(text)
            size += len(text)
        if size >= min_chars:
            break
    return "\n\n".join(parts)


def make_fidelity_texts(tokenizer: Any, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` different natural texts of exactly ``length`` tokens each."""
    return [
        _fit(encode(tokenizer, natural_text(length * 8, seed=seed * 1000 + i)), length, "natural text")
        for i in range(n)
    ]


def make_generation_tasks(tokenizer: Any, n: int, length: int, seed: int = 0) -> list[GenerationTask]:
    """``n`` word problems after notes of reasoning, each prompt exactly ``length`` tokens."""
    tasks = []
    for i in range(n):
        rng = random.Random(f"generation-{seed}-{i}")
        who, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b, c = rng.randint(10, 40), rng.randint(5, 30), rng.randint(2, 9)
        question = (
            f"{who} has {a} {item}, finds {b} more and then shares them equally among {c} friends. "
            f"How many {item} does each friend get, and how many are left over? Think step by step."
        )
        # The user turn is "notes" (reasoning filler, cut to fit) and then the problem.
        head = encode(tokenizer, _user_open(tokenizer) + "Here are my notes so far:")
        tail = encode(tokenizer, f"\n\nNow the problem. {question}") + encode(tokenizer, _assistant_open(tokenizer))
        room = length - len(head) - len(tail)
        if room < 8:
            raise ValueError(
                f"generation prompt of {length} tokens is too short (needs > {len(head) + len(tail) + 8}): "
                "raise --context"
            )
        notes = _reasoning_tokens(tokenizer, rng, room)
        tasks.append(GenerationTask(head + notes + tail, question))
    return tasks


def _user_open(tokenizer: Any) -> str:
    """The chat text before a user message (system prompt and user header)."""
    text = chat(tokenizer, "\x00")
    return text[: text.index("\x00")]


def _assistant_open(tokenizer: Any) -> str:
    """The chat text after a user message that opens the assistant's reply."""
    text = chat(tokenizer, "\x00")
    return text[text.index("\x00") + 1 :]
