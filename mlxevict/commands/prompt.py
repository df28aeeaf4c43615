"""The prompt's tokens from the flags, as mlx_lm.generate and mlx_lm.cache_prompt build them.

``--system-prompt`` and ``--chat-template-args`` go into the chat template;
``--ignore-chat-template`` feeds the raw text. A prompt cache holds the start of
a user message (``cache-prompt`` renders it unclosed); a prompt that continues it
is the rest of that message and the assistant's header, as mlx-lm cuts it.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import MlxEvictError
from ..generate import encode_text

QUERY = "<query>"  # mlx-lm's marker for where a continued message starts


def uses_template(args: argparse.Namespace, tokenizer: Any) -> bool:
    """Whether the chat template applies; template-only flags without one are refused."""
    use = not args.ignore_chat_template and tokenizer.has_chat_template
    if not use:
        why = "--ignore-chat-template is set" if args.ignore_chat_template else "this model has no chat template"
        for flag, value in (("--system-prompt", args.system), ("--chat-template-args", args.chat_template_args)):
            if value is not None:
                raise MlxEvictError(f"{flag} needs the chat template, but {why}; drop {flag}")
    return use


def _messages(args: argparse.Namespace, text: str) -> list[dict[str, str]]:
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    return [*system, {"role": "user", "content": text}]


def _render(tokenizer: Any, messages: list, args: argparse.Namespace, **options: Any) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **options, **(args.chat_template_args or {}))
    except TypeError as err:  # an argument the template's renderer does not take
        raise MlxEvictError(f"--chat-template-args {args.chat_template_args}: {err}") from None


def prompt_ids(args: argparse.Namespace, tokenizer: Any, prompt: str, *, cached: bool = False) -> list[int]:
    """The tokens to feed for ``prompt``; with ``cached``, only what follows the saved prompt cache."""
    if not uses_template(args, tokenizer):
        return tokenizer.encode(prompt, add_special_tokens=not cached)
    text = _render(tokenizer, _messages(args, prompt), args, add_generation_prompt=True)
    if not cached:
        return encode_text(tokenizer, text)
    probe = _render(tokenizer, _messages(args, QUERY), args, add_generation_prompt=True)
    return tokenizer.encode(text[probe.index(QUERY) :], add_special_tokens=False)


def cache_prompt_ids(args: argparse.Namespace, tokenizer: Any, prompt: str) -> list[int]:
    """The tokens ``cache-prompt`` saves: the user message left open, as ``mlx_lm.cache_prompt`` renders it."""
    if not uses_template(args, tokenizer):
        return tokenizer.encode(prompt)
    text = _render(tokenizer, _messages(args, prompt), args, add_generation_prompt=False, continue_final_message=True)
    return encode_text(tokenizer, text)
