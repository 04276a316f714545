"""What the server checks before a handler runs, at the ASGI and connection level.

`RequestGuard` (ASGI middleware, before routing and before any JSON parsing):
    401  an API key is set and the request lacks `Authorization: Bearer <key>` (`/health` stays open;
         the scheme's name in any case)
    415  a request with a body whose Content-Type is not application/json (so a web page cannot send
         a "simple" text/plain request to a server on localhost)
    413  a body over `max_request_bytes`: refused from Content-Length before reading, or as soon as
         a chunked body passes the limit
    408  a body that takes longer than `read_timeout_s` to arrive
It reads the whole body (bounded), then hands it to the app; later `receive()` calls reach the
client's connection, so a disconnect is still seen.

`read_timeout_protocol(timeout_s)`: uvicorn's h11 protocol, closing a connection whose request
headers take longer than `timeout_s` (from the connection's start, or from the previous response),
and answering a request that is not valid HTTP/1.1 with the OpenAI error body (400, then close).

`DrainingServer`: uvicorn's server with moetide's shutdown (drain, then abort; a second signal exits).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_READ_TIMEOUT_S, is_loopback  # noqa: F401 - re-exported
from .protocol import error_body

OPEN_PATHS = frozenset({"/health"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
INVALID_HTTP_MESSAGE = (
    "the request is not valid HTTP/1.1 (its request line, a header, or the framing of its body:"
    " Content-Length or chunk sizes)"
)


class RequestGuard:
    """ASGI middleware: authentication, content type, body size and body read time (see the module)."""

    def __init__(
        self,
        app,
        *,
        api_key: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    ):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if not self._authorized(scope["path"], headers):
            message = "invalid or missing API key: send the header `Authorization: Bearer <key>`"
            return await _reply(send, 401, message, "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        if scope["method"] not in _BODY_METHODS:
            return await self.app(scope, receive, send)
        media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if media_type != b"application/json":
            shown = media_type.decode("latin-1") or "none"
            message = f"the request body must be JSON (Content-Type: application/json), not {shown}"
            return await _reply(send, 415, message, "unsupported_media_type")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            return await self._too_large(send)
        body = await self._read_body(receive, send)
        if body is None:
            return None
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    def _authorized(self, path: str, headers: dict[bytes, bytes]) -> bool:
        """`Authorization: Bearer <key>`; the scheme's name is case-insensitive (RFC 7235)."""
        if self.api_key is None or path in OPEN_PATHS:
            return True
        scheme, _, credentials = headers.get(b"authorization", b"").strip().partition(b" ")
        # constant-time comparison: the time taken says nothing about how much of the key matched
        key_matches = hmac.compare_digest(credentials.strip(b" "), self.api_key)
        return scheme.lower() == b"bearer" and key_matches

    async def _read_body(self, receive, send) -> bytes | None:
        """The whole body, or None once an error answer is sent (or the client left)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout_s
        parts, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                message_text = f"the request body did not arrive within {self.read_timeout_s:g} s"
                await _reply(send, 408, message_text, "request_timeout", [(b"connection", b"close")])
                return None
            if message["type"] == "http.disconnect":
                return None
            size += len(message.get("body", b""))
            if size > self.max_request_bytes:
                await self._too_large(send)
                return None
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _too_large(self, send) -> None:
        message = f"the request body is larger than this server's limit of {self.max_request_bytes} bytes"
        await _reply(send, 413, message, "request_too_large")


async def _reply(send, status: int, message: str, code: str, headers: list | None = None) -> None:
    kind = "invalid_request_error" if status != 408 else "timeout"
    payload = json.dumps(error_body(message, type=kind, code=code)).encode()
    start_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        *(headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": start_headers})
    await send({"type": "http.response.body", "body": payload})


def read_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a time limit on receiving each request's headers, whose answer to a
    request that is not valid HTTP/1.1 (h11 raises before the app sees it: a bad request line or
    header, a Content-Length that is not a number, a bad chunk size) is 400 with the OpenAI error body
    rather than uvicorn's plain text."""

    class ReadTimeoutH11Protocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            payload = json.dumps(error_body(INVALID_HTTP_MESSAGE, code="invalid_http")).encode()
            length = str(len(payload)).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", length),
                (b"connection", b"close"),
            ]
            try:
                response = h11.Response(status_code=400, headers=headers, reason=b"Bad Request")
                self.transport.write(self.conn.send(response))
                self.transport.write(self.conn.send(h11.Data(data=payload)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:  # a response was already under way: only closing is left
                pass
            self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = None
            self._arm_header_timer()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers are complete
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if self.cycle is cycle and not self.transport.is_closing():  # waiting for the next request
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(timeout_s, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return ReadTimeoutH11Protocol


class DrainingServer(uvicorn.Server):
    """uvicorn's server with moetide's shutdown. The first SIGINT/SIGTERM closes the listener, refuses
    new requests and lets accepted ones run for up to `drain_timeout_s`; then it aborts what is left,
    so every stream still ends with a final chunk (finish_reason "abort") and [DONE]. A second signal
    exits at once. Prints one line with the bound address once serving.

    Set uvicorn's `timeout_graceful_shutdown` a few seconds above `drain_timeout_s`, so that the
    aborted streams can send their last chunk before uvicorn cancels their tasks.
    """

    def __init__(self, config: uvicorn.Config, engine, drain_timeout_s: float, banner: str):
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self.banner = banner

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"[moetide] serving {self.banner} on http://{host}:{port}/v1", flush=True)

    def handle_exit(self, sig, frame) -> None:
        # a signal handler: it must not take the engine's lock (the interrupted code may hold it),
        # so the engine is told from a thread of its own
        if self.should_exit:
            self.force_exit = True
            threading.Thread(target=self.engine.cancel_all, daemon=True).start()
        else:
            threading.Thread(target=self.engine.stop, args=(self.drain_timeout_s,), daemon=True).start()
        super().handle_exit(sig, frame)
