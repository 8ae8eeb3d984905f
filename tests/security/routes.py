"""The routes the security tests walk."""

from fastapi import FastAPI
from starlette.routing import Route

PUBLIC = {"/healthz", "/readyz"}
"""Answer without a key: load balancers and orchestrators probe them."""
DOCS = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
"""The API's description (static: no data of any project); Swagger UI could not load it with a key."""


def every_route(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every operation of the OpenAPI document, and of the documentation routes."""
    found = [
        (method.upper(), path) for path, item in app.openapi()["paths"].items() for method in item if method != "head"
    ]
    for route in app.routes:
        if type(route) is Route:  # not an APIRoute: the documentation FastAPI adds
            assert route.path in DOCS, route.path
            found += [(method, route.path) for method in sorted(route.methods or ()) if method != "HEAD"]
        else:
            assert getattr(route, "include_in_schema", True), route  # a hidden route would escape this walk
    return found


def concrete(path: str) -> str:
    return path.replace("{job_id}", "job_0123456789ab").replace("{file_id}", "file-0123456789ab")
