"""The OpenAI-compatible HTTP API over an `AsyncEngine` (FastAPI).

    POST /v1/completions        prompt (string, [string] or token ids) -> text; SSE with stream: true
    POST /v1/chat/completions   messages through the chat template -> assistant message; SSE too
    GET  /v1/models             the served model
    GET  /health                200 while the engine thread serves, 503 otherwise
    GET  /metrics               Prometheus text format

Both POST routes take one path (`_generate`); a `_Kind` holds what differs (request type, ids,
response builders). Every 4xx/5xx answer has the OpenAI error body
`{"error": {"message", "type", "param", "code"}}`. `RequestGuard` (serve/http.py) checks the key,
content type, size and read time first. Handlers never block the event loop: JSON parsing,
validation and tokenization run in `PREPARE_THREADS` preparation threads (a request waits for one,
off the loop) and generation on the engine thread. A client that goes away while its request waits
for a preparation thread is never prepared; one whose request is being prepared stops it at the
encoder's next step (`threading.Event`); one that goes away later (streaming or not) aborts its
sequence.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.chat import EncodingCancelled
from ..errors import ConfigError
from .async_engine import AsyncEngine, EngineStoppedError, QueueFullError, RequestStream
from .http import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_READ_TIMEOUT_S, RequestGuard
from .prompt import PromptEncoder
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_body,
    chat_chunk,
    chat_text_chunk,
    check_list_caps,
    completion_body,
    completion_chunk,
    error_body,
    new_id,
    now_s,
    usage,
)

log = logging.getLogger("moetide.serve")

RETRY_AFTER_S = 1
# Requests validated and tokenized at once; more wait (off the event loop) for a thread. Tokenizers
# release the GIL, so a few threads use a few cores; a bound keeps a burst of heavy prompts from
# starving the engine thread of the GIL with dozens of threads of Python work.
PREPARE_THREADS = 4
CLIENT_GONE_STATUS = 499  # the client closed the connection before its answer (nobody reads it)


@dataclass(frozen=True)
class _Kind:
    """What differs between the completions and chat routes; everything else is one path."""

    request_type: type[CompletionRequest | ChatCompletionRequest]
    id_prefix: str
    body: Callable[..., dict]  # (id, model, text, finish_reason, prompt_tokens, output_tokens, created)
    chunk: Callable[..., dict]  # (id, model, created, text | None, finish_reason, usage)
    first_chunk: Callable[[str, str, int], dict] | None = None  # (id, model, created)


COMPLETION = _Kind(CompletionRequest, "cmpl", completion_body, completion_chunk)
CHAT = _Kind(
    ChatCompletionRequest,
    "chatcmpl",
    chat_body,
    chat_text_chunk,
    lambda rid, model, created: chat_chunk(rid, model, created, {"role": "assistant", "content": ""}),
)


class _Server:
    """What the handlers share: the engine, the prompt encoder and the served name. One per app."""

    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, aliases: Iterable[str]):
        self.engine = engine
        self.encoder = PromptEncoder(tokenizer, engine.max_model_len)
        self.model_name = model_name
        self.accepted_names = {model_name, *aliases}
        self.created = now_s()
        self.preparer = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="moetide-prepare")

    # -- request checks (in the preparation threads) ------------------------------------------------------
    def prepare(self, raw: bytes, kind: _Kind, cancel: threading.Event | None = None):
        """Body bytes -> (validated request, prompt ids, max_tokens), or an `APIError`; a set `cancel`
        stops it between steps (`EncodingCancelled`)."""
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        check_list_caps(data)
        try:
            body = kind.request_type.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e.errors()) from None
        self.check_model(body.model)
        body.check_supported()
        if cancel is not None and cancel.is_set():
            raise EncodingCancelled()
        prompt_ids = body.encode(self.encoder, cancel)
        return body, prompt_ids, self.resolve_max_tokens(body.requested_max_tokens, len(prompt_ids), body)

    async def prepare_unless_gone(self, request: Request, raw: bytes, kind: _Kind):
        """`prepare` in a preparation thread, given up when the client disconnects first: a request
        still waiting for a thread never runs, one running stops at its next step. Raises APIError
        (CLIENT_GONE_STATUS) then."""
        cancel = threading.Event()
        work = asyncio.get_running_loop().run_in_executor(self.preparer, self.prepare, raw, kind, cancel)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            cancel.set()
            work.cancel()  # a job not started yet is dropped from the executor's queue
            work.add_done_callback(_ignore_outcome)
            self.engine.metrics.rejected.labels("client_gone").inc()
            raise APIError(CLIENT_GONE_STATUS, "the client disconnected before its request was prepared")
        return work.result()

    def check_model(self, name: str) -> None:
        if name not in self.accepted_names:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def resolve_max_tokens(self, requested: int | None, prompt_len: int, body) -> int:
        """Validate the prompt length and `max_tokens` against the context; None = the rest of it."""
        context = self.engine.max_model_len
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty", param=body.prompt_param)
        if prompt_len >= context:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens; this model's context holds {context} tokens"
                " (prompt + output): shorten the prompt",
                param=body.prompt_param,
                code="context_length_exceeded",
            )
        if requested is None:
            requested = context - prompt_len
            requested = min(requested, self.engine.kv_capacity_tokens - prompt_len)
        if requested < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {requested}", param="max_tokens")
        if prompt_len + requested > context:
            raise APIError(
                400,
                f"max_tokens={requested} plus the prompt's {prompt_len} tokens exceed this model's"
                f" context of {context} tokens: ask for at most {context - prompt_len}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    # -- on the event loop ----------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], body, max_tokens: int, request_id: str) -> RequestStream:
        try:
            params = body.sampling_params(max_tokens)
            return self.engine.submit(prompt_ids, params, request_id=request_id)
        except QueueFullError as e:
            raise APIError(
                429,
                str(e),
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except EngineStoppedError as e:
            raise APIError(503, str(e), type="service_unavailable", code="shutting_down") from None
        except ConfigError as e:
            raise APIError(400, str(e)) from None


# what a field accepts, for fields whose type is a union (pydantic reports one error per branch)
_FIELD_TYPES = {
    "prompt": "a string, a list of one string, or a list of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}


def _validation_error(errors) -> APIError:
    """pydantic's error list -> one 400 naming the first offending field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # a union reports each branch (`prompt.str`, `prompt.list[int]`): the field is the top-level name
    param = loc[0] if loc else None
    if first.get("type") == "missing":
        message = f"{'.'.join(loc)} is required"
    elif first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    elif first.get("type") == "model_attributes_type" or not loc:
        message = "the request body must be a JSON object"
    elif first.get("type") == "value_error":  # our own field checks: their message is the reason
        message = f"{'.'.join(loc)} {str(first.get('msg')).removeprefix('Value error, ')}"
    elif loc[0] in _FIELD_TYPES or (len(loc) > 2 and loc[2] in _FIELD_TYPES):
        field = loc[0] if loc[0] in _FIELD_TYPES else loc[2]
        where = field if field == loc[0] else ".".join(loc[:3])
        message = f"{where} must be {_FIELD_TYPES[field]}"
    else:
        message = f"{'.'.join(loc)}: {first.get('msg')}"
    return APIError(400, message, param=param, code="invalid_value")


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _ignore_outcome(future: asyncio.Future) -> None:
    """Done callback of a preparation given up: its result or error (cancelled, or an APIError) has
    no client to go to."""
    if not future.cancelled():
        future.exception()


async def _abort_on_disconnect(request: Request, engine: AsyncEngine, request_id: str) -> None:
    """Wait for the client to go away, then abort its request."""
    await _disconnected(request)
    engine.abort(request_id)


async def _collect(request: Request, server: _Server, stream: RequestStream) -> tuple[str, int, str | None]:
    """Run a non-streaming request to its end: (text, output tokens, finish reason)."""
    watcher = asyncio.ensure_future(_abort_on_disconnect(request, server.engine, stream.request_id))
    parts: list[str] = []
    num_tokens, reason = 0, None
    try:
        async for event in stream:
            parts.append(event.text)
            num_tokens = event.num_output_tokens
            if event.finished:
                reason = event.finish_reason
                if event.error:
                    raise APIError(500, event.error, type="internal_error", code="engine_error")
    finally:
        watcher.cancel()
        if not stream.finished:  # cancelled (shutdown, or the client left): free the sequence
            server.engine.abort(stream.request_id)
    return "".join(parts), num_tokens, reason


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream_events(
    server: _Server, stream: RequestStream, make_chunk, include_usage: bool, first: dict | None = None
) -> AsyncIterator[str]:
    """SSE lines for one request; `make_chunk(text, finish_reason)` builds a chunk dict.

    Leaving early (the client disconnected, or shutdown cancelled the task) aborts the sequence.
    """
    num_tokens = 0
    try:
        if first is not None:
            yield _sse(first)
        async for event in stream:
            num_tokens = event.num_output_tokens
            if event.error:
                yield _sse(error_body(event.error, type="internal_error", code="engine_error"))
                break
            if event.text or event.finished:
                yield _sse(make_chunk(event.text, event.finish_reason if event.finished else None))
        else:
            if include_usage:
                yield _sse(make_chunk(None, None, usage(len(stream.prompt_ids), num_tokens)))
        yield "data: [DONE]\n\n"
    finally:
        if not stream.finished:
            server.engine.abort(stream.request_id)


class _EventStreamResponse(StreamingResponse):
    """SSE response that aborts its request however the response ends (done, disconnect, cancelled)."""

    def __init__(self, events: AsyncIterator[str], server: _Server, stream: RequestStream):
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._server = server
        self._stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._stream.finished:
                self._server.engine.abort(self._stream.request_id)


def _sse_response(
    server: _Server, stream: RequestStream, make_chunk, include_usage: bool, first: dict | None = None
) -> StreamingResponse:
    return _EventStreamResponse(
        _stream_events(server, stream, make_chunk, include_usage, first), server, stream
    )


async def _generate(request: Request, server: _Server, kind: _Kind) -> Response:
    """The one path of both POST routes: validate and tokenize (thread pool), submit, answer."""
    raw = await request.body()  # already read, bounded in size and time, by RequestGuard
    body, prompt_ids, max_tokens = await server.prepare_unless_gone(request, raw, kind)
    request_id, created = new_id(kind.id_prefix), now_s()
    stream = server.submit(prompt_ids, body, max_tokens, request_id)
    if body.stream:

        def chunk(text, finish_reason, usage_body=None):
            return kind.chunk(request_id, body.model, created, text, finish_reason, usage_body)

        first = kind.first_chunk(request_id, body.model, created) if kind.first_chunk else None
        return _sse_response(server, stream, chunk, body.include_usage, first)
    text, num_tokens, reason = await _collect(request, server, stream)
    return JSONResponse(kind.body(request_id, body.model, text, reason, len(prompt_ids), num_tokens, created))


def create_app(
    engine: AsyncEngine,
    tokenizer,
    *,
    model_name: str,
    model_aliases: Iterable[str] = (),
    drain_timeout_s: float = 30.0,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
) -> FastAPI:
    """The FastAPI app over an already-built engine. Startup starts the engine thread; shutdown
    stops taking requests, lets accepted ones finish for up to `drain_timeout_s`, cancels the rest.

    `api_key`: required as `Authorization: Bearer <key>` on every route but /health (None = open).
    `max_request_bytes` / `read_timeout_s`: larger bodies get 413, slower ones 408 (`RequestGuard`).
    """
    server = _Server(engine, tokenizer, model_name, model_aliases)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop, drain_timeout_s)
            server.preparer.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="moetide", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(
        RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes, read_timeout_s=read_timeout_s
    )
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if engine.accepting:
            return JSONResponse({"status": "ok", **engine.stats()})
        return JSONResponse(
            error_body("the engine is not serving", type="service_unavailable"), status_code=503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(engine.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": server.model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "moetide",
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, server, COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, server, CHAT)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, ours or the framework's, answered with the OpenAI error body."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = _validation_error(exc.errors())
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(
            error_body(str(exc.detail), type=kind, code=code),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in a request handler")
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}", type="internal_error"), status_code=500
        )
