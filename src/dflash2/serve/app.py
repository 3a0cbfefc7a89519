"""The OpenAI-compatible HTTP app: /v1/models, /v1/chat/completions, /v1/completions, /health, /metrics.

Handlers parse and validate the body themselves (size limit, UTF-8, JSON, strict schema) so that every bad
input gets an OpenAI-style JSON error, then hand a :class:`~dflash2.decode.batch.BatchRequest` to the batch
engine's loop thread and relay its events: as one body, or as server-sent events. A client that goes away
cancels its request; the engine frees its KV blocks at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dflash2.decode.batch import BatchEngine, BatchRequest, DeadlineError, EngineStoppedError, Event, QueueFullError
from dflash2.decode.output import GenerationResult, StreamChunk
from dflash2.kv.paged import KVBudgetError
from dflash2.serve import metrics
from dflash2.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from dflash2.serve.replies import Reply, calls_tools, chat_prompt, request_constraint
from dflash2.serve.responses import ResponseIds, chat_delta, usage
from dflash2.serve.structured import Grammars
from dflash2.verify import SamplingParams

ROUTES = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/health", "/metrics", "/openapi.json")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")  # origins on these hosts (any port) are allowed by default
LOOPBACK_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"  # the same, for the CORS headers
KEEPALIVE_S = 15.0  # an SSE comment line after this long without an event keeps proxies from closing the stream

log = logging.getLogger("dflash2.serve")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str  # the id clients pass as ``model``
    api_key: str | None = None  # when set, /v1/* needs ``Authorization: Bearer <key>``
    default_drafter: str = "ngram"  # "none" or a drafter the batch engine holds
    default_num_draft_tokens: int = 8
    max_tokens: int | None = None  # the most new tokens a request may ask for, and its default (None: the context)
    max_body_bytes: int = 1 << 20
    max_num_draft_tokens: int = 16  # the most drafts per step a request may ask for
    request_timeout_s: float | None = None  # deadline of every request (None: none); requests may ask for less
    # Browser origins allowed to call the API (a request with another ``Origin`` header gets 403): None = the
    # loopback hosts on any port; ("*",) = any origin. Requests without an Origin (curl, SDKs) are never refused.
    allowed_origins: tuple[str, ...] | None = None

    def origin_allowed(self, origin: str) -> bool:
        if self.allowed_origins is None:
            return (urlsplit(origin).hostname or "") in LOOPBACK_HOSTS
        return "*" in self.allowed_origins or origin.rstrip("/") in {o.rstrip("/") for o in self.allowed_origins}


class _OriginGuard:
    """ASGI middleware: refuses (403) requests whose ``Origin`` header names a site not allowed. A web page can
    send a simple POST (text/plain, no preflight) to a local server; this keeps arbitrary sites from driving it."""

    def __init__(self, app, config: ServerConfig) -> None:
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            origin = dict(scope["headers"]).get(b"origin")
            if origin is not None and not self.config.origin_allowed(origin.decode("latin-1")):
                error = ApiError(403, "requests from this origin are not allowed (see --allowed-origins)",
                                 type="permission_error", code="origin_not_allowed")
                await JSONResponse(error.body(), status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Counting:
    """ASGI middleware: counts responses by route and status for /metrics."""

    def __init__(self, app, counters: metrics.HttpCounters) -> None:
        self.app, self.counters = app, counters

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [0]

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.counters.add(route, status[0] or 500)


def create_app(batch: BatchEngine, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="dflash2", docs_url=None, redoc_url=None)
    app.openapi = lambda: _openapi_schema(app)  # type: ignore[method-assign]
    counters = metrics.HttpCounters()
    _add_cors(app, config)
    app.add_middleware(_OriginGuard, config=config)  # added after CORS: runs before it, refusing other origins
    app.add_middleware(_Counting, counters=counters)  # added last: runs first, so it also counts the 403s
    started = int(time.time())
    _add_error_handlers(app)
    grammars = _grammars(batch)

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = batch.alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(batch.snapshot(), counters), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _authorize(request, config)
        card = {"id": config.model_name, "object": "model", "created": started, "owned_by": "dflash2"}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        _authorize(request, config)
        body = _parse(ChatCompletionRequest, await _read_json(request, config.max_body_bytes))
        prompt_ids = _encode(batch, lambda engine: chat_prompt(engine, body))
        return await _generate(request, batch, config, body, prompt_ids, grammars, chat=True)

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request):
        _authorize(request, config)
        body = _parse(CompletionRequest, await _read_json(request, config.max_body_bytes))
        prompt = body.prompt
        if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt) and prompt:
            prompt_ids = list(prompt)
            if max(prompt_ids) >= batch.engine.target.config.vocab_size or min(prompt_ids) < 0:
                raise ApiError(400, "a prompt token id is outside the vocabulary", param="prompt")
        else:
            if isinstance(prompt, list) and len(prompt) != 1:
                raise ApiError(400, f"one prompt per request (n=1), got {len(prompt)}", param="prompt")
            text = prompt[0] if isinstance(prompt, list) else prompt
            prompt_ids = _encode(batch, lambda engine: engine.encode_prompt(text, raw=True))
        return await _generate(request, batch, config, body, prompt_ids, grammars, chat=False)

    return app


def _add_cors(app: FastAPI, config: ServerConfig) -> None:
    """CORS headers and preflight answers for the allowed origins (the loopback hosts by default), so a page on
    another origin can call the API from a browser."""
    origins = config.allowed_origins
    app.add_middleware(CORSMiddleware, allow_origins=list(origins or ()),
                       allow_origin_regex=LOOPBACK_ORIGINS if origins is None else None,
                       allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"], max_age=600)


def _grammars(batch: BatchEngine) -> Grammars | None:
    """The grammar compiler of the target's tokenizer (None for a tokenizer without a transformers one)."""
    tokenizer = batch.engine.tokenizer
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        return None
    return Grammars(hf, batch.engine.target.config.vocab_size, tokenizer.eos_token_ids)


def _json_body(model) -> dict:
    """The OpenAPI request body of a handler that parses ``model`` itself (so FastAPI cannot see it)."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _openapi_schema(app: FastAPI) -> dict:
    """FastAPI's schema plus the request bodies' models (served at /openapi.json; fuzzed in the tests)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi
        from pydantic.json_schema import models_json_schema

        schema = get_openapi(title=app.title, version="1", routes=app.routes)
        _, bodies = models_json_schema([(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
                                       ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(bodies["$defs"])
        app.openapi_schema = schema
    return app.openapi_schema


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(ApiError(error.status_code, str(error.detail)).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        error_id = _error_id()
        log.error("internal error %s on %s %s", error_id, request.method, request.url.path, exc_info=error)
        return JSONResponse(_internal_error(error_id).body(), status_code=500)


def _error_id() -> str:
    return f"err-{uuid.uuid4().hex[:16]}"


def _internal_error(error_id: str) -> ApiError:
    """A 500 that names only an id; the details go to the server log under it."""
    return ApiError(500, f"internal server error (id {error_id}; details are in the server log)",
                    type="server_error", code=error_id)


def _authorize(request: Request, config: ServerConfig) -> None:
    if config.api_key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
        raise ApiError(401, "invalid or missing API key", type="authentication_error", code="invalid_api_key")


async def _read_json(request: Request, limit: int) -> Any:
    """The body as JSON: 415 unless declared as JSON, 413 past ``limit`` bytes, 400 for invalid UTF-8 or
    malformed JSON."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, f"the body must be JSON (Content-Type: application/json), got {media_type or 'none'!r}",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body is {declared} bytes; the limit is {limit}", code="request_too_large")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise ApiError(413, f"the body exceeds {limit} bytes", code="request_too_large")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ApiError(400, f"the body is not valid UTF-8 ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise ApiError(400, f"malformed JSON: {error.msg} at line {error.lineno} column {error.colno}") from None


def _parse(model, data: Any):
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        body = model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        if first["type"] == "extra_forbidden":  # unknown: it might change the output, so it is not ignored
            raise ApiError(400, f"{param} is not supported by this server", param=param) from None
        raise ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from None
    body.refuse_unsupported()
    ignored = body.ignored_fields()
    if ignored:
        log.info("ignored fields (they change nothing here): %s", ", ".join(ignored))
    return body


def _encode(batch: BatchEngine, encode) -> list[int]:
    from jinja2 import TemplateError

    try:
        return encode(batch.engine)
    except (ValueError, TemplateError) as error:  # a template may raise on messages it does not take
        raise ApiError(400, str(error), param="messages") from None


def _batch_request(batch: BatchEngine, config: ServerConfig, body, prompt_ids: list[int]) -> BatchRequest:
    if body.model != config.model_name:
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {config.model_name!r}",
                       param="model", code="model_not_found")
    context = batch.engine.max_context
    if len(prompt_ids) >= context:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the model's context is {context}",
                       param="messages", code="context_length_exceeded")
    limit = body.token_limit()
    if limit is not None and config.max_tokens is not None and limit > config.max_tokens:
        raise ApiError(400, f"max_tokens ({limit}) exceeds this server's limit of {config.max_tokens}",
                       param="max_tokens")
    if limit is not None and len(prompt_ids) + limit > context:
        raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({limit}) exceeds the model's "
                            f"context of {context}", param="max_tokens", code="context_length_exceeded")
    options = body.dflash2
    drafter = options.drafter or config.default_drafter
    if drafter != "none" and drafter not in batch.drafters:
        held = ", ".join(["none", *sorted(batch.drafters)])
        raise ApiError(400, f"drafter {drafter!r} is not available on this server ({held})", param="dflash2.drafter")
    k = options.num_draft_tokens
    if drafter == "none" and k:
        raise ApiError(400, "num_draft_tokens > 0 needs a drafter", param="dflash2.num_draft_tokens")
    if k is not None and k > config.max_num_draft_tokens:
        raise ApiError(400, f"num_draft_tokens must be <= {config.max_num_draft_tokens} on this server, got {k}",
                       param="dflash2.num_draft_tokens")
    k = (config.default_num_draft_tokens if k is None else k) if drafter != "none" else 0
    params = SamplingParams(temperature=body.temperature, top_k=options.top_k, top_p=body.top_p, seed=body.seed)
    max_new = limit if limit is not None else min(config.max_tokens or context, context - len(prompt_ids))
    timeouts = [t for t in (options.timeout_s, config.request_timeout_s) if t is not None]
    return BatchRequest(prompt_ids, max_new, params, body.stop_strings(), drafter if k else "none", k,
                        timeout_s=min(timeouts, default=None))


class _Relay:
    """Carries the loop thread's events into this request's asyncio queue."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def sink(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


def _engine_error(error: Exception, response_id: str) -> ApiError:
    """The error event of a request as an HTTP error; internal failures are logged, never shown."""
    if isinstance(error, KVBudgetError):
        return ApiError(503, str(error), type="server_error", code="kv_cache_full")
    if isinstance(error, EngineStoppedError):
        return ApiError(503, str(error), type="server_error", code="engine_stopped")
    if isinstance(error, DeadlineError):
        return ApiError(504, str(error), type="server_error", code="deadline_exceeded")
    log.error("request %s failed", response_id, exc_info=error)
    return _internal_error(response_id)


async def _generate(request: Request, batch: BatchEngine, config: ServerConfig, body, prompt_ids: list[int],
                    grammars: Grammars | None, *, chat: bool):
    batch_request = _batch_request(batch, config, body, prompt_ids)
    batch_request.constraint = await request_constraint(body, grammars, batch.engine.target.config.vocab_size)
    reply = Reply(chat, batch.engine.tokenizer, batch_request.constraint, calls_tools(body),
                  tuple(body.tool_names()) if chat else ())
    relay = _Relay()
    try:
        handle = batch.submit(batch_request, relay.sink)
    except QueueFullError as error:
        raise ApiError(429, str(error), type="rate_limit_error", code="queue_full") from None
    except EngineStoppedError as error:
        raise ApiError(503, str(error), type="server_error", code="engine_stopped") from None
    except ValueError as error:
        raise ApiError(400, str(error)) from None
    ids = ResponseIds.new("chatcmpl" if chat else "cmpl", config.model_name)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _sse(relay, handle, ids, reply, include_usage, batch_request)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    result = await _collect(request, relay, handle, ids.id)
    return JSONResponse({
        **ids.header("chat.completion" if chat else "text_completion"),
        "choices": [reply.body_choice(result)],
        "usage": usage(result),
        "dflash2": _extension(batch_request, result),
    })


def _extension(request: BatchRequest, result: GenerationResult) -> dict:
    stats = result.stats
    return {"drafter": request.drafter, "num_draft_tokens": request.num_draft_tokens,
            "finish_reason": result.finish_reason, "tau": round(stats.tau, 4),
            "target_forwards": stats.target_forwards,
            "acceptance_by_position": [round(a, 4) for a in stats.acceptance_by_position]}


async def _collect(request: Request, relay: _Relay, handle, response_id: str) -> GenerationResult:
    """Wait for the result; a client that disconnects meanwhile cancels the request."""
    finished = False
    checked = time.monotonic()
    try:
        while True:
            try:
                event = await asyncio.wait_for(relay.queue.get(), timeout=0.5)
            except TimeoutError:
                event = None
            if time.monotonic() - checked >= 0.5:  # also while events keep coming (fast token streams)
                checked = time.monotonic()
                if await request.is_disconnected():
                    raise ApiError(499, "the client closed the connection") from None
            if event is None:
                continue
            if isinstance(event, GenerationResult):
                finished = True
                return event
            if isinstance(event, Exception):
                finished = True
                raise _engine_error(event, response_id)
    finally:
        if not finished:
            handle.cancel()


async def _sse(relay: _Relay, handle, ids: ResponseIds, reply: Reply, include_usage: bool,
               request: BatchRequest) -> AsyncIterator[str]:
    """Server-sent events: content chunks (tool calls, logprobs), a final chunk with the finish reason, usage if
    asked, [DONE]."""
    header = ids.header("chat.completion.chunk" if reply.chat else "text_completion")

    def chunk(choice: dict) -> str:
        return f"data: {json.dumps({**header, 'choices': [choice]})}\n\n"

    finished = False
    try:
        if reply.chat:
            yield chunk(chat_delta("", None, first=True))
        while True:
            try:
                event = await asyncio.wait_for(relay.queue.get(), timeout=KEEPALIVE_S)
            except TimeoutError:
                yield ": keepalive\n\n"  # an SSE comment: clients ignore it
                continue
            if isinstance(event, StreamChunk):
                choice = reply.chunk_choice(event)
                if choice is not None:
                    yield chunk(choice)
                continue
            finished = True
            if isinstance(event, Exception):
                yield f"data: {json.dumps(_engine_error(event, ids.id).body())}\n\n"
            else:
                yield chunk(reply.final_choice(event))
                if include_usage:
                    body = {**header, "choices": [], "usage": usage(event),
                            "dflash2": _extension(request, event)}
                    yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
            return
    finally:
        if not finished:
            handle.cancel()
