"""The FastAPI app: routes, error shapes, streaming and client-disconnect handling.

``dllm serve`` builds the engine before it binds the port and hands it to ``build_app``;
without one, ``build_app`` builds it in a worker thread once the app starts (``/health`` and
every API route answer 503 until it is ready). The engine runs its loop on its own thread
(``AsyncLLM``). A client that goes away aborts its request: a streaming response is cancelled
by Starlette when the connection drops, and a non-streaming one waits for the connection's
``http.disconnect`` beside its work."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dllm.async_llm import AsyncLLM
from dllm.server.args import ServerConfig
from dllm.server.body_worker import BodyWorkers
from dllm.server.limits import check_body
from dllm.server.metrics import CONTENT_TYPE, ServerMetrics
from dllm.server.middleware import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    RequestGuardMiddleware,
    TurnMiddleware,
    take_body,
)
from dllm.server.native_api import NativeServing
from dllm.server.openai_api import OpenAIServing
from dllm.server.priority import engine_thread_init
from dllm.server.protocol import (
    AbortRequest,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    GenerateRequest,
    TokenizeRequest,
    check_rid,
    not_ready,
    parse_json_object,
    validate,
)
from dllm.server.serving import Serving, StatsLogger, shutting_down
from dllm.server.trace_format import NamedEvent
from dllm.server.turns import LoopTurns

logger = logging.getLogger("dllm.server")
# Bodies larger than this are parsed and validated in a worker thread, off the event loop.
LARGE_BODY_BYTES = 256 * 1024
# Requests started (and tokenized ones sent on, and finished answers rendered) in one turn of
# the event loop at most (``LoopTurns``): 64 at once held it for about 200 ms on a 2-core
# machine. Streams' chunks, cheaper each, have turns of their own.
STARTS_PER_TURN = 2
CHUNKS_PER_TURN = 8
# What the exit takes once the last request has ended (its error sent, the engine thread
# stopped, the interpreter torn down): about 0.9 s on a 2-core machine.
EXIT_RESERVE_S = 1.5


class ASCIIJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: a string the client sent (a lone
    surrogate included) can be echoed without failing to encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False,
                          separators=(",", ":")).encode("ascii")


class ServerState:
    """What the routes share. ``serving`` is ``None`` until the engine is ready."""

    def __init__(self, config: ServerConfig, llm: AsyncLLM | None = None):
        self.config = config
        self.metrics = ServerMetrics()
        self.llm = llm
        self.serving: Serving | None = None
        self.openai: OpenAIServing | None = None
        self.native: NativeServing | None = None
        self.bodies: BodyWorkers | None = None  # parse large bodies (--body-workers)
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[], None] | None = None
        self.closing = False
        self.turns = LoopTurns(STARTS_PER_TURN)
        self.chunk_turns = LoopTurns(CHUNKS_PER_TURN)

    async def load(self) -> None:
        try:
            if self.llm is None:
                self.llm = await asyncio.to_thread(_build_llm, self.config)
        except Exception as exc:  # noqa: BLE001 - reported, then the server exits
            logger.exception("could not load the model")
            self.load_error = exc
            if self.on_load_error is not None:
                self.on_load_error()
            return
        serving = Serving(self.llm, self.config.engine.served_model_name, self.metrics,
                          self.config.limits, self.config.strict_fields, self.turns)
        self.openai, self.native = OpenAIServing(serving), NativeServing(serving)
        self.serving = serving
        if self.closing:
            serving.closing = True

    def describe(self, url: str) -> str:
        """What is served where (the server's ready line)."""
        s = self.serving
        if s is None:
            return f"{url} (the model is still loading)"
        names = ", ".join(repr(n) for n in s.model_names)
        what = "embeddings at /v1/embeddings" if s.task == "embed" else \
            "/v1/completions, /v1/chat/completions"
        page = "" if self.config.no_web_ui or s.task == "embed" else f"; the page at {url}/"
        return (f"serving {s.model_path} ({self.llm.engine.info.architecture}) as {names} at "
                f"{url}/v1 ({what}; /health, /metrics{page})")

    async def log_stats(self) -> None:
        """The periodic stats line (``--log-stats-interval``), once the model is ready."""
        if not self.config.log_stats_interval:
            return
        while self.serving is None:
            await asyncio.sleep(0.1)
        await StatsLogger(self.serving, self.config.log_stats_interval).run()

    def ready(self) -> Serving:
        if self.closing:
            raise shutting_down()
        if self.serving is None:
            raise not_ready()
        return self.serving

    def begin_shutdown(self, timeout: float) -> None:
        """SIGTERM / SIGINT: refuse new requests now; the process is to have exited
        ``timeout`` seconds from now, so the running ones (those that finish before then
        answer as usual) are ended with an error ``EXIT_RESERVE_S`` before that (at most
        half of ``timeout``), the time the exit itself takes."""
        self.closing = True
        if self.serving is not None:
            serving = self.serving
            serving.closing = True
            grace = timeout - min(EXIT_RESERVE_S, timeout / 2)
            if serving.num_in_flight:
                logger.info("shutting down: waiting up to %.1f s for %d request(s)", grace,
                            serving.num_in_flight)
            asyncio.get_running_loop().call_later(grace, serving.end_all)


def health_answer(state: ServerState) -> tuple[int, dict[str, str], bytes]:
    """``GET /health``'s status, headers and body: 200 when requests are taken, else the 503
    that they would get. Answered by the route, and by the connection itself when it holds
    nothing but that request (``dllm.server.connections``)."""
    try:
        state.ready()
    except APIError as exc:
        return exc.status, exc.headers, ASCIIJSONResponse(exc.to_dict()).body
    return 200, {}, ASCIIJSONResponse({"status": "ok"}).body


def _build_llm(config: ServerConfig) -> AsyncLLM:
    from dllm.engine import Engine

    engine = Engine(config.engine)
    return AsyncLLM(engine=engine, thread_init=engine_thread_init(
        config.engine_nice, config.engine_cpu_threads, engine.device.type))


def build_app(config: ServerConfig, llm: AsyncLLM | None = None) -> FastAPI:
    """The app for ``config``; ``llm`` (optional) is an engine already built."""
    state = ServerState(config, llm)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if config.limits.body_workers:
            state.bodies = await asyncio.to_thread(BodyWorkers, config.limits.body_workers,
                                                   config.engine_nice)
        loading = asyncio.create_task(state.load())
        stats = asyncio.create_task(state.log_stats())
        try:
            yield
        finally:
            loading.cancel()
            stats.cancel()
            if state.bodies is not None:
                await asyncio.to_thread(state.bodies.close)
            if state.llm is not None:
                await asyncio.to_thread(state.llm.shutdown)
            if state.serving is not None:
                state.serving.close()

    app = FastAPI(title="dllm", lifespan=lifespan)
    app.state.dllm = state
    _add_error_handlers(app)
    _add_routes(app, state)
    if not config.no_web_ui:
        from dllm.server.web_ui import add_web_routes

        add_web_routes(app, state)
    # Added last = outermost: auth answers first, then the header and content-type checks,
    # all before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    app.add_middleware(RequestGuardMiddleware, max_headers=config.max_headers)
    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key,
                           metrics=config.api_key_metrics)
    if config.allowed_origins:  # a preflight is answered before any check
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=list(config.allowed_methods),
                           allow_headers=list(config.allowed_headers),
                           allow_credentials=config.allow_credentials)
    app.add_middleware(TurnMiddleware, turns=state.turns)  # outermost: before any work
    return app


# ---- routes -------------------------------------------------------------------------------
def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        status, headers, body = health_answer(state)
        return Response(body, status, headers, media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.llm is not None and state.serving is not None:
            s = state.llm.stats  # kept by the engine thread: no lock, no wait for a step
            state.metrics.set_engine_stats(s.running, s.waiting, s.kv_used_pages,
                                           s.kv_total_pages, s.prefix_cache_queries,
                                           s.prefix_cache_hits, s.prefix_cache_pages)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def model_card(s: Serving, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": s.created, "owned_by": "dllm",
                "root": s.model_path, "max_model_len": s.context_length}

    @app.get("/v1/models")
    async def models() -> Response:
        s = state.ready()
        return ASCIIJSONResponse({"object": "list",
                                  "data": [model_card(s, n) for n in s.model_names]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        s = state.ready()
        s.check_model(model_id)
        return ASCIIJSONResponse(model_card(s, model_id if model_id in s.model_names
                                            else s.model_name))

    # What sglang-router (``python -m sglang_router.launch_router --worker-urls ...``) reads
    # from a worker: ``/health`` (its health checks), ``/server_info`` and ``/model_info``
    # when it registers one (the model id it routes by is ``served_model_name``), and
    # ``/get_load`` (its load monitor; ``num_tokens`` is the load it compares). The
    # ``/get_...`` spellings are SGLang's older names of the first two.
    def model_info() -> dict[str, Any]:
        s = state.ready()
        info = s.llm.engine.info
        return {"model_path": s.model_path, "tokenizer_path": s.model_path,
                "served_model_name": s.model_name, "is_generation": s.task == "generate",
                "model_type": info.config.get("model_type", ""),
                "architectures": [info.architecture]}

    def server_info() -> dict[str, Any]:
        from dllm import __version__

        s = state.ready()
        cfg = s.llm.engine.config
        return {"served_model_name": s.model_name, "model_path": s.model_path,
                "tp_size": cfg.tensor_parallel_size, "dp_size": cfg.data_parallel_size,
                "context_length": s.context_length,
                "max_running_requests": cfg.max_running_requests, "version": __version__}

    async def model_info_route() -> Response:
        return ASCIIJSONResponse(model_info())

    async def server_info_route() -> Response:
        return ASCIIJSONResponse(server_info())

    for path, route in (("/model_info", model_info_route), ("/get_model_info", model_info_route),
                        ("/server_info", server_info_route),
                        ("/get_server_info", server_info_route)):
        app.add_api_route(path, route, methods=["GET"])

    @app.get("/get_load")
    async def get_load() -> Response:
        """One entry per data-parallel rank (one here), SGLang's shape: requests running and
        waiting, and ``num_tokens``: the tokens of every request this server holds (prompt
        plus the most it may generate), the quantity its admission limit counts."""
        s = state.ready()
        st = s.llm.stats  # kept by the engine thread: no lock
        return ASCIIJSONResponse([{"dp_rank": 0, "num_reqs": st.running + st.waiting,
                                   "num_waiting_reqs": st.waiting,
                                   "num_tokens": s.queued_tokens}])

    @app.get("/version")
    async def version() -> Response:
        from dllm import __version__

        return ASCIIJSONResponse({"version": __version__})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        s = state.ready()
        req: TokenizeRequest = validate(TokenizeRequest, parse_json_object(await _raw(request)))
        return ASCIIJSONResponse(await s.tokenize(req))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        s = state.ready()
        req: DetokenizeRequest = validate(DetokenizeRequest,
                                          parse_json_object(await _raw(request)))
        return ASCIIJSONResponse(await s.detokenize(req))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        s = state.ready()
        rid = _request_id(request, s)
        body = await _body(request, s, "/v1/completions", CompletionRequest)
        return await _answer(request, state.openai.completions(body, rid))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        s = state.ready()
        rid = _request_id(request, s)
        body = await _body(request, s, "/v1/chat/completions", ChatCompletionRequest)
        return await _answer(request, state.openai.chat(body, rid))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        s = state.ready()
        body = await _body(request, s, "/v1/embeddings", EmbeddingRequest)
        return await _answer(request, state.openai.embeddings(body))

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        s = state.ready()
        body = await _body(request, s, "/generate", GenerateRequest)
        return await _answer(request, state.native.generate(body))

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        serving = state.ready()
        body = parse_json_object(await _raw(request))
        req: AbortRequest = validate(AbortRequest, body)
        rid = check_rid(req.rid, "rid", serving.limits.max_rid_length)
        return ASCIIJSONResponse({"rid": rid, "aborted": await serving.abort(rid)})


def _request_id(request: Request, serving: Serving) -> str | None:
    rid = request.headers.get("x-request-id")
    if rid is not None:
        check_rid(rid, "X-Request-Id", serving.limits.max_rid_length)
    return rid


def _parse(raw: bytes, serving: Serving, route: str, model: type | None,
           bodies: BodyWorkers | None = None) -> Any:
    bounds = (serving.limits, serving.context_length, serving.max_prompt_chars)
    if bodies is not None:
        body = bodies.parse(raw, route, *bounds)
    else:
        body = parse_json_object(raw)
        check_body(route, body, *bounds)
    return body if model is None else validate(model, body)


async def _raw(request: Request) -> bytes | bytearray:
    """The request's body as ``BodyLimitMiddleware`` read it (not copied again)."""
    body = take_body(request.scope)
    return body if body is not None else await request.body()


async def _body(request: Request, serving: Serving, route: str, model: type) -> Any:
    """The parsed body: a dict, or for a large body the validated model, made in a thread
    (the JSON parsed in a worker process, ``--body-workers``) so that the event loop
    (``/health``, every stream) does not wait."""
    raw = await _raw(request)
    if len(raw) <= LARGE_BODY_BYTES:
        return _parse(raw, serving, route, None)
    bodies: BodyWorkers | None = request.app.state.dllm.bodies
    return await asyncio.to_thread(_parse, raw, serving, route, model, bodies)


async def _answer(request: Request, work: Awaitable[Any]) -> Response:
    """Run a route's work; if the client disconnects first, cancel it (which aborts its
    requests in the engine). The disconnect is waited for, not polled: once the body is read,
    the connection's next ASGI message is ``http.disconnect``, so a request costs the event
    loop nothing while it runs (polling 64 of them woke the loop 256 times a second, in
    step, and ``/health`` waited behind each round)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        with suppress(asyncio.CancelledError, APIError):
            await task
        return Response(status_code=499)  # nobody reads it
    result = task.result()
    try:
        await request.app.state.dllm.turns.take()  # rendering 64 answers at once is work too
    except BaseException:  # cancelled meanwhile (the server's end): a stream's memory back now
        if isinstance(result, AsyncIterator):
            await result.aclose()
        raise
    if isinstance(result, AsyncIterator):
        return SSEResponse(_sse(result, request.app.state.dllm.chunk_turns),
                           media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return ASCIIJSONResponse(result)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (its body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse_event(chunk: dict) -> bytes:
    """One SSE message; a ``NamedEvent`` (a denoise step) with its ``event:`` line."""
    head = f"event: {chunk.event}\n" if isinstance(chunk, NamedEvent) else ""
    data = json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
    try:
        return f"{head}data: {data}\n\n".encode()
    except UnicodeEncodeError:  # a lone surrogate: escape everything instead
        return f"{head}data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode()


async def _sse(chunks: AsyncIterator[dict], turns: LoopTurns) -> AsyncIterator[bytes]:
    """A stream's SSE messages, each sent in its turn (an engine step gives every running
    stream a chunk at once)."""
    try:
        async for chunk in chunks:
            await turns.take()
            yield sse_event(chunk)
        yield b"data: [DONE]\n\n"
    finally:
        await chunks.aclose()


class SSEResponse(StreamingResponse):
    """Closes its iterator however the response ends (finished, cancelled on disconnect, or
    failed in ``send``), so the request's memory is returned at once, not at GC time."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


# ---- errors -------------------------------------------------------------------------------
def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return ASCIIJSONResponse(exc.to_dict(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        err = (exc.errors() or [{}])[0]
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        return await api_error(_, APIError(400, f"{loc}: {err.get('msg', 'invalid request')}",
                                           "invalid_request_error", loc or None,
                                           "invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        types = {404: "not_found_error", 405: "invalid_request_error"}
        error = APIError(exc.status_code, str(exc.detail),
                         types.get(exc.status_code, "invalid_request_error"))
        return ASCIIJSONResponse(error.to_dict(), status_code=exc.status_code,
                                 headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        logger.error("internal error", exc_info=exc)
        error = APIError(500, f"internal server error ({type(exc).__name__})", "server_error",
                         None, "internal_error")
        return ASCIIJSONResponse(error.to_dict(), status_code=500)
