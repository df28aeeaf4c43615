"""The HTTP side: the standard library's ``ThreadingHTTPServer``, as mlx-lm's server uses.

Each connection gets a thread that reads and checks the request, hands it to
the :class:`~mlxevict.server.engine.Engine` and writes what comes back, as one
JSON object or as server-sent events. While it waits it watches the socket: a
client that hung up cancels its request (generation stops, the cache is freed).
"""

from __future__ import annotations

import hmac
import json
import queue
import select
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional
from uuid import uuid4

from .. import __version__
from .engine import Done, Engine, Job, Piece
from .protocol import ApiError, CompletionRequest, Defaults, Reply, parse_body, parse_request

ROUTES = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/completions": "text"}
MAX_BODY = 32 * 1024 * 1024  # bytes: a long conversation is a few MB of JSON
POLL_S = 0.1  # seconds between looks at the client's socket while waiting


class ApiServer(ThreadingHTTPServer):
    """An OpenAI-compatible server in front of an :class:`Engine`.

    Args:
        address: ``(host, port)``; port 0 picks a free one (read ``server_address``).
        engine: runs the requests.
        defaults: the sampling defaults and limits requests are checked against.
        model_ids: the names the model answers to; the first is reported.
        api_key: when set, every request needs ``Authorization: Bearer <api_key>``.
        log: called with one line per HTTP request.
    """

    daemon_threads = True  # a client still reading must not keep Ctrl-C from ending the server
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], engine: Engine, *, defaults: Defaults, model_ids: tuple[str, ...],
                 api_key: Optional[str] = None, log: Callable[[str], None] = lambda line: None):
        host = address[0]
        self.address_family = socket.getaddrinfo(host, address[1], type=socket.SOCK_STREAM)[0][0]
        self.engine, self.defaults, self.model_ids = engine, defaults, model_ids
        self.api_key, self.log = api_key, log
        super().__init__(address, Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"

    def health(self) -> dict:
        engine = self.engine
        return {
            "status": "ok" if engine.alive else "unavailable",
            "model": self.model_ids[0],
            "policy": self.defaults.policy,
            "budget": self.defaults.budget,
            "busy": engine.busy,
            "queued": engine.queued,
            "conversations": len(engine.store),
            "conversation_kv_bytes": engine.store.nbytes,
            **engine.counts,
            "last": engine.last,
            **({"ranks": engine.ranks} if getattr(engine, "ranks", 1) > 1 else {}),
        }


class Handler(BaseHTTPRequestHandler):
    server: ApiServer
    server_version = f"mlxevict/{__version__}"

    # -- writing

    def _send_json(self, status: int, payload: dict, headers: Optional[dict] = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, err: ApiError, headers: Optional[dict] = None) -> None:
        self._send_json(err.status, err.body(), headers)

    def _send_event(self, payload: Any) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def log_message(self, format: str, *args: Any) -> None:
        self.server.log(f"{self.address_string()} {format % args}")

    # -- reading

    def _authorized(self) -> bool:
        key = self.server.api_key
        if not key:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return True
        err = ApiError("missing or wrong API key: send the header Authorization: Bearer KEY", status=401,
                       code="invalid_api_key")
        self._send_error(err, {"WWW-Authenticate": "Bearer"})
        return False

    def _body(self) -> dict:
        length = self.headers.get("Content-Length")
        try:
            size = int(length)
        except (TypeError, ValueError):
            raise ApiError(f"Content-Length {length!r} is not a number of bytes; send the JSON body with its length")
        if not 0 <= size <= MAX_BODY:
            raise ApiError(f"the body is {size} bytes; at most {MAX_BODY} are read", status=413)
        return parse_body(self.rfile.read(size))

    def _client_gone(self) -> bool:
        """Whether the client closed its side (a readable socket with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _next(self, job: Job) -> Any:
        """The job's next event; ``None`` once the client is gone (the job is then cancelled)."""
        while True:
            if self._client_gone():
                job.cancel()
                return None
            try:
                return job.events.get(timeout=POLL_S)
            except queue.Empty:
                if not self.server.engine.alive:
                    return ApiError("the server is shutting down", status=503)

    # -- routes

    def do_GET(self) -> None:
        if not self._authorized():
            return
        path = self.path.split("?")[0].rstrip("/")
        ids = self.server.model_ids
        model = {"id": ids[0], "object": "model", "created": 0, "owned_by": "mlxevict"}
        if path == "/health":
            self._send_json(200, self.server.health())
        elif path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [model]})
        elif path.startswith("/v1/models/") and path[len("/v1/models/") :] in ids:
            self._send_json(200, model)
        elif path in ROUTES:
            self._send_error(ApiError(f"{path} takes POST", status=405))
        else:
            self._send_error(ApiError(f"no route {path}; see GET /v1/models", status=404, code="not_found"))

    def do_POST(self) -> None:
        try:
            body = self._body()
            if not self._authorized():
                return
            path = self.path.split("?")[0].rstrip("/")
            if path not in ROUTES:
                raise ApiError(f"no route {path}; POST /v1/chat/completions or /v1/completions", status=404,
                               code="not_found")
            request = parse_request(ROUTES[path], body, self.server.defaults, self.server.model_ids)
            job = self.server.engine.submit(request)
        except ApiError as err:
            self._send_error(err)
            return
        try:
            self._respond(job, request)
        except (BrokenPipeError, ConnectionResetError):
            job.cancel()
        except Exception as err:  # one broken request must not leave its client hanging
            job.cancel()
            self.server.log(f"error: {type(err).__name__}: {err}")
            self._send_error(ApiError(f"{type(err).__name__}: {err}", status=500))

    def _respond(self, job: Job, request: CompletionRequest) -> None:
        first = self._next(job)
        if first is None:
            return
        if isinstance(first, ApiError):
            self._send_error(first)
            return
        # The engine sends STARTED (or an error) first, once the prompt was accepted.
        reply = Reply(request, f"{'chatcmpl' if request.kind == 'chat' else 'cmpl'}-{uuid4().hex}")
        (self._stream if request.stream else self._whole)(job, reply)

    def _whole(self, job: Job, reply: Reply) -> None:
        parts: dict[str, list[str]] = {"reasoning": [], "answer": []}
        while (item := self._next(job)) is not None:
            if isinstance(item, Piece):
                parts[item.kind].append(item.text)
            elif isinstance(item, Done):
                text = {kind: "".join(pieces) for kind, pieces in parts.items()}
                self._send_json(200, reply.response(text["reasoning"], text["answer"], item.finish_reason, item.usage))
                return
            elif isinstance(item, ApiError):
                self._send_error(item)
                return

    def _stream(self, job: Job, reply: Reply) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        self._send_event(reply.chunk(first=True))
        include_usage = job.request.include_usage
        while (item := self._next(job)) is not None:
            if isinstance(item, Piece):
                self._send_event(reply.chunk(item.kind, item.text))
                continue
            if isinstance(item, Done):
                self._send_event(reply.chunk(finish_reason=item.finish_reason,
                                             usage=None if include_usage else item.usage))
                if include_usage:
                    self._send_event(reply.usage_chunk(item.usage))
            elif isinstance(item, ApiError):
                self._send_event(item.body())
            self._send_event("[DONE]")
            return
