"""The web dashboard: ``GET /`` (the app shell and sign-in page) and ``GET /static/<name>`` (its scripts and
styles, from ``api/static``). Both answer without a key: they hold no data of any project. Every data call the
page makes goes to ``/v1`` with the key the user signs in with, so the API's own checks apply unchanged.

The routes are left out of the OpenAPI document (they are not part of the API). Only the files that ship in
``api/static`` are served, by exact name: no path from the request ever reaches the file system.
"""

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from api.errors import ApiError

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".txt": "text/plain; charset=utf-8",
}

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",  # no inline scripts, no eval
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)

SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: a new version of the service serves new assets at once
}

ASSETS: dict[str, Path] = {
    path.name: path
    for path in sorted(STATIC_DIR.iterdir())
    if path.is_file() and path.suffix in CONTENT_TYPES and path.name != "index.html"
}
"""Served file name → file: fixed when the module loads."""

router = APIRouter(include_in_schema=False)

PATHS = frozenset({"/", "/static/{name}"})
"""The dashboard's routes (the security tests exempt exactly these from authentication)."""


def _file(path: Path) -> Response:
    return Response(path.read_bytes(), media_type=CONTENT_TYPES[path.suffix], headers=SECURITY_HEADERS)


@router.get("/")
def dashboard() -> Response:
    """The dashboard's single page."""
    return _file(STATIC_DIR / "index.html")


@router.get("/static/{name}")
def static_asset(name: str) -> Response:
    path = ASSETS.get(name)
    if path is None:
        raise ApiError(404, "not_found", f"no dashboard asset {name!r}")
    return _file(path)
