"""The HTTP app (:func:`create_app`): OpenAI's completions and chat completions, models, health and metrics.

Handlers parse and check the body (:mod:`~specdec_ext.serve.protocol`), turn the prompt into ids, hand the request
to the engine thread (:class:`~specdec_ext.serve.engine_loop.EngineLoop`) and wait for its admission (so an input
the engine refuses is a 400 before any stream starts), then stream its deltas as server-sent events (``data:
{chunk}``, ``data: [DONE]``) or gather them into one response. A client that goes away (a closed stream, or a
disconnect while a non-streamed request runs) has its request aborted before the engine's next step.

Status codes: 400 bad input (the body names the field), 401 a missing or wrong bearer token (``api_key``), 404 an
unknown model or route, 413 a body over ``max_body_bytes``, 429 a full queue, 500 the engine failed, 503 shutting
down.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import json
import signal
import threading
import time

import uvicorn

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec_ext.serve import protocol as P
from specdec_ext.serve.engine_loop import Admitted, Delta, EngineLoop, QueueFull, Rejected, ServerClosed
from specdec_ext.serve.metrics import CONTENT_TYPE
from specdec_ext.serve.prompts import chat_ids, text_ids

__all__ = ["DrainingServer", "create_app", "serve_in_thread"]

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _json(body) -> str:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def _sse(body) -> str:
    return f"data: {_json(body)}\n\n"


class _Server:
    """What the handlers share: the engine loop, the tokenizer (a copy of the engine's: HF tokenizers are not meant
    for two threads at once) and the settings."""

    def __init__(self, loop: EngineLoop, model_name: str, api_key: str | None, max_body_bytes: int,
                 chat_template: str | None):
        engine = loop.engine
        self.loop, self.model_name, self.api_key, self.max_body_bytes = loop, model_name, api_key, max_body_bytes
        self.tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        if chat_template is not None and self.tokenizer is not None:
            self.tokenizer.chat_template = chat_template
        limits = [engine.max_len - engine.max_nodes] + ([engine.position_limit] if engine.position_limit else [])
        self.context = min(limits)  # prompt + max_tokens may not exceed this
        self.created = int(time.time())

    # ---- input ----------------------------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise P.ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")

    async def read_json(self, request: Request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise P.ApiError(413, f"the request body ({length} bytes) exceeds {self.max_body_bytes} bytes")
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise P.ApiError(413, f"the request body exceeds {self.max_body_bytes} bytes")
            parts.append(chunk)
        try:
            return json.loads(b"".join(parts))
        except (ValueError, RecursionError) as err:
            raise P.ApiError(400, f"the request body is not valid JSON ({type(err).__name__}: {err})") from None

    def check_model(self, req) -> None:
        if req.model is not None and req.model != self.model_name:
            raise P.ApiError(404, f"model {req.model!r} is not served here (this server serves "
                                  f"{self.model_name!r})", "model", kind="not_found_error")

    def need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise P.ApiError(400, f"{what}: this server has no tokenizer; send token ids", what)

    # ---- the request's life ---------------------------------------------------------------------------------------
    async def admit(self, prompt: list[int], settings, prompt_field: str):
        try:
            ticket = self.loop.submit(prompt, settings)
        except QueueFull as err:
            if self.loop.metrics is not None:
                self.loop.metrics.rejected.labels(reason="queue_full").inc()
            raise P.ApiError(429, str(err)) from None
        except ServerClosed as err:
            raise P.ApiError(503, str(err)) from None
        try:
            first = await ticket.queue.get()
        except asyncio.CancelledError:
            self.loop.cancel(ticket)
            raise
        if isinstance(first, Rejected):
            if first.server_error:
                raise P.ApiError(500, first.message)
            raise P.engine_error(first.message, prompt_field)
        if isinstance(first, Delta):  # (aborted before it reached the engine: the server is closing)
            raise P.ApiError(503, "the server shut down before the request started")
        assert isinstance(first, Admitted)
        return ticket

    async def gather(self, request: Request, ticket) -> tuple[list[int], str, str]:
        """A non-streamed request's tokens, text and finish reason; a disconnect aborts it."""
        gone = asyncio.ensure_future(_disconnected(request))
        tokens, text = [], []
        try:
            while True:
                getter = asyncio.ensure_future(ticket.queue.get())
                done, _ = await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    self.loop.cancel(ticket)
                    raise asyncio.CancelledError("the client disconnected")
                item = getter.result()
                if isinstance(item, Rejected):
                    raise P.ApiError(500, item.message)
                tokens += item.token_ids
                text.append(item.text)
                if item.finish_reason is not None:
                    return tokens, "".join(text), item.finish_reason
        except asyncio.CancelledError:
            self.loop.cancel(ticket)
            raise
        finally:
            gone.cancel()

    async def stream(self, ticket, prompt_len: int, req, chat: bool):
        """The SSE chunks of one request (OpenAI's format; usage in the final chunk)."""
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        kind = "chat.completion.chunk" if chat else "text_completion"
        created, done, generated = int(time.time()), False, 0
        with_ids = req.return_token_ids
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        try:
            if chat:
                yield _sse(P.envelope(rid, kind, self.model_name,
                                      [P.chat_choice({"role": "assistant", "content": ""}, None, None,
                                                     [] if with_ids else None)], created))
            while True:
                item = await ticket.queue.get()
                if isinstance(item, Rejected):
                    done = True
                    yield _sse(P.error_body(item.message, "server_error", None, 500))
                    yield "data: [DONE]\n\n"
                    return
                generated += len(item.token_ids)
                end = item.finish_reason is not None
                if not (item.text or end or (with_ids and item.token_ids)):
                    continue  # (text held back for a possible stop string, nothing to say yet)
                ids = list(item.token_ids) if with_ids else None
                choice = P.chat_choice({"content": item.text}, None, item.finish_reason, ids) if chat else \
                    P.completion_choice(item.text, item.finish_reason, ids)
                use = P.usage(prompt_len, generated) if end else None
                yield _sse(P.envelope(rid, kind, self.model_name, [choice], created, use))
                if end:
                    done = True
                    if include_usage:  # (OpenAI's separate usage chunk, for clients that ask for it)
                        yield _sse(P.envelope(rid, kind, self.model_name, [], created, use))
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not done:  # the client went away (the generator was cancelled or closed)
                self.loop.cancel(ticket)

    async def respond(self, request: Request, req, prompt: list[int], max_tokens: int, chat: bool):
        field = "messages" if chat else "prompt"
        ticket = await self.admit(prompt, req.settings(max_tokens), field)
        if req.stream:
            return StreamingResponse(self.stream(ticket, len(prompt), req, chat), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        tokens, text, reason = await self.gather(request, ticket)
        ids = tokens if req.return_token_ids else None
        if chat:
            choice = P.chat_choice(None, {"role": "assistant", "content": text}, reason, ids)
            kind, rid = "chat.completion", P.new_id("chatcmpl")
        else:
            choice, kind, rid = P.completion_choice(text, reason, ids), "text_completion", P.new_id("cmpl")
        return JSONResponse(P.envelope(rid, kind, self.model_name, [choice], None,
                                       P.usage(len(prompt), len(tokens))))


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read already: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(loop: EngineLoop, model_name: str, *, api_key: str | None = None,
               max_body_bytes: int = 4 * 2 ** 20, chat_template: str | None = None) -> FastAPI:
    """The app around ``loop`` (started with the app, closed at its shutdown). ``model_name``: the id clients
    send as ``model`` (another id is a 404; none is fine). ``api_key``: bearer token the ``/v1`` routes require.
    ``chat_template``: a Jinja template that replaces the tokenizer's own."""
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"create_app: model_name must be a non-empty string, got {model_name!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("create_app: api_key must be a non-empty string or None")
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"create_app: max_body_bytes must be an integer >= 1, got {max_body_bytes!r}")
    server = _Server(loop, model_name, api_key, max_body_bytes, chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        loop.close()

    app = FastAPI(title="specdec serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(P.ApiError)
    async def api_error(request: Request, err: P.ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        return JSONResponse(P.ApiError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception):
        return JSONResponse(P.ApiError(500, f"internal error: {type(err).__name__}: {err}").body(), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request):
        server.authorize(request)
        req = P.parse_request(P.CompletionRequest, await server.read_json(request))
        server.check_model(req)
        prompt = req.prompt_form()
        if isinstance(prompt, str):
            server.need_tokenizer("prompt")
            prompt = text_ids(server.tokenizer, prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        return await server.respond(request, req, prompt, max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        server.authorize(request)
        req = P.parse_request(P.ChatCompletionRequest, await server.read_json(request))
        server.check_model(req)
        server.need_tokenizer("messages")
        try:
            prompt = chat_ids(server.tokenizer, [m.as_template_input() for m in req.messages])
        except ValueError as err:
            raise P.ApiError(400, str(err), "messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # the rest of the context
            max_tokens = server.context - len(prompt)
            if max_tokens < 1:
                raise P.ApiError(400, f"messages: the prompt ({len(prompt)} tokens) leaves no room in the context "
                                      f"of {server.context} tokens", "messages")
        return await server.respond(request, req, prompt, max_tokens, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        server.authorize(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created,
                                            "owned_by": "specdec", "max_model_len": server.context}]}

    @app.get("/health")
    async def health():
        if loop.failure is not None:
            return JSONResponse({"status": "failed", "error": loop.failure}, status_code=503)
        if not loop.admitting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        if loop.metrics is None:
            raise P.ApiError(404, "this server keeps no metrics")
        return Response(loop.metrics.render(), media_type=CONTENT_TYPE)

    return app


class DrainingServer(uvicorn.Server):
    """uvicorn's server that stops ``loop`` admitting requests at SIGTERM / SIGINT (new ones get 503), before its
    graceful shutdown lets the running ones finish (``timeout_graceful_shutdown``) and aborts what is left."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop):
        super().__init__(config)
        self.engine_loop = loop

    def handle_exit(self, sig: int, frame) -> None:
        if sig in (signal.SIGTERM, signal.SIGINT):
            self.engine_loop.stop_admitting()
        super().handle_exit(sig, frame)


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0, **config):
    """Serves ``app`` with uvicorn in a thread of this process (tests, benchmarks) until the block ends; yields its
    URL. ``port`` 0: a free one. ``config``: more ``uvicorn.Config`` settings."""
    config = {"log_level": "warning", "access_log": False, "timeout_graceful_shutdown": 5, **config}
    # (uvicorn binds the port itself: on a socket handed to it with sockets=, keep-alive requests waited ~40 ms)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, **config))
    thread = threading.Thread(target=server.run, name="specdec-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("serve_in_thread: the server did not start")
            time.sleep(0.01)
        bound = server.servers[0].sockets[0].getsockname()
        yield f"http://{host}:{bound[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError("serve_in_thread: the server did not stop")
