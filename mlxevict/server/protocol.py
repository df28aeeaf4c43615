"""The OpenAI wire format: request bodies read and checked, responses and stream chunks written.

Nothing here touches the model: :func:`parse_request` turns a JSON body into a
:class:`CompletionRequest` or raises :class:`ApiError` (an OpenAI-style error
body with its HTTP status), and the ``*_response``/``*_chunk`` functions build
the JSON objects the OpenAI clients read. Reasoning goes in
``reasoning_content`` beside ``content``, as DeepSeek's API does.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

Kind = Literal["chat", "text"]
ROLES = ("system", "user", "assistant")


class ApiError(Exception):
    """An error the client caused (4xx) or the server hit (5xx), sent as OpenAI's error body.

    Args:
        status: the HTTP status, 400 unless told.
        message: one line naming the bad value and the fix.
        param: the request field at fault, if any.
        code: a machine-readable code (``"invalid_api_key"``, ``"model_not_found"``...).
        type: OpenAI's error type; ``invalid_request_error`` for 4xx, ``server_error`` for 5xx.
    """

    def __init__(self, message: str, *, status: int = 400, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Defaults:
    """The server's sampling defaults and the limits a request may not pass.

    Attributes:
        max_tokens, temperature, top_p: used when a request leaves them out.
        top_k, min_p: 0 turns them off (the default).
        policy: the eviction policy a request gets unless it names another.
        budget: the server's budget in tokens: the default, and the most a request may ask.
    """

    max_tokens: int
    temperature: float
    top_p: float
    policy: str
    budget: int
    top_k: int = 0
    min_p: float = 0.0


@dataclass(frozen=True)
class CompletionRequest:
    """One checked request. ``messages`` for chat (``role``/``content`` text), ``prompt`` for text."""

    kind: Kind
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: Optional[int]
    stop: tuple[str, ...]
    logit_bias: dict[int, float] = field(default_factory=dict)
    messages: tuple[dict, ...] = ()
    prompt: str = ""
    budget: Optional[str] = None  # as written; the engine resolves it against the model
    policy: str = ""


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body.

    Raises:
        ApiError: not UTF-8 JSON, or not an object.
    """
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ApiError(f"the request body is not valid JSON ({err}); send a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body is a JSON {type(body).__name__}, not an object; send a JSON object")
    return body


def _number(body: dict, name: str, default: Any, *, kind: type = float, low: float = 0, high: Optional[float] = None):
    """``body[name]`` (or ``default`` when absent or null), checked for type and range."""
    value = body.get(name)
    if value is None:
        return default
    types = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, types):
        raise ApiError(f"{name} must be {'an integer' if kind is int else 'a number'}, not {value!r}", param=name)
    if value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ApiError(f"{name}={value!r} must be {span}", param=name)
    return kind(value)


def _content(message: Any, at: int) -> dict:
    """One message as ``{"role", "content"}`` with text content (parts of type text are joined)."""
    param = f"messages[{at}]"
    if not isinstance(message, dict):
        raise ApiError(f"{param} must be an object with role and content", param=param)
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise ApiError(f"{param}.role {role!r} is not supported; use one of: {', '.join(ROLES)}", param=param)
    if content is None:
        content = ""
    if isinstance(content, list):
        parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
        if any(not isinstance(p, str) for p in parts):
            raise ApiError(f"{param}.content: only text parts are supported", param=param)
        content = "".join(parts)
    if not isinstance(content, str):
        raise ApiError(f"{param}.content must be a string or a list of text parts", param=param)
    return {"role": role, "content": content}


def _messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {role, content} objects", param="messages")
    checked = tuple(_content(m, i) for i, m in enumerate(messages))
    if checked[-1]["role"] != "user":
        raise ApiError("the last message must be from the user (assistant prefill is not supported)", param="messages")
    return checked


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise ApiError("stop must be a string or a list of up to 4 non-empty strings", param="stop")
    return tuple(stops)


def _logit_bias(body: dict) -> dict[int, float]:
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    try:
        if not isinstance(bias, dict):
            raise ValueError
        return {int(k): float(v) for k, v in bias.items() if not isinstance(v, bool)}
    except (TypeError, ValueError):
        raise ApiError("logit_bias must map token ids to numbers, such as {\"2\": -100}", param="logit_bias") from None


def parse_request(kind: Kind, body: dict, defaults: Defaults, model_ids: tuple[str, ...]) -> CompletionRequest:
    """Check a completion body and fill in the server's defaults.

    Args:
        kind: ``"chat"`` (``/v1/chat/completions``) or ``"text"`` (``/v1/completions``).
        body: from :func:`parse_body`.
        defaults: the server's :class:`Defaults`.
        model_ids: the names this server answers to (the first is the one it reports).

    Raises:
        ApiError: a field of the wrong type or out of range, an unknown model, ``n`` other than 1.
    """
    model = body.get("model", model_ids[0])
    if not isinstance(model, str) or model not in model_ids:
        raise ApiError(
            f"model {model!r} is not served here; use {model_ids[0]!r} (GET /v1/models)", param="model",
            code="model_not_found",
        )
    for name in ("stream", "echo"):
        if not isinstance(body.get(name, False), bool):
            raise ApiError(f"{name} must be true or false, not {body[name]!r}", param=name)
    if _number(body, "n", 1, kind=int, low=1) != 1:
        raise ApiError("n must be 1: one answer per request", param="n")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError("stream_options must be an object such as {\"include_usage\": true}", param="stream_options")
    budget = body.get("budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, str))):
        raise ApiError(f"budget must be tokens (512) or KV memory (\"64MB\"), not {budget!r}", param="budget")
    policy = body.get("policy", defaults.policy)
    if not isinstance(policy, str):
        raise ApiError(f"policy must be a policy name, not {policy!r}", param="policy")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    common = dict(
        kind=kind,
        model=model_ids[0],
        stream=body.get("stream", False),
        include_usage=bool(options.get("include_usage", False)),
        max_tokens=_number({"max_tokens": max_tokens}, "max_tokens", defaults.max_tokens, kind=int, low=1),
        temperature=_number(body, "temperature", defaults.temperature, high=2),
        top_p=_number(body, "top_p", defaults.top_p, high=1),
        top_k=_number(body, "top_k", defaults.top_k, kind=int),
        min_p=_number(body, "min_p", defaults.min_p, high=1),
        seed=_number(body, "seed", None, kind=int, low=-(2**63)),
        stop=_stop(body),
        logit_bias=_logit_bias(body),
        budget=None if budget is None else str(budget),
        policy=policy,
    )
    if common["top_p"] == 0:
        raise ApiError("top_p=0 keeps no token; use a value in (0, 1]", param="top_p")
    if kind == "chat":
        return CompletionRequest(**common, messages=_messages(body))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ApiError("prompt must be a non-empty string", param="prompt")
    return CompletionRequest(**common, prompt=prompt)


@dataclass(frozen=True)
class Usage:
    """The numbers of one answer: OpenAI's ``usage``, and the cache's in ``usage.mlxevict``."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens already in a kept conversation's cache
    cache: dict  # policy, budget, kept, evicted, kv_bytes, kv_full_bytes, peak_memory, ...

    def json(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "mlxevict": {"prompt_tokens_read": self.prompt_tokens - self.cached_tokens, **self.cache},
        }


class Reply:
    """The ids and names one response shares across its JSON objects."""

    def __init__(self, request: CompletionRequest, request_id: str):
        self.request = request
        self.id = request_id
        self.created = int(time.time())
        chat = request.kind == "chat"
        self.object = ("chat.completion.chunk" if request.stream else "chat.completion") if chat else "text_completion"

    def _wrap(self, choices: list, usage: Optional[Usage] = None) -> dict:
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.request.model,
               "system_fingerprint": "mlxevict", "choices": choices}
        if usage is not None:
            out["usage"] = usage.json()
        return out

    def response(self, reasoning: str, answer: str, finish_reason: str, usage: Usage) -> dict:
        """The whole answer (``stream: false``)."""
        if self.request.kind == "chat":
            message = {"role": "assistant", "content": answer, "reasoning_content": reasoning or None}
            choice = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": answer, "reasoning_content": reasoning or None,
                      "finish_reason": finish_reason, "logprobs": None}
        return self._wrap([choice], usage)

    def chunk(self, kind: str = "", text: str = "", finish_reason: Optional[str] = None,
              usage: Optional[Usage] = None, first: bool = False) -> dict:
        """One server-sent event: a piece of reasoning or answer, or the closing one with the reason."""
        if self.request.kind == "chat":
            delta: dict = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["reasoning_content" if kind == "reasoning" else "content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text if kind != "reasoning" else "", "finish_reason": finish_reason,
                      "logprobs": None}
            if kind == "reasoning":
                choice["reasoning_content"] = text
        return self._wrap([choice], usage)

    def usage_chunk(self, usage: Usage) -> dict:
        """``stream_options.include_usage``: the last event, no choices."""
        return self._wrap([], usage)
