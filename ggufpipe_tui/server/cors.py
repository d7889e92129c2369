"""CORS for a browser front end on another origin (``--cors-origin``).

Off by default: a page from any site a user visits could otherwise send
requests to a server that has no API key (one on localhost, say) and read
the answers. With origins allowed (``*``: any), this middleware

* answers a preflight (``OPTIONS`` with ``Access-Control-Request-Method``)
  itself, before the API key is checked (a preflight never carries the
  key): a 204 with ``Access-Control-Allow-Origin``, ``-Allow-Methods``,
  ``-Allow-Headers`` (the ones asked for: ``Authorization``,
  ``anthropic-version``, ``x-api-key``, ...) and ``-Max-Age``; an origin not
  allowed gets a 403 that names it;
* gives every answer to an allowed origin ``Access-Control-Allow-Origin``
  (``*``, or the origin echoed with ``Vary: Origin``) and exposes the
  headers a client may want to read (``X-Ggufpipe-Run``, ``Retry-After``).
  The headers are added as a response is prepared (``on_response_prepare``),
  so error answers and server-sent event streams, whose headers go out
  before their handler returns, carry them too. An origin not allowed gets
  no CORS headers: the browser keeps the answer from its page.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

from ggufpipe_tui.server.fields import error_body

#: How long a browser may keep a preflight's answer (seconds; Chrome keeps at most 7200).
MAX_AGE = 600
METHODS = "GET, POST, OPTIONS"
#: Headers a script may read from an answer.
EXPOSED = "X-Ggufpipe-Run, Retry-After, Process-Start-Time-Unix"
#: Asked for when a preflight names none: what the APIs' clients send.
DEFAULT_HEADERS = "Authorization, Content-Type, anthropic-version, x-api-key"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Cors:
    """The allowed origins; ``*`` allows any."""

    def __init__(self, origins: Sequence[str]) -> None:
        self.any = "*" in origins
        self.origins = frozenset(origin.rstrip("/") for origin in origins if origin != "*")

    def allows(self, origin: str) -> bool:
        return self.any or origin in self.origins

    def allow_origin(self, origin: str) -> dict[str, str]:
        if self.any:
            return {"Access-Control-Allow-Origin": "*"}
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Preflights answered here; anything else goes on (put it first)."""
        origin = request.headers.get("Origin", "")
        method = request.headers.get("Access-Control-Request-Method", "")
        if request.method != "OPTIONS" or not origin or not method:
            return await handler(request)
        if not self.allows(origin):
            message = f"CORS: the origin {origin!r} is not allowed (--cors-origin)"
            return web.json_response(error_body(message, "forbidden_error"), status=403)
        asked = request.headers.get("Access-Control-Request-Headers", "")
        headers = self.allow_origin(origin) | {
            "Access-Control-Allow-Methods": METHODS,
            "Access-Control-Allow-Headers": asked or DEFAULT_HEADERS,
            "Access-Control-Max-Age": str(MAX_AGE),
        }
        if not self.any:
            headers["Vary"] = "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"
        return web.Response(status=204, headers=headers)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every answer to an allowed origin says so, as its headers go out."""
        origin = request.headers.get("Origin", "")
        if not origin or not self.allows(origin) or "Access-Control-Allow-Origin" in response.headers:
            return
        for name, value in self.allow_origin(origin).items():
            if name == "Vary" and "Vary" in response.headers:
                response.headers["Vary"] = f"{response.headers['Vary']}, {value}"
            else:
                response.headers[name] = value
        response.headers["Access-Control-Expose-Headers"] = EXPOSED


def install(app: web.Application, origins: Sequence[str]) -> Cors | None:
    """CORS on ``app`` for ``origins`` (none: off, nothing changes): its
    middleware first of all, before the API key is checked, and its header
    hook. Call it before the app starts."""
    if not origins:
        return None
    cors = Cors(origins)
    app.middlewares.insert(0, cors.middleware)
    app.on_response_prepare.append(cors.on_prepare)
    return cors
