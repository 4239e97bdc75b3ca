"""pdserve_http_requests_total{route, status}: every HTTP answer of the OpenAI front, counted by the route template it
reached and its status code. Pure ASGI around everything else (the Envelope's own 400 and 401 included), so a storm
of refusals shows up as one moving series, not as nothing.

The route label is a template of the application's own routes; any other path is `other`. A client can make up any
number of paths, and none of them may become a series."""
from __future__ import annotations

import asyncio

from ...common.metrics import HTTP_OTHER_ROUTE, HTTP_REQUESTS, HTTP_STATUSES

GONE = 499  # the client left before an answer began (nginx's code; also what the app answers a client that left)


class RouteLabels:
    """Path -> route template, over an application's routes: exact paths in a dict, templated ones
    (/v1/models/{model}) by their regex, anything else `other`."""

    def __init__(self, routes):
        self.exact: dict[str, str] = {}
        self.templated = []
        for r in routes:
            path = getattr(r, "path", None)
            if path is None or not hasattr(r, "path_regex"):
                continue
            if "{" in path:
                self.templated.append((r.path_regex, path))
            else:
                self.exact[path] = path

    @property
    def templates(self) -> list[str]:
        return [*self.exact, *(t for _, t in self.templated)]

    def of(self, path: str) -> str:
        if path in self.exact:
            return self.exact[path]
        for regex, template in self.templated:
            if regex.match(path):
                return template
        return HTTP_OTHER_ROUTE


class CountRequests:
    """Counts each HTTP request once its answer is decided: the status its response started with; 499 when it was
    cancelled before one (the client left), 500 when the application failed before one (uvicorn then answers 500)."""

    def __init__(self, app, routes: RouteLabels):
        self.app, self.routes = app, routes
        for route in [*routes.templates, HTTP_OTHER_ROUTE]:  # a route the app gained since HTTP_ROUTES: at 0 too
            for status in HTTP_STATUSES:
                HTTP_REQUESTS.labels(route, status)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None

        async def send_counted(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_counted)
        except asyncio.CancelledError:
            status = status or GONE
            raise
        except Exception:
            status = status or 500
            raise
        finally:
            HTTP_REQUESTS.labels(self.routes.of(scope["path"]), str(status or 500)).inc()
