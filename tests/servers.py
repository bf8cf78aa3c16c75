"""A layerplan app served by uvicorn on 127.0.0.1 in a thread, for the HTTP tests."""

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


@contextmanager
def serving(app, wait_seconds: float = 10.0) -> Iterator[str]:
    """The app on a free port of 127.0.0.1 until the block ends; yields its base URL once /health
    answers (or wait_seconds have passed)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        for _ in range(int(wait_seconds / 0.05)):
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
