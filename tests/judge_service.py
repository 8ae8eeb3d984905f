"""A judge on loopback for tests: an OpenAI-compatible ``/v1/chat/completions`` whose answer to each request is
``answer(messages)`` (a text, or an int: that HTTP status), recording every request body."""

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class JudgeService:
    def __init__(self, answer: Callable[[list[dict[str, str]]], str | int]) -> None:
        self.answer = answer
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service.lock:
                    service.requests.append({**body, "authorization": self.headers.get("Authorization")})
                answer = service.answer(body["messages"])
                if isinstance(answer, int):
                    self.send_response(answer)
                    self.end_headers()
                    return
                data = json.dumps({
                    "id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
                }).encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
