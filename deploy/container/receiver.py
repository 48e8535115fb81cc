"""A demo webhook receiver for the container example: answers 204 to every POST and logs one JSON line each.

Standard library only, so it runs on the kafold image (compose.yaml's `receiver` service) or any Python 3.
It does not check the Standard Webhooks signature: a real receiver verifies it and applies each webhook-id once.
    python receiver.py [--host 0.0.0.0] [--port 8089]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Delivery = dict[str, Any]


def make_server(host: str, port: int, on_delivery: Callable[[Delivery], None]) -> ThreadingHTTPServer:
    """An HTTP server calling `on_delivery` with each POST's path, webhook-id and JSON body (serve_forever to run)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                payload = json.loads(body) if body else None
            except ValueError:
                payload = None
            on_delivery({"path": self.path, "webhook_id": self.headers.get("webhook-id"), "body": payload})
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # one JSON line per delivery is the log
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8089)
    args = parser.parse_args()

    def log(delivery: Delivery) -> None:
        print(json.dumps({"delivered": delivery["path"], "webhook_id": delivery["webhook_id"]}), flush=True)

    server = make_server(args.host, args.port, log)
    print(json.dumps({"listening": f"{args.host}:{args.port}"}), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
