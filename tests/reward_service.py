"""A reward service on loopback for tests, speaking OpenRLHF's remote reward protocol (``query``, ``prompts``,
``labels`` in; ``rewards`` out)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class RuleService:
    """A reward service on loopback: 1.0 where the completion (the query less its prompt) is the label. After
    ``fail_after`` requests it answers 503 to every later one (``fail_after`` may be changed, None: never)."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.requests = 0
        self.fail_after = fail_after
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.requests += 1
                if service.fail_after is not None and service.requests > service.fail_after:
                    self.send_response(503)
                    self.end_headers()
                    return
                rewards = [
                    float(query.removeprefix(prompt) == label)
                    for query, prompt, label in zip(body["query"], body["prompts"], body["labels"], strict=True)
                ]
                data = json.dumps({"rewards": rewards}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
