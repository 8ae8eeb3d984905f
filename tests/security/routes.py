"""The routes the security tests walk."""

from collections.abc import Iterator

from fastapi import FastAPI
from starlette.routing import BaseRoute, Route

from api.routes import dashboard

PUBLIC = {"/healthz", "/readyz", "/api/v1/healthz"}
"""Answer without a key: load balancers and orchestrators probe them (the last one the tinker SDK)."""
TINKER = "/api/v1/"
"""The Tinker-compatible routes' prefix: authenticated by the SDK's ``X-API-Key: tml-<key>``, not a bearer token."""
DOCS = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
"""The API's description (static: no data of any project); Swagger UI could not load it with a key."""
DASHBOARD = dashboard.PATHS
"""The web dashboard's page and assets (static: no data of any project), outside the OpenAPI document; the only
hidden routes, and walked by ``dashboard_routes`` instead."""


def every_route(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every operation of the OpenAPI document, and of the documentation routes."""
    found = [
        (method.upper(), path) for path, item in app.openapi()["paths"].items() for method in item if method != "head"
    ]
    for route in leaf_routes(app.routes):
        if type(route) is Route:  # not an APIRoute: the documentation FastAPI adds
            assert route.path in DOCS, route.path
            found += [(method, route.path) for method in sorted(route.methods or ()) if method != "HEAD"]
        elif getattr(route, "path", None) not in DASHBOARD:
            assert getattr(route, "include_in_schema", True), route  # a hidden route would escape this walk
    return found


def leaf_routes(routes: list[BaseRoute]) -> Iterator[BaseRoute]:
    """Every route, with included routers walked into: newer FastAPI versions keep an included router as one entry of
    ``app.routes`` whose ``effective_candidates()`` are its routes, prefixed (older versions copy them in)."""
    for route in routes:
        if callable(getattr(type(route), "effective_candidates", None)):
            yield from leaf_routes(route.effective_candidates())  # type: ignore[attr-defined]
        else:
            yield route


def dashboard_routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, concrete path) of the dashboard's routes: they answer without a key."""
    found = []
    for route in leaf_routes(app.routes):
        path = getattr(route, "path", None)
        if path in DASHBOARD:
            assert not getattr(route, "include_in_schema", True), route
            concrete_path = path.replace("{name}", "app.js")
            found += [(method, concrete_path) for method in sorted(getattr(route, "methods", ())) if method != "HEAD"]
    assert {path for _, path in found} == {"/", "/static/app.js"}, found
    return found


def concrete(path: str) -> str:
    return path.replace("{job_id}", "job_0123456789ab").replace("{file_id}", "file-0123456789ab")
