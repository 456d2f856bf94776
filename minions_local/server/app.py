"""The HTTP side: Starlette routes that speak the OpenAI API over one engine.

Every request is authenticated, size-limited and checked (schema.py) before it is
queued; the engine's own checks run when its turn comes, before any model work, and
a streamed response only starts once they pass, so a bad request gets its 4xx as a
JSON error object even with `stream: true`. A client that goes away while its
request waits or runs cancels it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from minions_local.core.events import DoneEvent, Generation, TokenEvent
from minions_local.server import errors
from minions_local.server.errors import ApiError
from minions_local.server.openai_format import OpenAIReply, speculation_stats, sse
from minions_local.server.scheduler import Ended, Failed, Job, QueueFull, Scheduler, Started, Stopped
from minions_local.server.schema import ChatRequest, CompletionRequest, parse, parse_json

log = logging.getLogger("minions_local.server")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""A prompt filling a 128k-token context is about 0.5 MB of text."""
DRAIN_BYTES = 64 * 1024 * 1024
"""How far past the limit an oversized body is still read (and dropped) so that its
client can read the 413; a bigger one is refused at once, and may see a reset."""


@dataclass
class Settings:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_waiting: int = 8
    parallel: int | None = None
    """Requests decoding at once (None: what the engine's memory allows, engine.default_parallel)."""


class ClientGone(Exception):
    pass


def create_app(engine: Any, settings: Settings, scheduler: Scheduler | None = None) -> Starlette:
    """The ASGI app over `engine` (anything with prepare / prepare_chat / batch_run /
    default_parallel, like Engine)."""
    scheduler = scheduler or Scheduler(engine, max_waiting=settings.max_waiting, parallel=settings.parallel)
    profile = getattr(engine, "profile_name", "") or ""

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise ApiError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>' with the key the "
                                "server was started with (--api-key).", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def read_body(request: Request) -> bytes:
        """The body, up to the limit; above it a 413 that every client gets to read.

        A client that sends its whole body before reading the answer, and asks for the
        connection to close (urllib sends `Connection: close`), saw a reset instead of
        the 413: the server closed right after answering with the body still unread,
        so the kernel sent RST and the client's send failed before it read anything
        (a 12 MB request). So an oversized body is read to its end and dropped (up to
        DRAIN_BYTES past the limit) before the answer; only a client that waits for
        `100 Continue` (curl, for large bodies) is answered at once, before it sends."""
        limit = settings.max_body_bytes
        too_large = ApiError(413, f"The request body is larger than this server's limit of {limit} bytes "
                                  f"(--max-body-bytes).", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdecimal() and int(declared) > limit:
            if int(declared) > limit + DRAIN_BYTES or "100-continue" in request.headers.get("expect", "").lower():
                raise too_large
        body = bytearray()
        received = 0
        try:
            async for chunk in request.stream():
                received += len(chunk)
                if received > limit + DRAIN_BYTES:
                    raise too_large  # give up on draining: this client may see a reset
                if received <= limit:
                    body += chunk
        except ClientDisconnect:
            if received > limit:
                raise too_large from None  # the answer goes nowhere, but no error is logged
            raise
        if received > limit:
            raise too_large
        return bytes(body)

    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [_model_card(settings.model_name)]})

    async def model(request: Request) -> Response:
        authorize(request)
        name = request.path_params["model"]
        if name != settings.model_name:
            raise ApiError(404, f"The model '{name[:80]}' does not exist; this server has '{settings.model_name}'.",
                           param="model", code="model_not_found")
        return JSONResponse(_model_card(name))

    async def chat_completions(request: Request) -> Response:
        authorize(request)
        req: ChatRequest = parse(ChatRequest, parse_json(await read_body(request)))
        messages, options = req.chat_messages(), req.engine_options()
        reply = OpenAIReply(chat=True, model=settings.model_name, include_usage=req.include_usage)
        return await serve(request, reply, bool(req.stream), "messages",
                           lambda engine: engine.prepare_chat(messages, **options))

    async def completions(request: Request) -> Response:
        authorize(request)
        req: CompletionRequest = parse(CompletionRequest, parse_json(await read_body(request)))
        prompt, options = req.prompt, req.engine_options()
        reply = OpenAIReply(chat=False, model=settings.model_name, include_usage=req.include_usage)
        return await serve(request, reply, bool(req.stream), "prompt",
                           lambda engine: engine.prepare(prompt, **options))

    async def serve(request: Request, reply: OpenAIReply, stream: bool, prompt_field: str, start: Any) -> Response:
        job = Job(start=start, loop=asyncio.get_running_loop(), name=reply.id)
        try:
            scheduler.submit(job)
        except QueueFull:
            raise ApiError(429, f"The server is busy: {scheduler.parallel} requests decode at once (--parallel) "
                                f"and {scheduler.max_waiting} wait, the most it queues (--queue). Retry shortly.",
                           type="requests",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        except Stopped:
            raise errors.shutting_down() from None
        watch = _Disconnect(request)
        handed_over = False
        try:
            first = await watch.until(job.next())
            if not isinstance(first, Started):
                raise _failure(first, prompt_field)
            if stream:
                watch.close()  # from here the streaming response listens for the disconnect
                handed_over = True
                return StreamingResponse(_events(job, reply, scheduler, prompt_field, profile),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            generation = await watch.until(_collect(job, prompt_field))
            return JSONResponse(reply.complete(generation, _stats(job, generation, profile)))
        except ClientGone:
            log.info("%s: the client went away; cancelling", job.name)
            return Response(status_code=499)
        finally:
            watch.close()
            if not handed_over:
                scheduler.cancel(job)  # a no-op once the job has ended

    async def on_shutdown() -> None:
        scheduler.stop()
        await asyncio.to_thread(scheduler.join, 10.0)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await on_shutdown()

    app = Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _unexpected},
        lifespan=lifespan,
    )
    app.state.scheduler = scheduler
    return app


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "minions-local"}


def _stats(job: Job, generation: Generation, profile: str) -> dict[str, Any]:
    """The reply's `minions` field: its speculation, its time queued, and the notices of
    what happened before it started."""
    return speculation_stats(generation, queue_seconds=job.queue_seconds, profile=profile, notices=job.notices)


def _failure(item: Any, prompt_field: str) -> ApiError:
    if isinstance(item, Failed):
        if isinstance(item.error, Stopped):
            return errors.shutting_down()
        return errors.from_engine(item.error, prompt_field)
    # Ended before it started: it was cancelled while it waited (the server is stopping).
    return errors.shutting_down()


async def _collect(job: Job, prompt_field: str) -> Generation:
    while True:
        item = await job.next()
        if isinstance(item, DoneEvent):
            if item.generation.finish_reason == "cancelled":
                raise errors.shutting_down()
            return item.generation
        if isinstance(item, (Failed, Ended)):
            raise _failure(item, prompt_field)


async def _events(job: Job, reply: OpenAIReply, scheduler: Scheduler, prompt_field: str,
                  profile: str) -> AsyncIterator[str]:
    """The SSE body. If the client disconnects, Starlette cancels this generator at its
    await; the `finally` then cancels the job."""
    try:
        first = reply.first_chunk()
        if first is not None:
            yield sse(first)
        while True:
            item = await job.next()
            if isinstance(item, TokenEvent) and item.text:
                yield sse(reply.text_chunk(item.text))
            elif isinstance(item, DoneEvent):
                generation = item.generation
                if generation.finish_reason == "cancelled":
                    yield sse(errors.shutting_down().body())
                    return
                stats = _stats(job, generation, profile)
                yield sse(reply.final_chunk(generation, stats))
                if reply.include_usage:
                    yield sse(reply.usage_chunk(generation, stats))
                yield sse("[DONE]")
                return
            elif isinstance(item, (Failed, Ended)):
                yield sse(_failure(item, prompt_field).body())
                return
    finally:
        scheduler.cancel(job)


class _Disconnect:
    """Watches for the client going away while a response is still being prepared."""

    def __init__(self, request: Request) -> None:
        self._task: asyncio.Task | None = asyncio.ensure_future(self._listen(request.receive))

    @staticmethod
    async def _listen(receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def until(self, awaitable: Any) -> Any:
        work = asyncio.ensure_future(awaitable)
        assert self._task is not None
        done, _ = await asyncio.wait({work, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        raise ClientGone

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


async def _api_error(request: Request, err: Exception) -> Response:
    assert isinstance(err, ApiError)
    return err.response()


async def _http_error(request: Request, err: Exception) -> Response:
    assert isinstance(err, HTTPException)
    if err.status_code == 404:
        message = f"No such endpoint: {request.method} {request.url.path[:100]}. This server has GET /v1/models, " \
                  f"POST /v1/chat/completions and POST /v1/completions."
    elif err.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path[:100]}."
    else:
        message = str(err.detail)
    code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
    return ApiError(err.status_code, message, code=code, headers=err.headers).response()


async def _unexpected(request: Request, err: Exception) -> Response:
    log.error("unexpected error serving %s %s", request.method, request.url.path, exc_info=err)
    return errors.internal_error(err).response()
