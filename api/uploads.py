"""Refuse oversized request bodies before they are read.

A declared ``Content-Length`` over the limit is answered 413 at once, without reading a byte of the body;
a body that streams past it (chunked transfer) is cut off with 413 as soon as it does. Dataset uploads
(``POST /v1/files``) may be as large as ``max_upload_bytes``; every other body (a job spec, a generate
request) at most ``max_request_bytes``.
"""

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import BodyTooLarge, error_response

MULTIPART_SLACK = 64 * 1024
"""Room for the multipart framing and the other form fields around the file itself."""


class BodySizeLimit:
    def __init__(self, app: ASGIApp, *, upload_path: str, max_upload_bytes: int, max_request_bytes: int) -> None:
        self.app = app
        self.upload_path = upload_path
        self.max_upload_bytes = max_upload_bytes
        self.max_request_bytes = max_request_bytes

    def _limit(self, scope: Scope) -> tuple[int, str, str, str | None]:
        """(bytes allowed, error code, message, param) for this request."""
        if scope["method"] == "POST" and scope["path"].rstrip("/") == self.upload_path:
            message = f"the upload is larger than the limit of {self.max_upload_bytes} bytes"
            return self.max_upload_bytes + MULTIPART_SLACK, "file_too_large", message, "file"
        message = f"the request body is larger than the limit of {self.max_request_bytes} bytes"
        return self.max_request_bytes, "request_too_large", message, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, code, message, param = self._limit(scope)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            await error_response(413, code, message, param=param)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            chunk = await receive()
            if chunk["type"] == "http.request":
                received += len(chunk.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(code, message, param)  # answered by the error handlers
            return chunk

        await self.app(scope, limited_receive, send)
