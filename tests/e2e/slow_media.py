"""A media host on loopback that answers slowly: what keeps a real vLLM encoder busy with one request
(its fetch waits), for as long as a test needs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@contextmanager
def slow_media_host(
    content: bytes, delay: float, content_type: str = "image/png", on_get: Callable[[], None] | None = None
) -> Iterator[tuple[str, threading.Event]]:
    """A URL serving ``content`` ``delay`` seconds after each GET (``on_get`` runs as the GET arrives),
    and an event set at the first GET."""
    asked = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if on_get is not None:
                on_get()
            asked.set()
            time.sleep(delay)
            self.send_response(200)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/media.png", asked
    finally:
        server.shutdown()
