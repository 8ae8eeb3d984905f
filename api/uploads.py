"""Refuse oversized uploads before they are read: a declared ``Content-Length`` over the limit is answered
413 at once, and a body that streams past it (chunked uploads) is cut off with 413."""

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_response

MULTIPART_SLACK = 64 * 1024
"""Room for the multipart framing and the other form fields around the file itself."""


class UploadSizeLimit:
    def __init__(self, app: ASGIApp, path: str, max_bytes: int) -> None:
        self.app, self.path, self.limit = app, path, max_bytes + MULTIPART_SLACK
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].rstrip("/") != self.path:
            await self.app(scope, receive, send)
            return
        message = f"the upload is larger than the limit of {self.max_bytes} bytes"
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await error_response(413, "file_too_large", message, param="file")(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            chunk = await receive()
            if chunk["type"] == "http.request":
                received += len(chunk.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413, message)  # answered by the error handlers as file_too_large
            return chunk

        await self.app(scope, limited_receive, send)
