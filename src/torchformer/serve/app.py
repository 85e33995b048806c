"""The ASGI app (Starlette): OpenAI routes, errors always in the OpenAI envelope.

The app never touches tensors: it validates a request (protocol.py), encodes the prompt, hands
the ids to the engine and turns the engine's events (arriving from its thread through
delivery.py's Mailbox) into a response or a ``text/event-stream``. A client that goes away
cancels its request, which frees the row at the engine's next step. boundary.py's Guard wraps
every route (Host and Origin), and reads every body (content type, size, time, text).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
import time
from collections.abc import Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from .boundary import ClientGone, Guard, error_response, read_json
from .chat import ChatTemplate
from .delivery import EventStream, Mailbox, sse
from .embeddings import embedding_request, embedding_response, token_rows, wrong_task
from .engine import Engine
from .jobs import Delta, Done, Failed, Prompt
from .protocol import APIError, chat_request, completion_request
from .responses import ChatShape, Choice, CompletionShape, usage
from .tool_formats import FORMATS, detect
from .tools import tool_request

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20
BODY_TIMEOUT = 30.0  # seconds to receive a request body once its headers are in


class Server:
    def __init__(
        self,
        engine: Engine,
        model_name: str,
        chat: ChatTemplate | None,
        api_key: str | None,
        max_body_bytes: int,
        body_timeout: float,
    ) -> None:
        self.engine, self.model_name, self.chat = engine, model_name, chat
        self.api_key, self.max_body_bytes, self.body_timeout = api_key, max_body_bytes, body_timeout
        self.started = int(time.time())
        self.mailbox: Mailbox | None = None  # made on the first request, on the server's event loop
        self.tool_format: str | None = None  # tool-call syntax (tool_formats.py); None: the template's
        self.token_texts: dict[int, str] = {}  # token_text's, at most one a vocabulary entry
        self.closing = asyncio.Event()

    def close(self, grace: float) -> None:
        """Shutting down (on the event loop): body reads stop, the engine admits nothing more and
        ends what still runs after ``grace`` seconds (Engine.drain)."""
        self.closing.set()
        self.engine.drain(grace)

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        # The scheme is case-insensitive (RFC 7235 section 2.1); compare_digest: the time taken
        # does not reveal how much of the key matched.
        key_ok = hmac.compare_digest(given.strip().encode(), self.api_key.encode())
        if scheme.lower() != "bearer" or not key_ok:
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer KEY", code="invalid_api_key")

    async def body(self, request: Request) -> dict:
        return await read_json(request, self.max_body_bytes, self.body_timeout, self.closing)

    async def completions(self, request: Request):
        prompt, params = completion_request(await self.body(request), self.model_name)
        self.require_ready()
        ids = self.engine.texts.encode(prompt)
        echo = (prompt if isinstance(prompt, str) else self.engine.texts.decode(ids)) if params.echo else ""
        shape = CompletionShape(self.model_name, ids, params.return_token_ids, self.token_text)
        return await self.respond(request, ids, params, shape, echo)

    async def chat_completions(self, request: Request):
        body = await self.body(request)
        messages, params = chat_request(body, self.model_name)
        tools = tool_request(body)
        self.require_ready()
        if self.chat is None or self.engine.texts.tokenizer is None:
            raise APIError(
                400,
                "this model has no chat template (chat_template.jinja or tokenizer_config.json's "
                "chat_template): use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        fmt = None
        if tools is not None:  # the family's call syntax: --tool-call-format, else the template's
            fmt = self.tool_format or detect(self.chat.source)
            if (grammar := tools.grammar(fmt)) is not None:  # required / named: the call is constrained
                params = dataclasses.replace(params, response_format=grammar)
        text = self.chat.render(messages, None if tools is None else tools.listed)
        ids = self.engine.texts.encode(text, param="messages")
        shape = ChatShape(self.model_name, ids, params.return_token_ids, self.token_text, tool_format=fmt)
        return await self.respond(request, ids, params, shape)

    async def embeddings(self, request: Request):
        items, fmt = embedding_request(await self.body(request), self.model_name)
        self.require_ready("embed")
        rows = token_rows(items, self.engine.texts.tokenizer, self.engine.texts.vocab_size, self.engine.context)
        vectors = await asyncio.wrap_future(self.engine.embed(rows))
        return JSONResponse(embedding_response(vectors, fmt, self.model_name, sum(map(len, rows))))

    def token_text(self, token: int) -> str:
        """One id's text, for logprobs (each token and its alternatives: k + 1 a token), decoded
        once per id: the server's event loop shares the GIL with the engine thread."""
        if (text := self.token_texts.get(token)) is None:
            text = self.token_texts[token] = self.engine.texts.decode([token])
        return text

    def require_ready(self, task: str = "generate") -> None:
        """A 503 until the engine runs; a 400 for a route its model does not serve."""
        if not self.engine.healthy:
            raise APIError(503, f"not ready: {self.engine.state()}", type="server_error", code="not_ready")
        if self.engine.task != task:
            raise wrong_task(self.engine.task)

    async def respond(self, request: Request, ids: list[int], params, shape: CompletionShape, echo: str = ""):
        queue = asyncio.Queue()
        if self.mailbox is None:
            self.mailbox = Mailbox(asyncio.get_running_loop())
        grammar = None
        if params.response_format is not None:  # compiling a new schema may take seconds: off the loop
            grammar = await asyncio.to_thread(self.engine.grammar, params.response_format)
        job = self.engine.submit(ids, params, functools.partial(self.mailbox.post, queue), grammar)
        if params.stream:
            return EventStream(
                functools.partial(self.engine.cancel, job),
                self.stream(queue, shape, params, echo),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        watcher = asyncio.create_task(self.watch_disconnect(request, job, queue))
        wanted = params.logprobs is not None
        choices = [Choice(i, shape.new_logprobs() if wanted else None) for i in range(params.n)]
        try:
            while not all(c.done for c in choices):
                event = await queue.get()
                if event is None:  # the client went away; nobody reads this answer
                    return PlainTextResponse("", status_code=499)
                if isinstance(event, Failed):
                    return error_response(event.error)
                choices[event.index].add(event, echo)
            use = usage(len(ids), sum(c.done.completion_tokens for c in choices), choices[0].done.cached_tokens)
            return JSONResponse(shape.full(choices, use))
        finally:
            watcher.cancel()

    async def watch_disconnect(self, request: Request, job, queue: asyncio.Queue) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.engine.cancel(job)
        queue.put_nowait(None)

    async def stream(self, queue: asyncio.Queue, shape: CompletionShape, params, echo: str):
        """The SSE body; EventStream cancels the request if this stops early (a disconnect)."""
        formats = [shape.new_logprobs() if params.logprobs is not None else None for _ in range(params.n)]
        for index in range(params.n):
            first = shape.first(index, params.include_usage)
            if first is not None:
                yield sse(first)
        done, completion_tokens, cached = 0, 0, 0
        while done < params.n:
            event = await queue.get()
            if isinstance(event, Failed):  # the OpenAI client raises APIError on an "error" event
                yield sse(event.error.envelope())
                yield sse("[DONE]")
                return
            i, logprobs = event.index, formats[event.index]
            if isinstance(event, Prompt | Delta):
                text, calls = (echo, []) if isinstance(event, Prompt) else shape.streamed(i, event.text)
                part = None if logprobs is None else logprobs.add(event.logprobs)
                ids = event.token_ids if isinstance(event, Delta) else None
                if text or calls or part is not None or (params.return_token_ids and ids):
                    yield sse(shape.chunk(i, text, ids, None, params.include_usage, part, calls))
            elif isinstance(event, Done):
                done, completion_tokens = done + 1, completion_tokens + event.completion_tokens
                cached = event.cached_tokens
                for body in shape.closing(i, event.finish_reason, params.include_usage):
                    yield sse(body)
        if params.include_usage:
            yield sse(shape.usage_chunk(usage(len(shape.prompt_ids), completion_tokens, cached)))
        yield sse("[DONE]")

    async def models(self, request: Request):
        card = {"id": self.model_name, "object": "model", "created": self.started, "owned_by": "torchformer"}
        if self.engine.context:  # vLLM's field: prompt + max_tokens may not exceed it (known once chosen)
            card["max_model_len"] = self.engine.context
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request):
        healthy = self.engine.healthy
        return JSONResponse({"status": self.engine.state()}, status_code=200 if healthy else 503)

    async def metrics(self, request: Request):
        e = self.engine
        text = e.metrics.render(e.running, len(e.waiting), e.kv_usage)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def route(self, path: str, handler, method: str, public: bool = False) -> Route:
        async def endpoint(request: Request):
            try:
                if not public:
                    self.authorize(request)
                return await handler(request)
            except APIError as err:
                return error_response(err)
            except ClientGone:  # nobody reads an answer: no error, nothing to log but this
                log.debug("%s: the client went away while sending its body", path)
                return PlainTextResponse("", status_code=499)
            except Exception as err:  # noqa: BLE001 - never a framework error page
                log.exception("unhandled error in %s", path)
                message = f"internal error ({type(err).__name__}); see the server log"
                return error_response(APIError(500, message, type="server_error"))

        return Route(path, endpoint, methods=[method])


def create_app(
    engine: Engine,
    model_name: str,
    chat: ChatTemplate | None = None,
    *,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout: float = BODY_TIMEOUT,
    allowed_hosts: Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
    tool_call_format: str | None = None,
) -> Guard:
    """The ASGI app. allowed_hosts: None = loopback Host names only, ["*"] = any (boundary.Guard);
    allowed_origins: web origins that may call it; tool_call_format: how the model writes tool
    calls (tool_formats.FORMATS; None: found from the chat template). ``app.server.close(grace)``
    starts a shutdown."""
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes!r}: must be an integer >= 1")
    if not body_timeout > 0:
        raise ValueError(f"body_timeout={body_timeout!r}: must be > 0 seconds")
    if tool_call_format is not None and tool_call_format not in FORMATS:
        raise ValueError(f"tool_call_format={tool_call_format!r}: must be one of {sorted(FORMATS)} or None")
    s = Server(engine, model_name, chat, api_key, max_body_bytes, body_timeout)
    s.tool_format = tool_call_format
    routes = [
        s.route("/v1/completions", s.completions, "POST"),
        s.route("/v1/chat/completions", s.chat_completions, "POST"),
        s.route("/v1/embeddings", s.embeddings, "POST"),
        s.route("/v1/models", s.models, "GET"),
        s.route("/metrics", s.metrics, "GET"),
        s.route("/health", s.health, "GET", public=True),
    ]

    async def http_error(request: Request, exc: HTTPException):  # 404 / 405 in the OpenAI envelope
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    app = Guard(
        Starlette(routes=routes, exception_handlers={HTTPException: http_error}), allowed_hosts, allowed_origins
    )
    app.server = s
    return app
