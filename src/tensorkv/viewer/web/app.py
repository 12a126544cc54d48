"""The web viewer's ASGI app: a read-only JSON API under ``/api/`` and the static pages.

:func:`create_app` opens the store once, read-only, and answers only GET and HEAD: every
other method gets 405, whatever the path. Nothing but the store given here is reachable:
no endpoint takes a URL or a file path, and the static files are served from the package's
``static/`` folder by Starlette's ``StaticFiles`` (which refuses paths outside it). Pages set
every text from the store with ``textContent`` and the Content-Security-Policy allows scripts
from this server only. Requests whose ``Host`` is not the bound loopback name are refused
(DNS rebinding) unless the app serves remote clients on purpose.

Every request's parameters are bounded before an endpoint reads them
(:func:`tensorkv.viewer.web.api.check_params`); a query's error is one line of JSON with the
status :func:`status_of` gives it, and an unexpected exception (a bug) a 500 with one line,
its traceback going to this module's logger (``TENSORKV_DEBUG=1`` lets it propagate).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np

from tensorkv.errors import TensorKVError, import_optional
from tensorkv.stores.base import KVStore

STATIC_DIR = Path(__file__).resolve().parent / "static"
_log = logging.getLogger(__name__)

#: Hosts a loopback-bound viewer answers (the Host header, port excluded).
LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "::1"]

_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_READ_METHODS = frozenset({"GET", "HEAD"})


def jsonable(x: Any) -> Any:
    """``x`` with numpy values turned into JSON types; NaN and Inf become strings.

    Keys (int64/uint64) become strings: JavaScript numbers hold integers exactly only up to
    2**53, so the pages keep keys as text. Callers mark key arrays by passing them as numpy
    integer arrays of 64 bits; other integer arrays become numbers.
    """
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        if x.dtype.kind == "f" or x.dtype.kind == "V" or x.dtype.kind == "c":
            return _floats(np.asarray(x, dtype=np.float64))
        if x.dtype.kind in "iu":
            return x.tolist()
        return jsonable(x.tolist())
    if isinstance(x, np.generic):
        return jsonable(x.item())
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Inf" if x > 0 else "-Inf")
    return x


def _floats(a: np.ndarray) -> Any:
    if np.isfinite(a).all():
        return a.tolist()
    out = a.astype(object)
    out[np.isnan(a)] = "NaN"
    out[np.isposinf(a)] = "Inf"
    out[np.isneginf(a)] = "-Inf"
    return out.tolist()


def host_of(header: str) -> str:
    """The host of a ``Host`` header, without its port or IPv6 brackets, lower case."""
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:8737
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def status_of(exc: BaseException) -> int:
    """The HTTP status for an error a query raised: 404 for what does not exist, else 400."""
    if isinstance(exc, (KeyError, LookupError, FileNotFoundError)):
        return 404
    if isinstance(exc, (ValueError, TypeError)):
        return 400
    if isinstance(exc, ConnectionError | TimeoutError):
        return 503
    return 500


def create_app(url: str | KVStore, *, tag: str | None = None,
               allowed_hosts: list[str] | None = None) -> Any:
    """The Starlette app of the viewer over the store at ``url``.

    Parameters
    ----------
    url
        The store URL (opened here, read-only) or an open store (left open).
    tag
        The tag pages open on (default: the latest).
    allowed_hosts
        ``Host`` header values answered (default: loopback names only); ``["*"]`` for any.
    """
    starlette = import_optional("starlette", "the web viewer", "view")
    del starlette
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
    from starlette.routing import BaseRoute, Mount, Route
    from starlette.staticfiles import StaticFiles

    from tensorkv.viewer.web import api

    if isinstance(url, KVStore):
        store, owned = url, False
    else:
        from tensorkv.stores import open_store

        store, owned = open_store(url, readonly=True, create=False), True
    state = api.ViewerState(store, default_tag=tag)
    debug = bool(os.environ.get("TENSORKV_DEBUG"))

    def endpoint(fn: Callable[[api.ViewerState, dict[str, str]], Any]) -> Callable[..., Any]:
        def run(request: Request) -> Response:
            try:
                body = fn(state, api.check_params(dict(request.query_params)))
            except TensorKVError as exc:
                return JSONResponse({"error": " ".join(str(exc).split())},
                                    status_code=status_of(exc))
            except Exception as exc:  # a bug: one line to the client, the traceback to the log
                if debug:
                    raise
                _log.exception("viewer request %s failed", request.url.path)
                text = " ".join(str(exc).split())[:200]
                return JSONResponse({"error": f"unexpected {type(exc).__name__}: {text} (a bug "
                                              "of the viewer: the server's log has the "
                                              "traceback; please report it)"},
                                    status_code=500)
            return Response(json.dumps(jsonable(body), separators=(",", ":")),
                            media_type="application/json")

        return run

    def index(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    def not_found(request: Request) -> Response:
        return JSONResponse({"error": f"no API endpoint {request.url.path!r}; the endpoints "
                                      f"are {sorted(api.ENDPOINTS)}"}, status_code=404)

    routes: list[BaseRoute] = [Route("/", index, methods=["GET"])]
    routes += [Route(f"/api/{name}", endpoint(fn), methods=["GET"])
               for name, fn in api.ENDPOINTS.items()]
    routes += [Route("/api/{rest:path}", not_found, methods=["GET"]),
               Mount("/static", StaticFiles(directory=STATIC_DIR, follow_symlink=False),
                     name="static")]

    hosts = {host_of(h) for h in (allowed_hosts if allowed_hosts is not None
                                  else LOOPBACK_HOSTS)}

    class ReadOnly:
        """Refuse every method but GET and HEAD and foreign Host headers; add the headers."""

        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                           send: Callable[[Any], Awaitable[None]]) -> None:
            if scope["type"] != "http":
                await self.app(scope, receive, send)
                return
            header = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
            if "*" not in hosts and host_of(header) not in hosts:
                refusal = PlainTextResponse(
                    f"Host {header!r} refused: this viewer answers requests addressed to "
                    f"{', '.join(sorted(hosts))} only", status_code=400)
                await refusal(scope, receive, send)
                return
            if scope["method"] not in _READ_METHODS:
                refusal = PlainTextResponse(
                    f"{scope['method']} refused: the viewer is read-only (GET and HEAD only)",
                    status_code=405, headers={"Allow": "GET, HEAD"})
                await refusal(scope, receive, send)
                return

            async def send_with_headers(message: Any) -> None:
                if message["type"] == "http.response.start":
                    headers = list(message.get("headers", []))
                    have = {k.lower() for k, _ in headers}
                    headers += [(k.lower().encode(), v.encode()) for k, v in _HEADERS.items()
                                if k.lower().encode() not in have]
                    message = {**message, "headers": headers}
                await send(message)

            await self.app(scope, receive, send_with_headers)

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        yield
        state.close()
        if owned:
            store.close()

    app = Starlette(
        debug=debug,
        routes=routes,
        middleware=[Middleware(ReadOnly)],
        lifespan=lifespan,
    )
    app.state.viewer = state
    return app
