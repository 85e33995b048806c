"""The server's HTTP boundary: what is refused before a route reads a request, and how.

- ``Guard`` (ASGI middleware, outermost): the Host and Origin checks. A server on a loopback
  address answers only Host names of this machine, so a DNS-rebound name (evil.example resolving
  to 127.0.0.1) cannot read its answers from a browser; and a request carrying an Origin (a web
  page's fetch) is refused unless that origin is allowed, as llama.cpp's server and Ollama do.
- ``read_json``: a POST body is application/json (a page can send text/plain cross-origin without
  asking first; JSON needs a CORS preflight), within the size limit, received within the body
  timeout, abandoned when the server closes, and Unicode text throughout.
Every refusal is the OpenAI envelope, rendered ASCII-only so no text a client sent can break it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from .protocol import APIError, check_text, printable, shutting_down

ANY = "*"


class ErrorResponse(JSONResponse):
    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(err: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if err.status == 429 else None
    return ErrorResponse(err.envelope(), status_code=err.status, headers=headers)


class ClientGone(Exception):
    """The client disconnected before it sent its whole body: nobody reads an answer."""


def hostname(host: str) -> str:
    """The name in a Host header value, without the port: ``[::1]:8000`` -> ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: always this machine
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class Guard:
    """Refuses requests whose Host or Origin is not allowed (module docstring).

    allowed_hosts: None = loopback names only; else loopback names plus these (``*``: any).
    allowed_origins: origins a browser may call from (``*``: any); they get CORS headers.
    """

    def __init__(self, app, allowed_hosts: Sequence[str] | None, allowed_origins: Sequence[str]) -> None:
        self.hosts = None if allowed_hosts is None or ANY in allowed_hosts else {h.lower() for h in allowed_hosts}
        self.any_host = allowed_hosts is not None and ANY in allowed_hosts
        self.origins = {o.lower().rstrip("/") for o in allowed_origins}
        self.app = app
        if self.origins:
            self.app = CORSMiddleware(
                app,
                allow_origins=list(allowed_origins) if ANY not in self.origins else [ANY],
                allow_methods=["GET", "POST"],
                allow_headers=["authorization", "content-type"],
            )

    def refusal(self, headers: Headers) -> APIError | None:
        host = headers.get("host", "")
        name = hostname(host)
        if not self.any_host and not is_loopback(name) and name not in (self.hosts or ()):
            return APIError(
                403,
                f"Host {printable(host)} is not allowed: this server answers its loopback names only; "
                "add the name to --allowed-hosts to serve it",
                code="host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and ANY not in self.origins and origin.lower().rstrip("/") not in self.origins:
            return APIError(
                403,
                f"Origin {printable(origin)} is not allowed: a web page may call this server only from "
                "an origin listed in --allowed-origins",
                code="origin_not_allowed",
            )
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = self.refusal(Headers(scope=scope))
            if error is not None:
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_content_type(headers: Headers) -> None:
    given = headers.get("content-type")
    if given is None or given.split(";")[0].strip().lower() != "application/json":
        raise APIError(
            415,
            f"Content-Type {printable(given or '')}: request bodies must be application/json",
            code="unsupported_media_type",
        )


async def receive_body(receive, limit: int) -> bytes:
    data = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        data += message.get("body", b"")
        if len(data) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        if not message.get("more_body", False):
            return bytes(data)


async def read_json(request, limit: int, timeout: float, closing: asyncio.Event):
    """The request's JSON body, checked (module docstring), or the APIError that answers it."""
    check_content_type(request.headers)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    reading = asyncio.ensure_future(receive_body(request.receive, limit))
    closed = asyncio.ensure_future(closing.wait())
    try:
        await asyncio.wait({reading, closed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        closed.cancel()
        if not reading.done():
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
    if not reading.done() or reading.cancelled():
        if closing.is_set():
            raise shutting_down()
        raise APIError(408, f"the request body was not received within {timeout:g} s", code="request_timeout")
    data = reading.result()  # raises its APIError (413) or ClientGone
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from err
    except RecursionError as err:
        raise APIError(400, "the request body is not valid JSON: nested too deeply") from err
    check_text(body)
    return body
