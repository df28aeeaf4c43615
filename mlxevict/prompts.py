"""Prompt and think text: a prompt as tokens under the chat template, and streamed text split at ``<think>``.

:func:`prompt_tokens` turns a user message, a message list or token ids into
tokens (and the rendered text, to see whether the template opened a think block);
:class:`ThinkSplitter` splits streamed text into reasoning and answer.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .errors import MlxEvictError
from .events import TextKind

THINK_START, THINK_END = "<think>", "</think>"
_TAIL_TOKENS = 64  # prompt tokens decoded to see whether the template opened a think block

Messages = Sequence[dict]
Prompt = Union[str, Messages, Sequence[int], mx.array]


class ThinkSplitter:
    """Splits streamed text into reasoning and answer at the think tags.

    Text arrives in arbitrary pieces, so a tag split across pieces (``"</thi"``
    + ``"nk>"``) is held back until it is complete. Tags are dropped, and so is
    the whitespace right after a tag.

    Args:
        in_reasoning: the prompt ended inside an open think block.
        start, end: the tags. Default ``<think>`` and ``</think>``.
    """

    def __init__(self, in_reasoning: bool = False, start: str = THINK_START, end: str = THINK_END):
        self.kind: TextKind = "reasoning" if in_reasoning else "answer"
        self.start, self.end = start, end
        self._pending = ""
        self._strip = in_reasoning

    def feed(self, text: str) -> list[tuple[TextKind, str]]:
        """Pieces ``(kind, text)`` ready to show; part of a tag may stay pending."""
        out: list[tuple[TextKind, str]] = []
        buffer = self._pending + text
        while True:
            tag = self.end if self.kind == "reasoning" else self.start
            at = buffer.find(tag)
            if at < 0:
                break
            self._emit(out, buffer[:at])
            self.kind = "answer" if self.kind == "reasoning" else "reasoning"
            self._strip = True
            buffer = buffer[at + len(tag) :]
        keep = next((k for k in range(min(len(tag) - 1, len(buffer)), 0, -1) if tag.startswith(buffer[-k:])), 0)
        self._emit(out, buffer[: len(buffer) - keep])
        self._pending = buffer[len(buffer) - keep :]
        return out

    def flush(self) -> list[tuple[TextKind, str]]:
        """Whatever is pending (a partial tag that never completed is text)."""
        out: list[tuple[TextKind, str]] = []
        self._emit(out, self._pending)
        self._pending = ""
        return out

    def _emit(self, out: list, text: str) -> None:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        if text:
            out.append((self.kind, text))


def opens_think(text: str, start: str = THINK_START, end: str = THINK_END) -> bool:
    """Whether ``text`` (a rendered prompt) ends inside an open think block."""
    return text.rfind(start) > text.rfind(end)


def as_wrapper(tokenizer: Any) -> TokenizerWrapper:
    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def encode_text(tokenizer: TokenizerWrapper, text: str) -> list[int]:
    """Tokens of a rendered prompt; BOS is added only when the text does not start with it."""
    bos = tokenizer.bos_token
    return tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos))


def render(tokenizer: TokenizerWrapper, messages: Messages, *, add_generation_prompt: bool = True) -> str:
    """The chat template applied to ``messages``, as text."""
    if not tokenizer.has_chat_template:
        raise MlxEvictError("this model has no chat template; pass the prompt as plain text instead of messages")
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False)


def prompt_tokens(tokenizer: TokenizerWrapper, prompt: Prompt, *, chat_template: bool = True) -> tuple[list[int], str]:
    """``(tokens, text)`` of a prompt: a user message, a message list, or token ids.

    A string becomes one user message under the chat template (when the model
    has one and ``chat_template``); ``text`` is the rendered prompt (for token
    ids, the decoded tail), used to see whether the template opened ``<think>``.

    Raises:
        MlxEvictError: the prompt is empty.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise MlxEvictError("empty prompt: give some text with -p or on stdin")
        text = prompt
        if chat_template and tokenizer.has_chat_template:
            text = render(tokenizer, [{"role": "user", "content": prompt}])
        return encode_text(tokenizer, text), text
    if isinstance(prompt, mx.array):
        prompt = prompt.tolist()
    prompt = list(prompt)
    if prompt and isinstance(prompt[0], dict):
        if not any(str(m.get("content", "")).strip() for m in prompt):
            raise MlxEvictError("empty prompt: every message is empty")
        text = render(tokenizer, prompt)
        return encode_text(tokenizer, text), text
    if not prompt:
        raise MlxEvictError("empty prompt: no tokens")
    tokens = [int(t) for t in prompt]
    return tokens, tokenizer.decode(tokens[-_TAIL_TOKENS:])
